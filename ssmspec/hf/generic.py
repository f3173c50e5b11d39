"""Coupling to transformers' generation internals for the generic path (ssmspec.speculate.generic): a model's
forward driven exactly as HF's own decoding loop drives it, with several new tokens per call.

`HFState` holds what HF's `generate` keeps between forwards (the token ids so far, the attention mask, the
position ids and the model's cache object, whatever its class: a `Cache`, RWKV's state list, ...) and advances
it with HF's `prepare_inputs_for_generation` and the model's forward. Its snapshot is a deep copy of the cache
object: nothing about the cache's layout is assumed. Private transformers API used here, and only here:
`_prepare_cache_for_generation`, `_prepare_position_ids_for_generation`, `ALL_CACHE_NAMES`, `GenerationMode`,
`DummyLayer` (see `_layers_without_kv`), and the modules that keep their decoding state on themselves instead of in
a cache object (`MODULE_STATE`: RecurrentGemma's recurrent block and RG-LRU), which an HFState holds as part of its
own state (`held`) and hands to the modules for each of its forwards only.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DummyLayer, DynamicCache, DynamicLayer
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import ALL_CACHE_NAMES

from ssmspec.hf.instance import forward_takes

# modules whose forward keeps its decoding state on the module instead of in the cache object ("module.path:Class"
# -> attribute names): HF's RecurrentGemma (its conv window and RG-LRU state, None before a prefill, which then
# starts from zeros). Every HFState holds its own values of these and hands them to the modules for the length of
# each of its forwards, so that states of several prompts, snapshots and the probes' reference loop on the same
# model never read each other's (HF's own loop keeps one per model).
MODULE_STATE: dict[str, tuple[str, ...]] = {
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma:RecurrentGemmaRecurrentBlock": ("conv1d_state",),
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma:RecurrentGemmaRglru": ("recurrent_states",),
}


def module_state_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every decoding state `model` keeps on its modules (MODULE_STATE), in module order."""
    slots = []
    for module in model.modules():
        cls = type(module)
        slots += [(module, name) for name in MODULE_STATE.get(f"{cls.__module__}:{cls.__qualname__}", ())]
    return slots


# cache names under which a model's output returns its cache, as HF's loop reads them (older models' names map to
# the forward's `past_key_values`)
_RENAMED = {"mems": "past_key_values", "past_buckets_states": "past_key_values"}


@dataclass
class Snapshot:
    """An HFState as it was: its length and a private copy of its cache object, handed back by `restore` (so
    a snapshot restores once)."""

    length: int
    cache: tuple[str, Any] | None
    held: list[torch.Tensor | None]
    restored: bool = False


class HFState:
    """One prompt's decoding state as HF's generate keeps it, advanced by any number of tokens per forward."""

    def __init__(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
        model_inputs: dict[str, Any] | None = None, as_hf: bool = False,
    ) -> None:  # fmt: skip
        """`model_inputs`: what else the prompt holds for the model's forward (pixel values and image grids of a
        multimodal model, its token types), as HF's generate takes them: the prefill reads them, HF's
        `prepare_inputs_for_generation` drops what only a prefill reads afterwards. `as_hf`: the cache exactly as
        HF's loop keeps it (the probes' reference), without `_layers_without_kv`, which a multi-token forward needs
        on some models."""
        self.model = model
        self.as_hf = as_hf
        self.ids = input_ids
        kwargs: dict[str, Any] = {**(model_inputs or {}), "attention_mask": attention_mask.to(torch.long),
                                  "use_cache": True}  # fmt: skip
        if forward_takes(model, "position_ids"):
            kwargs["position_ids"] = model._prepare_position_ids_for_generation(input_ids, kwargs)
        config = copy.deepcopy(model.generation_config)
        # HF's cache for this model, as its generate makes it (models whose forward makes its own leave it unset)
        model._prepare_cache_for_generation(
            config, kwargs, GenerationMode.GREEDY_SEARCH, input_ids.shape[0], input_ids.shape[1] + 1
        )
        self.kwargs = kwargs
        self.length = 0  # tokens of `ids` the cache has absorbed
        self.slots = module_state_slots(model)
        self.held: list[torch.Tensor | None] = [None] * len(self.slots)  # this state's values of `slots`

    def _cache(self) -> tuple[str, Any] | None:
        for name in ("past_key_values", "cache_params", "state"):
            if self.kwargs.get(name) is not None:
                return name, self.kwargs[name]
        return None

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Feed `tokens` [B, n] after what was fed so far (None: the prompt, the first call); returns their
        logits [B, n, V]."""
        if tokens is not None:
            self._feed(self.length, tokens)
        n = self.ids.shape[1] - self.length
        inputs = self.model.prepare_inputs_for_generation(
            self.ids, next_sequence_length=n, is_first_iteration=self.length == 0, **self.kwargs
        )
        if "logits_to_keep" in inputs:  # HF's loop keeps the last position's; every fed token's is needed here
            inputs["logits_to_keep"] = n
        with self.holding():
            out = self.model(**inputs, return_dict=True)
        for name in ALL_CACHE_NAMES:
            if name in out and out[name] is not None:
                cache = out[name] if self.as_hf else _layers_without_kv(out[name], self.model.config)
                self.kwargs[_RENAMED.get(name, name)] = cache
                break
        self.length = self.ids.shape[1]
        return out.logits[:, -n:]

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Within: the model's modules hold this state's module-held values (`slots`); after, this state keeps
        what they hold and the modules get back what they held before (the user's model is left as it was)."""
        before = [getattr(m, name) for m, name in self.slots]
        for (m, name), value in zip(self.slots, self.held):
            setattr(m, name, value)
        try:
            yield
        finally:
            self.held = [getattr(m, name) for m, name in self.slots]
            for (m, name), value in zip(self.slots, before):
                setattr(m, name, value)

    def _feed(self, length: int, tokens: torch.Tensor) -> None:
        """The ids, attention mask, positions and token types as HF's loop has them after `tokens` [B, n] follow
        the first `length` tokens (what the cache absorbs at the next forward)."""
        n = tokens.shape[1]
        self.ids = torch.cat([self.ids[:, :length], tokens.to(self.ids.device)], dim=1)
        mask = self.kwargs["attention_mask"][:, :length]
        self.kwargs["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], n)], dim=1)
        if (positions := self.kwargs.get("position_ids")) is not None:
            positions = positions[..., :length]
            step = torch.arange(1, n + 1, dtype=positions.dtype, device=positions.device)
            self.kwargs["position_ids"] = torch.cat([positions, positions[..., -1:] + step], dim=-1)
        # token types as HF's _update_model_kwargs_for_generation extends them: the last type repeated; multimodal
        # types 0 (text) for generated tokens
        if (types := self.kwargs.get("token_type_ids")) is not None:
            types = types[:, :length]
            self.kwargs["token_type_ids"] = torch.cat([types, types[:, -1:].expand(-1, n)], dim=-1)
        if (types := self.kwargs.get("mm_token_type_ids")) is not None:
            types = types[:, :length]
            self.kwargs["mm_token_type_ids"] = torch.cat([types, types.new_zeros(types.shape[0], n)], dim=-1)

    def keep(self, length: int, tokens: torch.Tensor) -> None:
        """After a forward that fed more tokens than the cache keeps (a tree verified on the generic path, its
        cache set to the accepted path's state by the caller): the state as if `tokens` [B, n] had been fed after
        its first `length` tokens."""
        self._feed(length, tokens)
        self.length = self.ids.shape[1]

    @property
    def cache(self) -> Any:
        """The model's cache object (None before the prefill, for a model whose forward makes none)."""
        found = self._cache()
        return None if found is None else found[1]

    def snapshot(self) -> Snapshot:
        """This state, to go back to (`restore`)."""
        cache = self._cache()
        held = [None if v is None else v.clone() for v in self.held]
        return Snapshot(self.length, None if cache is None else (cache[0], copy.deepcopy(cache[1])), held)

    def restore(self, snap: Snapshot) -> None:
        """Back to `snap`: the tokens fed since are forgotten. A snapshot restores once (its copy of the cache
        becomes the state's own, without copying it again)."""
        if snap.restored:
            raise RuntimeError("this snapshot was restored already: take a new one")
        snap.restored = True
        self.length = snap.length
        self.ids = self.ids[:, : snap.length]
        self.kwargs["attention_mask"] = self.kwargs["attention_mask"][:, : snap.length]
        if (positions := self.kwargs.get("position_ids")) is not None:
            self.kwargs["position_ids"] = positions[..., : snap.length]
        for name in ("token_type_ids", "mm_token_type_ids"):
            if (types := self.kwargs.get(name)) is not None:
                self.kwargs[name] = types[:, : snap.length]
        if snap.cache is not None:
            name, cache = snap.cache
            self.kwargs[name] = cache
            snap.cache = None
        self.held, snap.held = snap.held, []


# the layer types of HF's configs that keep attention K/V in the cache's layers
_KV_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding")


def _layers_without_kv(cache: Any, config) -> Any:
    """`cache`, its never-filled attention layers at indices the config says hold no K/V replaced by HF's
    DummyLayer. HF's MiniMaxCache keeps a plain attention layer for every index and its lightning-attention state
    elsewhere; HF's mask code then takes layer 0 (lightning attention, empty) for the first full-attention layer
    and builds a multi-token forward's mask as if nothing were cached (one-token steps come out right only because
    a one-row mask broadcasts). With the empty layers marked as holding nothing, HF's own mask code finds the
    real first attention layer. Other caches are returned as they are."""
    types = getattr(config.get_text_config(), "layer_types", None)
    if not isinstance(cache, DynamicCache) or not types:
        return cache
    for i, layer in enumerate(cache.layers[: len(types)]):
        if types[i] not in _KV_TYPES and type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[i] = DummyLayer()
    return cache
