"""Coupling to transformers' causal-LM heads: a model's *features* are what its output embedding module
(`get_output_embeddings()`, the LM head) is called with, the last hidden state after the final norm. Drafters
that draft from the target's own features (ssmspec.speculate.drafters.head) read them from ssmspec's forwards.

A forward pre-hook on the LM head, installed once per model (where it has a draft head, before it is compiled: a
compiled forward calls only the hooks it was traced with; otherwise the first time its features are asked for), stores
its input in the capture this thread opened (`capturing`); outside a capture, or on another thread, it does nothing,
so plain forwards and other threads are unaffected. Private transformers API used here: none; the one assumption,
that the LM head is called once per forward on the features of every position it returns logits for, holds for
HF's `*ForCausalLM` classes, and `capturing` checks the shape it gets.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from ssmspec.compiled import compiled_as
from ssmspec.errors import UnsupportedModelError

_LOCAL = threading.local()
_HOOKED = "_ssmspec_feature_hook"


class Capture:
    """What one forward's LM head was called with: `features` [B, N, H] (None until it ran)."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head
        self.features: torch.Tensor | None = None


@torch.compiler.disable  # a compiled forward calls it eagerly (a graph break before the LM head): it sees the capture
def _store(module: nn.Module, args: tuple) -> None:
    box: Capture | None = getattr(_LOCAL, "capture", None)
    if box is not None and box.head is module and args:
        box.features = args[0]


def lm_head(model: nn.Module) -> nn.Module:
    """The model's output embedding module (UnsupportedModelError where it has none)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if getter is not None else None
    if not isinstance(head, nn.Module):
        raise UnsupportedModelError(
            type(model).__name__, "drafting from its features needs an output embedding (LM head)"
        )
    return head


def feature_size(model: nn.Module) -> int:
    """The width of the model's features: its LM head's input size."""
    head = lm_head(model)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise UnsupportedModelError(type(model).__name__, "drafting from its features needs a linear LM head")
    return int(weight.shape[1])


def install(model: nn.Module) -> bool:
    """Put the feature hook on the model's LM head (once); True where this call put it there. A model compiled
    before that has graphs that never call it: Dynamo does not guard on module hooks (torch internals, named
    here), so they stay valid for it and must be compiled anew (`enable` does)."""
    head = lm_head(model)
    if head.__dict__.get(_HOOKED):
        return False
    head.register_forward_pre_hook(_store)
    head.__dict__[_HOOKED] = True
    return True


def enable(model: nn.Module) -> None:
    """Make the model's forwards able to hand over their features (`install`); a model compiled before its LM head had
    the hook (compiled before it had a draft head) is compiled anew, as it was (`model.ssmspec_compile_call`): its
    graphs would never call the hook."""
    call = compiled_as(model).call
    if install(model) and call is not None:
        args, kwargs = call
        model.compile(*args, **kwargs)


@contextlib.contextmanager
def capturing(model: nn.Module, enabled: bool = True) -> Iterator[Capture | None]:
    """Within: the model's forwards on this thread leave their features in the yielded Capture (the last forward's;
    None where `enabled` is False)."""
    if not enabled:
        yield None
        return
    install(model)
    head = lm_head(model)
    outer = getattr(_LOCAL, "capture", None)
    box = _LOCAL.capture = Capture(head)
    try:
        yield box
    finally:
        _LOCAL.capture = outer


def positions(capture: Capture, logits: torch.Tensor) -> torch.Tensor:
    """The captured features [B, N, H] of the positions `logits` [B, N, V] were computed for (a head that only ran
    on the last positions, HF's `logits_to_keep`, gave fewer: its features are the last ones)."""
    features = capture.features
    if features is None:
        raise RuntimeError("the model's forward did not call its LM head: no features to draft from")
    if features.shape[:-1] != logits.shape[:-1]:
        if features.dim() == 3 and features.shape[0] == logits.shape[0] and features.shape[1] >= logits.shape[1]:
            return features[:, -logits.shape[1] :]
        raise RuntimeError(f"the LM head ran on features {tuple(features.shape)} for logits {tuple(logits.shape)}")
    return features
