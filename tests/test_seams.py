"""Seam discovery and the seam adapters' contract: module-local seam functions are found by name and signature,
and an adapter fails closed on any argument it does not understand."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import ssmspec
from ssmspec import UnsupportedModelError
from ssmspec.hf import seams
from ssmspec.speculate.runner import ModelRunner
from ssmspec.testing.strategies import cached_tiny_model
from ssmspec.tree import TokenTree


def test_module_local_seam_functions_are_found_by_name_and_signature():
    """LFM3 defines its own width-7 `causal_conv1d_fn` (no hub decorator): it is a seam."""
    model = cached_tiny_model("lfm3")
    conv = next(m for m in model.modules() if type(m).__name__ == "Lfm3ShortConv")
    found = seams.seams_called_by(conv)
    assert found["causal_conv1d_fn"][0] == "causal_conv1d_fn"
    assert found["causal_conv1d_update"][0] == "causal_conv1d_update"
    module = types.ModuleType("fake_modeling")

    def causal_conv1d_fn(x, y):  # same name, other signature: not a seam
        return x

    causal_conv1d_fn.__module__ = module.__name__
    assert seams.local_seam_name(causal_conv1d_fn, "causal_conv1d_fn", module.__name__) is None
    assert seams.local_seam_name(causal_conv1d_fn, "causal_conv1d_fn", "elsewhere") is None


def _conv_seam(hidden_states, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    raise AssertionError("HF's function must not run while verifying")


@pytest.fixture()
def verifying_call():
    model = ssmspec.transform(copy.deepcopy(cached_tiny_model("mamba2")))
    runner = ModelRunner(model)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    runner.prefill(ids, torch.ones_like(ids))
    tree = TokenTree.from_lists([[5, 6, 7]], [[-1, 0, 0]])
    with runner.cache.verifying(tree) as verification:
        outer = seams._LOCAL.mixer
        seams._LOCAL.mixer = seams.MixerCall(verification, 0, "model.layers.0.mixer")
        try:
            yield tree
        finally:
            seams._LOCAL.mixer = outer


@pytest.mark.parametrize(
    "extra,refused",
    [({"seq_idx": torch.zeros(1, 7, dtype=torch.int32)}, "seq_idx"),
     ({"cu_seqlens": torch.tensor([0, 7])}, "cu_seqlens"),
     ({"initial_states": torch.zeros(1, 4, 3)}, "initial_states"),
     ({"position_embeddings": (torch.ones(1), torch.ones(1))}, None),
     ({"seq_idx": None}, None)],
)  # fmt: skip
def test_adapters_fail_closed_on_arguments_they_do_not_know(verifying_call, extra, refused):
    wrapper = seams.tree_aware(_conv_seam, "causal_conv1d_fn")
    x = torch.randn(1, 4, 3 + verifying_call.num_nodes, dtype=torch.float64)
    w = torch.randn(4, 4, dtype=torch.float64)
    if refused:
        with pytest.raises(UnsupportedModelError, match=f"`{refused}` set") as err:
            wrapper(x, w, **extra)
        assert err.value.module_path == "model.layers.0.mixer"
    else:
        assert wrapper(x, w, activation="silu", **extra).shape == x.shape


def test_outside_verification_the_seam_is_hf_s_own():
    calls = []

    def seam(hidden_states, weight, bias=None, activation=None, **kwargs):
        calls.append(kwargs)
        return hidden_states

    wrapper = seams.tree_aware(seam, "causal_conv1d_fn")
    x = torch.ones(1, 2, 3)
    assert wrapper(x, None, seq_idx=None, anything=1) is x
    assert calls == [{"seq_idx": None, "anything": 1}]


class _Verification:
    """What a MixerCall reads of a verification: a layer's committed state; the records left."""

    def __init__(self, state: torch.Tensor) -> None:
        self.state, self.records, self.tree, self.commit_strategy = state, [], None, "replay"
        self.in_place = False

    def committed_state(self, layer: int, state_idx: int = 0) -> torch.Tensor:
        return self.state

    def record(self, module: str, seam: str, rec) -> None:
        self.records.append(rec)


def test_a_seam_called_per_head_owns_one_slice_of_the_state_per_call():
    """Zamba v1 calls `selective_scan_fn` once per head on a [B, D, S] slice of its [B, H, D, S] state: call k of a
    forward reads slice k and its record names it; a call beyond the heads, or a shape that is no slice, is refused."""
    state = torch.randn(2, 3, 4, 5)
    call = seams.MixerCall(_Verification(state), layer=1, module="m.mixer")
    for head in range(3):
        h0 = call.committed_state("selective_scan_fn", (2, 4, 5))
        assert torch.equal(h0, state[:, head])
        call.record("selective_scan_fn", "selective_scan", x=h0)
    assert [r.part for r in call.verification.records] == [0, 1, 2]
    with pytest.raises(UnsupportedModelError, match="which part of the state"):
        call.committed_state("selective_scan_fn", (2, 4, 5))
    whole = seams.MixerCall(_Verification(state), layer=1, module="m.mixer")
    assert whole.committed_state("selective_scan_fn", (2, 3, 4, 5)) is state
    whole.record("selective_scan_fn", "selective_scan")
    assert whole.verification.records[0].part is None
    with pytest.raises(UnsupportedModelError, match="which part of the state"):
        whole.committed_state("selective_scan_fn", (2, 4, 6))


def test_a_per_head_commit_writes_its_slice_of_the_cached_state():
    """The cache hands a per-head record's commit a view of its slice: writing it changes that head only."""
    model = cached_tiny_model("zamba")
    runner = ModelRunner(ssmspec.transform(copy.deepcopy(model)), decode_single_nodes=False)
    runner.prefill(torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long))
    cache = runner.cache
    layer = cache.linear_layers()[0]
    state = cache.layers[layer].recurrent_states[0]
    before = state.clone()
    rec = ssmspec.ops.Record("selective_scan", layer, 0, part=1)
    cache.state_tensor(rec).fill_(7.0)
    assert torch.equal(state[:, 0], before[:, 0]) and bool((state[:, 1] == 7.0).all())


def test_the_probe_refuses_per_head_scans_that_read_the_wrong_slice(monkeypatch):
    """The slice a per-head call owns is checked by value: with the heads' slices swapped, Zamba v1 is refused."""
    ref = cached_tiny_model("zamba")
    owned = seams.MixerCall.committed_state

    def swapped(self, seam, expected):
        h0 = owned(self, seam, expected)
        if self.part is None:
            return h0
        state = self.verification.committed_state(self.layer)
        self.part = state.shape[1] - 1 - self.part
        return state[:, self.part]

    monkeypatch.setattr(seams.MixerCall, "committed_state", swapped)
    with pytest.raises(UnsupportedModelError, match="differs from what HF's generate computes"):
        ssmspec.transform(copy.deepcopy(ref))
