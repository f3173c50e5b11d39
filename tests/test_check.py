"""The checker itself: it passes a correct model in every dtype it offers and fails a broken one (a checker that
cannot fail proves nothing)."""

from __future__ import annotations

import pytest
import torch

from ssmspec.cli import main
from ssmspec.speculate.runner import ModelRunner
from ssmspec.testing.check import EquivalenceError, check_model
from ssmspec.testing.configs import build_tiny_model
from ssmspec.testing.drafters import OracleDrafter


def _prompts():
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3], ids[1, :3] = 0, 0
    return [(ids, mask)]


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_the_checker_fails_a_commit_that_drops_the_last_accepted_token(family, monkeypatch):
    """A commit that stops one node short of the accepted path (its states miss a token) fails the float64 check, which
    passes the correct commit. (bfloat16 cannot tell such a commit from rounding by its states: one dropped token
    moved bamba's by 0.6%, and rounding moves correct ones by 0.2-1.3%; there the check rests on the tokens.)"""
    dtype = torch.float64
    model = build_tiny_model("mamba2", dtype=dtype)
    oracle = [lambda ref: OracleDrafter(ref, vocab_size=96)]
    report = check_model(model, _prompts(), oracle, max_new_tokens=10, commits=["replay"], decode_single_nodes=False,
                         default_call=False)  # fmt: skip
    assert report.runs == 1 and report.tie_flips == 0

    commit = ModelRunner.commit

    def short(self, last):
        tree = self._pending[0]
        parents = tree.parents.gather(1, last.to(tree.parents.device)[:, None])[:, 0].to(last.device)
        return commit(self, torch.where(parents >= 0, parents, last))  # the parent of the last accepted node

    monkeypatch.setattr(ModelRunner, "commit", short)
    with pytest.raises(EquivalenceError):
        check_model(model, _prompts(), oracle, max_new_tokens=10, commits=["replay"], decode_single_nodes=False,
                    default_call=False)  # fmt: skip


def test_the_checker_certifies_the_call_users_make_and_fails_it_where_it_differs(monkeypatch):
    """Besides its adversarial drafters, the checker compares the call a user makes (`model.generate(ids)` with the
    model's defaults) and that call with its steps captured, says which calls it certified and which the model cannot
    take, and fails where the default call's tokens differ from HF's."""
    from ssmspec.transform import SpecGenerationMixin

    report = check_model(build_tiny_model("mamba2", dtype=torch.float64), _prompts(), commits=["replay"])
    assert report.certified == ["adversarial drafters, replay commit", "default call", "default call, captured steps"]
    assert report.runs == 1 and not report.not_certified  # (runs: the adversarial drafters')
    report = check_model(build_tiny_model("inkling", dtype=torch.float64), _prompts(), commits=["replay"])
    assert "default call" in report.certified and "default call, captured steps" not in report.certified
    assert "reads positions from cache slots" in report.not_certified["default call, captured steps"]

    generate = SpecGenerationMixin.generate

    def off_by_one(self, *args, **kwargs):  # the default call's last token wrong
        out = generate(self, *args, **kwargs)
        if "speculation" not in kwargs:
            out = out.clone()
            out[0, -1] = (out[0, -1] + 1) % 96
        return out

    monkeypatch.setattr(SpecGenerationMixin, "generate", off_by_one)
    with pytest.raises(EquivalenceError, match="default call"):
        check_model(build_tiny_model("mamba2", dtype=torch.float64), _prompts(), commits=["replay"])


@pytest.mark.parametrize("family", ["mamba2", "bamba", "kimi_linear"])
def test_check_in_bfloat16_on_a_family(family, capsys):
    """`ssmspec check --dtype bfloat16` failed on 18 of the 28 families: its tolerances were float32's (a top-2 gap of
    1e-3, states within 1e-3), and bfloat16 rounds a logit of 4 to steps of 0.03 and states by 1-2 units in the last
    place (0.2-1.3%); it also compared the states of rows that a counted tie flip had sent elsewhere. Its defaults are
    now the engine's near-tie rule (8 units in the last place), and states are compared on the rows that emitted what
    plain decoding did."""
    assert main(["check", "--family", family, "--dtype", "bfloat16"]) == 0
    assert "bfloat16" in capsys.readouterr().out
