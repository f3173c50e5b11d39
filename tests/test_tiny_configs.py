"""The tiny test models are strong enough to catch state bugs: their recurrent state moves the next token's logits
well above the probe's float64 tolerance. (At HF's default weight scale it moved them by 1e-8 to 1e-6 in six
families, so a state committed wrongly, or ignored by a multi-token forward, passed every check.)"""

from __future__ import annotations

import os

import pytest
import torch

from ssmspec.hf.generic import HFState
from ssmspec.probe import TOLERANCE, _rel
from ssmspec.testing.configs import STRONG_STATE_FAMILIES, SUPPORTED_FAMILIES, build_tiny_model

# families whose mixers keep a recurrent state in HF's cache layers (the rest keep conv windows only)
_CONV_ONLY = ("lfm2", "lfm2_moe", "lfm3", "inkling", "inkling2")
_RECURRENT = tuple(f for f in SUPPORTED_FAMILIES if f not in _CONV_ONLY)
_THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
# the ci profile: the families that were below the tolerance at HF's default scale, and the two weakest of the rest
_CI = (*sorted(STRONG_STATE_FAMILIES), "mamba", "jamba")


def _state_effect(family: str, variant: int) -> float:
    """Relative change of the next token's logits when every recurrent state in the cache (and on the modules, for a
    model that keeps it there) is zeroed (what a forward that ignores the cached state would see)."""
    model = build_tiny_model(family, seed_variant=variant)
    ids = torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(0))
    state = HFState(model, ids[:, :12], torch.ones(1, 12, dtype=torch.long), as_hf=True)
    state.forward(None)
    before = state.snapshot()
    want = state.forward(ids[:, 12:])
    state.restore(before)
    zeroed = 0
    for layer in state._cache()[1].layers:
        for tensor in getattr(layer, "recurrent_states", {}).values():
            if tensor is not None:
                tensor.zero_()
                zeroed += 1
    for tensor in state.held:  # RecurrentGemma's conv windows and RG-LRU states
        tensor.zero_()
        zeroed += 1
    assert zeroed, f"{family}: no recurrent state in the cache"
    return _rel(state.forward(ids[:, 12:]), want)


@pytest.mark.parametrize("family", (_RECURRENT if _THOROUGH else _CI) + ("recurrent_gemma",))
@torch.no_grad()
def test_recurrent_state_matters(family: str) -> None:
    """Above the probe's tolerance in every family; a hundred times above it in those whose weights were scaled."""
    effect = _state_effect(family, 0)
    least = TOLERANCE[torch.float64] * (100 if family in STRONG_STATE_FAMILIES else 1)
    assert effect > least, f"{family}: the recurrent state moves the logits by {effect:.2g}"
