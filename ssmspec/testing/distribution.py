"""Distribution tests for speculative sampling: is the joint distribution of the first sampled tokens the same
as Hugging Face's own sampling? A two-sample chi-square test of homogeneity over many samples drawn as one
batch of identical prompts (rows sample independently), on both sides with the same settings.

    p = sampling_p_value(hf_model, transformed, prompt, samples=3000, do_sample=True, temperature=0.7,
                         prompt_lookup_num_tokens=3)
    assert p > 1e-3

The test can fail: `tests/speculate/test_sampling.py` shows it rejecting two biased samplers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from ssmspec.speculate.config import SpecConfig


def joint_counts(sequences: torch.Tensor, prompt_length: int, tokens: int = 3) -> Counter:
    """How often each tuple of the first `tokens` generated tokens occurs, over the rows of `sequences`."""
    return Counter(tuple(row) for row in sequences[:, prompt_length : prompt_length + tokens].tolist())


def chi_square_p_value(a: Counter, b: Counter, min_count: int = 10) -> float:
    """p-value of the two-sample chi-square test that `a` and `b` come from one distribution; cells seen fewer
    than `min_count` times in both samples together are pooled into one cell (so expected counts are not tiny).

    Raises:
        ImportError: scipy is not installed (it is part of the `test` extra).
    """
    from scipy.stats import chi2_contingency

    cells = sorted(set(a) | set(b))
    kept = [c for c in cells if a[c] + b[c] >= min_count]
    rest = [c for c in cells if a[c] + b[c] < min_count]
    columns = [(a[c], b[c]) for c in kept] + [(sum(a[c] for c in rest), sum(b[c] for c in rest))]
    columns = [col for col in columns if sum(col) > 0]
    if len(columns) < 2:
        return 1.0  # one outcome on both sides: nothing to tell apart
    return float(chi2_contingency([[col[0] for col in columns], [col[1] for col in columns]])[1])


def sampling_p_value(
    reference: nn.Module,
    transformed: nn.Module,
    prompt: torch.Tensor,
    *,
    samples: int = 3000,
    tokens: int = 3,
    seed: int = 0,
    **generate_kwargs: Any,
) -> tuple[float, dict]:
    """Sample `samples` continuations of `prompt` ([1, L]) with HF's `generate` on `reference` and with
    speculative `generate` on `transformed`, both with `generate_kwargs` (which must set `do_sample=True`;
    speculation-only arguments such as `prompt_lookup_num_tokens`, `speculation`, `assistant_model` go to the
    speculative side only). Returns (p-value of the joint of the first `tokens` tokens, speculative stats)."""
    speculation = ("prompt_lookup_num_tokens", "speculation", "assistant_model")
    spec_only = {k: generate_kwargs.pop(k) for k in speculation if k in generate_kwargs}
    ids = prompt.expand(samples, -1)
    torch.manual_seed(seed)
    want = reference.generate(ids, max_new_tokens=tokens + 1, **generate_kwargs)
    out = transformed.generate(ids, max_new_tokens=tokens + 1, generator=torch.Generator().manual_seed(seed + 1),
                               return_dict_in_generate=True, **spec_only, **generate_kwargs)  # fmt: skip
    length = prompt.shape[1]
    p = chi_square_p_value(joint_counts(out.sequences, length, tokens), joint_counts(want, length, tokens))
    return p, out.spec_stats


# the distribution tests' matrix: drafters (chain / tree x n-gram / draft model) and warpers; fixed depths (the
# adaptive default would stop drafting at the tests' batch of thousands of rows, where verifying costs most)
DRAFTS = {
    "ngram-chain": {"speculation": SpecConfig(drafter="prompt_lookup", tree=False, num_draft_tokens=3, adaptive=False)},
    "ngram-tree": {
        "speculation": SpecConfig(drafter="prompt_lookup", tree=True, tree_budget=6, num_draft_tokens=3, adaptive=False)
    },
    "draft-chain": {"speculation": SpecConfig(drafter="draft_model", tree=False, num_draft_tokens=3, adaptive=False)},
    "draft-tree": {
        "speculation": SpecConfig(drafter="draft_model", tree=True, tree_budget=6, num_draft_tokens=2, adaptive=False)
    },
    "draft-beam": {
        "speculation": SpecConfig(
            drafter="draft_model",
            tree=True,
            tree_budget=6,
            num_draft_tokens=2,
            sampling_tree="stochastic_beam",
            adaptive=False,
        )
    },
    # a draft head (the transformed target carries one: `tiny_sampling_head`): its sampled chain, and its sampled tree
    # fused with prompt lookup's deterministic one
    "head-chain": {"speculation": SpecConfig(drafter="draft_head", tree=False, num_draft_tokens=3, adaptive=False)},
    "head-tree": {
        "speculation": SpecConfig(drafter="draft_head", tree=True, tree_budget=6, num_draft_tokens=2, adaptive=False)
    },  # fmt: skip
}
WARPS = {"t1": {"temperature": 1.0, "top_k": 0}, "t0.7-topk-topp": {"temperature": 0.7, "top_k": 6, "top_p": 0.9}}


def case_kwargs(drafter: str, warp: str, draft: nn.Module) -> dict:
    """generate() arguments of one case of the matrix (`draft` is used by the draft-model drafters)."""
    extra = {"assistant_model": draft} if drafter.startswith("draft") else {}
    return {"do_sample": True, **DRAFTS[drafter], **extra, **WARPS[warp]}


def tiny_sampling_head(target: nn.Module, steps: int = 200):
    """A draft head for the distribution tests' target, trained briefly on text the target samples (so its drafts
    are accepted often, not always)."""
    from ssmspec.speculate.head_training import train_head

    torch.manual_seed(0)
    starts = torch.randint(3, target.config.vocab_size, (32, 3), generator=torch.Generator().manual_seed(2))
    text = target.generate(starts, do_sample=True, max_new_tokens=40, min_new_tokens=40, top_k=0)
    return train_head(target, text, seq_len=32, steps=steps, batch_size=256, topk=16).double()


def tiny_sampling_setup(vocab_size: int = 16, draft_noise: float = 0.7):
    """The models and prompt the distribution tests use: a float64 tiny Mamba2 target with peaked but varied
    distributions (top probability about 0.4-0.95), a draft that agrees with it only in part (its head
    perturbed), and a prompt that continues as the target likes to, with repeats, so that n-gram drafts
    (chains, and trees where a context was followed by several tokens) are often but not always accepted.

    Returns:
        (target, draft, prompt [1, L]); neither model is transformed.
    """
    from ssmspec.testing.configs import build_tiny_model

    def build(noise: float):
        model = build_tiny_model("mamba2", vocab_size=vocab_size, seed=0)
        with torch.no_grad():
            w = model.lm_head.weight
            w.mul_(4.0)
            w.add_(noise * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(1), dtype=w.dtype))
        return model

    target = build(0.0)
    seed = torch.tensor([[3, 4, 5, 3, 4, 5]])
    greedy = target.generate(seed, do_sample=False, max_new_tokens=45, eos_token_id=None)[0]
    eos = target.generation_config.eos_token_id
    # cut where the greedy continuation runs on for 4 tokens without EOS (EOS stays possible, not dominant)
    cut = next(n for n in range(32, 41) if eos not in greedy[n : n + 4].tolist())
    return target, build(draft_noise), greedy[None, :cut]
