"""ssmspec.transform(): make a Hugging Face SSM / hybrid causal LM verify token trees and speculate.

It installs the tree-aware seams (ssmspec.hf.seams) on every mixer, checks that every recurrent layer is
covered and every cache layer can take a tree (otherwise UnsupportedModelError names the module), gives the
model an HF-style `generate` that speculates by default (prompt_lookup_num_tokens, assistant_model,
speculation=SpecConfig(...) choose how; speculation=False is HF's own), and runs the value-checking probe
(ssmspec.probe). It is transactional: a refused transform leaves the model exactly as it was. Plain forwards
stay HF's.
"""

from __future__ import annotations

import copy
import re
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationConfig
from transformers.utils import ModelOutput

from ssmspec import linear as packed_linear
from ssmspec.compile.backend import CUDA_GRAPH_MODES, compile_mode, mode_and_options, region_options
from ssmspec.compile.lower import StepCompiler
from ssmspec.errors import UnsupportedModelError, not_one_of
from ssmspec.hf import attention as hf_attention
from ssmspec.hf import features as hf_features
from ssmspec.hf import instance as hf_instance
from ssmspec.hf import layers as hf_layers
from ssmspec.hf import mtp as hf_mtp
from ssmspec.hf import seams as hf_seams
from ssmspec.hf import tree_modules
from ssmspec.hf.mtp import MTPModule
from ssmspec.ops import using_kernel_policy
from ssmspec.probe import probe, probe_generic, probe_generic_batches, probe_generic_trees
from ssmspec.speculate import generate as spec_generate
from ssmspec.speculate.config import SpecConfig
from ssmspec.speculate.drafters import check_vocab
from ssmspec.speculate.drafters.head import CHAINS_KEY, DraftHead, check_head, compiled_chains, find_head
from ssmspec.speculate.drafters.head import WEIGHTS as HEAD_WEIGHTS
from ssmspec.speculate.generic import CHAINS_ONLY, ROW_BY_ROW
from ssmspec.speculate.plan import plan_call

# module class names that say "this holds the recurrent state", strongest first: the module an error names
_RECURRENT_NAMES = (
    re.compile(r"mamba|mixer|rwkv|recurrent|lstm|rglru|ssm|linear_?attn|lightning|time_?mix|conv|compressor", re.I),
    re.compile(r"selfattention|block", re.I),
)
_SUPPORTED_ATTN = ("eager", "sdpa")
_KERNEL_POLICIES = {None: "auto", "auto": "auto", True: "kernels", "kernels": "kernels", False: "reference",
                    "reference": "reference"}  # fmt: skip


@dataclass
class TransformInfo:
    """What transform() found: rewritten mixers and their seams, recurrent and attention layer indices, and
    what the probe established: whether branching trees and batches verify exactly (`limits` says why not,
    naming the layer), whether the model reads positions from cache slots, the largest relative differences;
    which path verifies (`path`: the seams, or HF's own forward for a model without them) and whether the generic
    path is exact for it (`generic`)."""

    mixers: dict[str, list[str]]
    recurrent_layers: list[int]
    attention_layers: list[int]
    trees: bool = True
    batches: bool = True
    limits: dict[str, str] = field(default_factory=dict)
    slot_positions: bool = False
    probe_diffs: dict[str, float] = field(default_factory=dict)
    # bfloat16/float16: the low-precision probe's finding that the float32 probe overruled as rounding (else None)
    probe_rounding: str | None = None
    # "seams" (ssmspec's tree-aware mixers) or "generic" (HF's own forward: ssmspec.speculate.generic)
    path: str = "seams"
    # whether the generic path is exact for this model (None: not probed yet; limits["generic"] says why not), and
    # for a batch of prompts, row by row (limits["generic_batches"])
    generic: bool | None = None
    generic_batches: bool | None = None
    # whether the generic path verifies branching trees (its recurrence modules' tree form, ssmspec.hf.tree_modules,
    # installed and found exact by its probe)
    generic_trees: bool = False


def _describe(model: nn.Module) -> str:
    """The first module whose class name says it holds recurrent state, as "path (Class)" (the model's class where
    none does). The family's own prefix is not evidence (every RecurrentGemma class starts with "Recurrent")."""
    prefix = re.sub(r"(PreTrainedModel|Model|ForCausalLM|ForConditionalGeneration)$", "", type(model).__name__)
    for pattern in _RECURRENT_NAMES:
        for path, module in model.named_modules():
            name = type(module).__name__
            own = name.removeprefix(prefix) if prefix else name
            if path and pattern.search(own) and not re.search(r"Model$|ForCausalLM|DecoderLayer$", name):
                return f"{path} ({name})"
    return type(model).__name__


def _check(model: nn.Module, mixers: dict[str, list[str]]) -> TransformInfo:
    config = model.config
    stateful = bool(getattr(model, "_is_stateful", False))
    try:
        layers = DynamicCache(config=config).layers
        types = hf_layers.layer_types(config)
    except Exception as exc:  # noqa: BLE001 - any failure here means HF cannot cache this model generically
        if stateful:
            raise UnsupportedModelError(_describe(model), f"its cache cannot be built generically ({exc})") from exc
        layers, types = [], []
    recurrent = hf_layers.recurrent_layers(layers)
    attention = hf_layers.attention_layers(layers)
    if stateful and not mixers:
        raise UnsupportedModelError(
            _describe(model),
            "its recurrence does not go through a known transformers kernel seam (causal_conv1d, selective_scan, "
            "mamba_chunk_scan_combined, chunk_gated_delta_rule, chunk_kda)",
        )
    covered = {getattr(model.get_submodule(p), "layer_idx", None) for p in mixers}
    for i in recurrent:
        if i not in covered:
            raise UnsupportedModelError(f"layer {i}", "a recurrent layer whose mixer calls no known kernel seam")
    bad = hf_layers.unsupported_layer(layers, types)
    if bad is not None:
        raise UnsupportedModelError(f"layer {bad[0]}", bad[1])
    windows = {a.window for a in attention if a.window is not None}
    if len(windows) > 1:
        raise UnsupportedModelError(
            type(model).__name__, f"sliding-window layers with different windows {sorted(windows)} (one mask per type)"
        )
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if attention and impl not in _SUPPORTED_ATTN:
        raise UnsupportedModelError(
            type(model).__name__, f"attention implementation {impl!r} cannot take a tree mask; use 'sdpa' or 'eager'"
        )
    return TransformInfo(mixers=mixers, recurrent_layers=recurrent, attention_layers=[a.index for a in attention])


def _generic_info(model: nn.Module, refused: UnsupportedModelError) -> TransformInfo:
    """What transform found for a model the seams refused: the generic path (ssmspec.speculate.generic) where
    its probe finds it exact, else UnsupportedModelError with both reasons."""
    chains = probe_generic(model)
    trees = _generic_trees(model)
    if chains is not None and trees is not None:
        why = chains if trees == CHAINS_ONLY else f"{chains}; and {trees.removeprefix(CHAINS_ONLY).strip(' ()')}"
        raise UnsupportedModelError(
            refused.module_path, f"{refused.reason}; and the generic path (HF's own forward) is not exact: {why}"
        )
    limits = {"seams": f"{refused.module_path}: {refused.reason}"}
    if trees is not None:
        limits["trees"] = trees
    elif chains is not None:  # HF's multi-token forward is not exact, its tree form is: every step goes through it
        limits["chains"] = f"chains are verified through the tree form (HF's own multi-token forward: {chains})"
    info = TransformInfo(mixers={}, recurrent_layers=[], attention_layers=[], trees=trees is None, limits=limits,
                         path="generic", generic=True, generic_trees=trees is None)  # fmt: skip
    info.batches = _generic_batches(model, info)
    # batches run row by row (`limits["batches"]` says so, or why HF's batched loop is not what its rows compute);
    # a call without speculation kwargs runs HF's own batched loop for them (one forward a token for all rows)
    limits["batches"] = ROW_BY_ROW if info.batches else limits["generic_batches"]
    return info


def _generic_trees(model: nn.Module) -> str | None:
    """Install the tree form of the model's recurrence modules on the generic path (ssmspec.hf.tree_modules) and
    probe it; None where trees are exact, else why the generic path verifies chains only (the tree form then
    removed again)."""
    if not tree_modules.install(model):
        return CHAINS_ONLY
    why = probe_generic_trees(model)
    if why is None:
        return None
    tree_modules.uninstall(model)
    return f"{CHAINS_ONLY} (its recurrence modules' tree form is not exact: {why})"


def _generic_batches(model: nn.Module, info: TransformInfo) -> bool:
    """Whether the generic path's row-by-row batches are HF's batches on this model (probed once, kept on
    `info.generic_batches`; the reason it is not in `info.limits["generic_batches"]`)."""
    return _probed_once(model, info, "generic_batches", probe_generic_batches)


def _probed_once(model: nn.Module, info: TransformInfo, field: str, probe_fn) -> bool:
    """`info.<field>`, set from `probe_fn(model)` the first time it is asked for (None: not probed yet); the
    probe's reason for a False kept in `info.limits[field]`."""
    if getattr(info, field) is None:
        why = probe_fn(model)
        setattr(info, field, why is None)
        if why is not None:
            info.limits[field] = why
    return getattr(info, field)


def generic_allowed(model: nn.Module, batch: bool = False) -> bool:
    """Whether `SpecConfig(path="generic")` may run on this transformed model (`batch`: on a batch of prompts):
    its generic probes, run the first time they are asked for on a model transform gave seams (the reasons kept
    in `info.limits["generic"]` and `info.limits["generic_batches"]`)."""
    info = model.ssmspec_info
    return _probed_once(model, info, "generic", probe_generic) and (not batch or _generic_batches(model, info))


class SpecGenerationMixin:
    """Added to a transformed model's class: speculative `generate`, per-model kernel policy in `compile`,
    and pickling that finds the class again. `generate` speculates by default; `speculation=False` is HF's own."""

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        *,
        prompt_lookup_num_tokens: int | None = None,
        assistant_model: nn.Module | None = None,
        speculation: SpecConfig | bool | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | ModelOutput:
        """HF generate, speculative: greedy output equal to HF's, sampling with HF's distribution.

        Every call speculates (nothing to opt into: output does not change): with `speculation` if given, else
        the model's default SpecConfig (`transform(model, config)`), else the default for the call's HF kwargs
        (ssmspec.speculate.defaults: a draft model for `assistant_model`, n-grams `prompt_lookup_num_tokens`
        deep, default n-gram drafting without either). `speculation=False` runs HF's own `generate`, as does a
        call without speculation kwargs whose settings speculation does not apply (beam search, ...) or that
        the model's probe limited (trees or batches it found inexact): HF's decoding is what the user asked
        for there. Every other setting is resolved as HF's `generate` resolves it and either applied exactly or
        refused (see the docs' Generation settings page).

        Args:
            inputs: [batch, length] token ids, left-padded for batches (with `attention_mask=`).
            generation_config: as in HF; the model's own `generation_config` fills what it leaves unset.
            prompt_lookup_num_tokens: draft this many tokens deep by n-gram lookup (HF's argument).
            assistant_model: a causal LM with the same vocabulary that drafts; it is never changed (a
                transformed copy sharing its weights drafts).
            speculation: the speculation settings (drafter, chain or tree, budgets, commit strategy); False:
                HF's own generate; True: the defaults, refusing what they cannot apply.
            **kwargs: HF generate's keyword arguments (`max_new_tokens`, `attention_mask`, `eos_token_id`,
                `return_dict_in_generate`, ...).

        Returns:
            [batch, length + new] token ids as HF's `generate`, or, with `return_dict_in_generate=True`, an
            output with `sequences` and `spec_stats` (steps, accepted tokens, near-ties, ...).

        Raises:
            UnsupportedSettingError: a setting that is not applied exactly (named), where speculation was asked
                for.
            UnsupportedModelError: trees or batches the transform-time probe found inexact for this model,
                where speculation was asked for.
            VocabMismatchError: the assistant model's vocabulary differs from the target's.
            TypeError: `speculation` is not a SpecConfig or a bool, or `assistant_model` is not a model.
        """
        call = self._speculative_call(generation_config, prompt_lookup_num_tokens, assistant_model, speculation)
        if call is not None:
            with using_kernel_policy(getattr(self, "ssmspec_kernel_policy", None)):
                try:
                    return spec_generate.generate(self, inputs, generation_config, kwargs=kwargs, **call)
                except spec_generate.NotSpeculated:  # refused before anything ran: HF's own decoding
                    pass
        return super().generate(inputs, generation_config, **kwargs)

    def _speculative_call(
        self, generation_config: GenerationConfig | None, prompt_lookup_num_tokens: int | None,
        assistant_model: nn.Module | None, speculation: SpecConfig | bool | None,
    ) -> dict[str, Any] | None:  # fmt: skip
        """`generate`'s arguments for speculation (ssmspec.speculate.generate / .plan: the draft model prepared, the
        model's default config where the call asked for nothing, `fallback` then), or None for HF's own generate
        (`speculation=False`)."""
        if speculation is False:
            if prompt_lookup_num_tokens is not None or assistant_model is not None:
                raise ValueError("speculation=False (HF's own generate) with prompt_lookup_num_tokens= or "
                                 "assistant_model=: HF refuses both for stateful models; drop one")  # fmt: skip
            return None
        asked = prompt_lookup_num_tokens is not None or assistant_model is not None or speculation is not None
        if speculation is True:  # the defaults, asked for: refusals raise
            speculation = None
        configured = any(getattr(c, "prompt_lookup_num_tokens", None) is not None
                         for c in (generation_config, self.generation_config))  # fmt: skip
        default = not asked and not configured
        if default:
            speculation = getattr(self, "ssmspec_config", None)
        if assistant_model is not None:
            if not isinstance(assistant_model, nn.Module) or not hasattr(assistant_model, "config"):
                raise TypeError(
                    "assistant_model= must be a causal LM model object (e.g. AutoModelForCausalLM.from_pretrained("
                    f"path)), got {type(assistant_model).__name__} {assistant_model!r:.60}"
                )
            check_vocab(assistant_model, self.config.get_text_config().vocab_size)
        return {
            "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
            "draft": prepare_draft(assistant_model) if assistant_model is not None else None,
            "speculation": speculation, "fallback": default, "head": self.__dict__.get("ssmspec_draft_head"),
            "generic_exact": lambda batch: generic_allowed(self, batch),
        }  # fmt: skip

    def save_pretrained(self, save_directory, *args, **kwargs):
        """HF's save_pretrained, and the model's draft head beside the weights (`draft_head.safetensors` and
        `draft_head.json`, where `ssmspec.transform` finds it when the checkpoint is loaded again)."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        head = self.__dict__.get("ssmspec_draft_head")
        if isinstance(head, MTPModule) and kwargs.get("is_main_process", True):  # (HF's state dict drops it)
            from safetensors.torch import save_file

            save_file(hf_mtp.mtp_state(head), str(Path(save_directory) / hf_mtp.MTP_FILE))
        elif head is not None and kwargs.get("is_main_process", True):
            head.save(save_directory)
        return out

    def compile(self, *args, **kwargs):
        """nn.Module.compile; with backend="ssmspec", the `kernels` option becomes this model's kernel policy
        (for its compiled graphs and its commits), not the process's. A compiled model speculates with static
        shapes (SpecConfig.static_shapes): one graph per tree-size bucket instead of one per tree size; its
        commits are compiled with the same backend, mode and options. A model with a draft head is compiled with
        its LM head's feature hook, which the head drafts from."""
        policy = None
        if hf_instance.tensor_parallel(self) > 1:
            raise UnsupportedModelError(
                type(self).__name__,
                "compiling a tensor-parallel model is not supported by ssmspec: its compiled graphs would run on "
                "distributed tensors untested, and the ssmspec backend picks kernels by timing each process alone",
            )
        if kwargs.get("backend") == "ssmspec":  # checked first: a refused compile changes nothing
            option = (kwargs.get("options") or {}).get("kernels")
            if option not in _KERNEL_POLICIES:
                raise not_one_of("ssmspec backend: kernels", option, _KERNEL_POLICIES)
            policy = _KERNEL_POLICIES[option]
        self.ssmspec_static_shapes = True
        self.ssmspec_compile_call = (args, dict(kwargs))  # to compile a copy alike (VocabTrim's trimmed draft)
        if kwargs.get("backend") == "ssmspec" and not packed_linear.is_packed(self):  # transform(prepack=False)
            kwargs["options"] = {"prepack": False, **(kwargs.get("options") or {})}
        kwargs = mode_and_options(region_options(kwargs))  # own recompilation budget; a mode with options
        # the commit between two verifications is compiled the same way (ssmspec.speculate.runner.compiled_fold)
        self.ssmspec_compile_options = {k: kwargs[k] for k in ("backend", "mode", "options", "isolate_recompiles",
                                                               "recompile_limit") if k in kwargs}  # fmt: skip
        self.__dict__.pop("_ssmspec_compiled_commit", None)
        self.__dict__.pop("_ssmspec_calibration", None)  # measured on the eager model: measured again compiled
        if policy is not None:
            self.ssmspec_kernel_policy = policy
        if self.__dict__.get("ssmspec_draft_head") is not None:
            # the LM head's feature hook first: Dynamo does not guard on module hooks, so a forward compiled without
            # it (the warm-up's prompts) would never hand its features to the head (ssmspec.hf.features)
            hf_features.install(self)
        return super().compile(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        _, _, *rest = super().__reduce_ex__(protocol)
        return (_new_transformed, (type(self).__ssmspec_base__,), *rest)

    def __setstate__(self, state):
        super().__setstate__(state)
        hf_seams.reinstall(self)  # a new process has HF's own seams in the modeling modules
        hf_attention.install(self)


_CLASSES: dict[type, type] = {}


def transformed_class(cls: type) -> type:
    """The class of a transformed `cls` model: same name (so save_pretrained writes the original
    `architectures`), SpecGenerationMixin first. One per original class."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            cls.__name__,
            (SpecGenerationMixin, cls),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__ssmspec_base__": cls},
        )
    return _CLASSES[cls]


def _new_transformed(base: type) -> nn.Module:
    """Unpickling: an empty instance of the transformed class of `base` (its state is set next)."""
    return object.__new__(transformed_class(base))


def transform(
    hf_model: nn.Module, config: SpecConfig | None = None, *, prepack: bool | None = None,
    compile: bool | dict[str, Any] = False, draft_head: DraftHead | MTPModule | str | PathLike | None = "auto",
) -> nn.Module:  # fmt: skip
    """Make `hf_model` tree-verifiable and speculative, in place; returns the same object.

    Plain forward logits stay HF's own; `generate` speculates, with `config` or ssmspec's defaults unless a
    call says otherwise (`speculation=False`: HF's own generate). At the end a probe checks, by value,
    that tree verification reproduces HF's forward; what it found is in `model.ssmspec_info`. A model loaded
    with `device_map` (accelerate's hooks, CPU / disk offload) or `tp_plan` (tensor parallelism: transform and
    generate in every process, with the same inputs) is transformed where it lies.

    Args:
        hf_model: a Hugging Face causal LM (`PreTrainedModel` with `generate`): an SSM, a hybrid, or a plain
            transformer (e.g. to use as a draft).
        config: default speculation settings for `generate`; None: ssmspec's defaults
            (ssmspec.speculate.defaults), or on a model transformed before, the settings it has.
        prepack: on a CPU, ssmspec's own forwards (prefill, decode, verify) run every float32 / bfloat16
            `nn.Linear` on a oneDNN copy of its weight packed once (ssmspec.linear): a verify step of 2-16
            tokens then reads each weight once, as a decode step does. It holds as much memory again as the
            linear weights; False keeps `F.linear` (no copy). Plain forwards are HF's either way. None: True, or
            on a model transformed before, as it was.
        compile: True compiles the model for speed as measured fastest and warms it up once, with a progress bar,
            so that the first request does not pay for compilation (`compile_fast`): on a CPU each step (the plain
            step, every tree-size bucket's greedy step; a sampled call's verify steps and commits on first use)
            captured and compiled whole by Inductor, the prompt run eagerly; on a GPU the forward compiled
            (`compile_options`: the ssmspec backend) and each verify step captured as a CUDA graph. A dict:
            `warmup` (batch sizes to warm up, default (1,); () for none) and `progress`, and any `model.compile`
            keyword arguments, which compile the forward with them instead (on a CPU too). If compiling fails, the
            model stays eager, with one warning.
        draft_head: the draft head (EAGLE style, trained for this model: ssmspec.speculate.head_training) that
            `SpecConfig(drafter="draft_head")` drafts with, and the defaults where it measured faster: a
            DraftHead, a directory holding one (`DraftHead.save`), "auto" (default: on a model transformed before,
            the head it has; else the one saved beside the model's checkpoint, `draft_head.safetensors` in its local
            `name_or_path`, if any; else the MTP layer that checkpoint ships, its `mtp.*` tensors: ssmspec.hf.mtp)
            or None. A directory or safetensors file with MTP tensors gives the model's MTP layer from them (an
            MTP layout ssmspec does not build, or tensors missing from it, are refused by name). `save_pretrained`
            saves it beside the weights (an MTP layer as `mtp.safetensors`).

    Returns:
        The same model object, its class extended with `SpecGenerationMixin` (same class name).

    Raises:
        TypeError: `hf_model` is not a causal LM (or is `torch.compile`'s wrapper of one), or `config` is not a
            SpecConfig.
        UnsupportedModelError: a module ssmspec cannot verify exactly (named, with the reason), or a draft head
            made for another model; the model is left exactly as it was.
    """
    if hf_instance.compile_wrapper(hf_model):  # (it forwards `generate` and `config`: caught before they are read)
        raise TypeError(
            "ssmspec.transform got the wrapper torch.compile(model) returns, whose generate would not speculate: "
            "transform the model itself and compile it with ssmspec.transform(model, compile=True) (or "
            "model.compile(...) after transform)"
        )
    if not hasattr(hf_model, "generate") or not hasattr(hf_model, "config") or not isinstance(hf_model, nn.Module):
        raise TypeError("ssmspec.transform expects a Hugging Face causal LM (a PreTrainedModel with generate)")
    if config is not None and not isinstance(config, SpecConfig):
        raise TypeError(f"ssmspec.transform(model, config): config must be an ssmspec.SpecConfig, got {config!r}")
    if degrees := hf_instance.parallel_degrees(hf_model):
        kinds = ", ".join(f"{kind} parallelism of degree {d}" for kind, d in degrees.items())
        raise UnsupportedModelError(
            type(hf_model).__name__,
            f"it was loaded with {kinds}: ssmspec speculates on one process or under tensor parallelism "
            "(tp_plan) only (docs: Big models); load it with tp_plan or device_map",
        )
    again = isinstance(hf_model, SpecGenerationMixin)
    if again and isinstance(draft_head, str) and draft_head == "auto" and "ssmspec_draft_head" in hf_model.__dict__:
        head = hf_model.__dict__["ssmspec_draft_head"]  # a model transformed before keeps what it has
    else:
        head = _draft_head(hf_model, draft_head)  # checked first: a refused head changes nothing
    if again:  # what is given changes; what is left out stays as it was
        if config is not None:
            hf_model.ssmspec_config = config
        hf_model.__dict__["ssmspec_draft_head"] = head
        if head is not None:  # hooked now, and compiled anew if compiled without the hook (as `compile` would have)
            hf_features.enable(hf_model)
        if prepack is not None:
            _set_prepack(hf_model, prepack)
        if compile:
            compile_fast(hf_model, **(compile if isinstance(compile, dict) else {}))
        return hf_model
    original_class = hf_model.__class__
    changed: list[nn.Module] = []
    linears: list[nn.Module] = []
    try:
        linears = packed_linear.install(hf_model) if prepack is not False else []
        try:
            hf_attention.install(hf_model)  # (pass-through outside ssmspec's forwards: other models unaffected)
            mixers, changed = hf_seams.install(hf_model)
            info = _check(hf_model, mixers)
            hf_model.__class__ = transformed_class(original_class)
            hf_model.ssmspec_info = info
            result = probe(hf_model)
            info.trees, info.batches, info.limits = result.trees, result.batches, result.limits
            info.slot_positions = result.slot_positions
            info.probe_diffs = {"logits": result.max_logit_diff, "layers": result.max_layer_diff}
            info.probe_rounding = result.rounding
        except UnsupportedModelError as refused:  # no seams (or not exact): HF's own forward, where it is exact
            hf_seams.uninstall(changed)
            changed = []
            hf_model.__class__ = original_class
            hf_model.__dict__.pop("ssmspec_info", None)
            info = _generic_info(hf_model, refused)
            hf_model.__class__ = transformed_class(original_class)
            hf_model.ssmspec_info = info
        hf_model.ssmspec_config = config
        hf_model.__dict__["ssmspec_draft_head"] = head  # not a submodule: the model's state dict stays HF's
    except BaseException:
        hf_seams.uninstall(changed)
        tree_modules.uninstall(hf_model)
        packed_linear.uninstall(linears)
        hf_model.__class__ = original_class
        for name in ("ssmspec_info", "ssmspec_config", "ssmspec_draft_head"):
            hf_model.__dict__.pop(name, None)
        raise
    if compile:
        compile_fast(hf_model, **(compile if isinstance(compile, dict) else {}))
    return hf_model


def _draft_head(model: nn.Module, head: DraftHead | MTPModule | str | PathLike | None) -> DraftHead | MTPModule | None:
    """The draft head `transform(..., draft_head=head)` attaches, checked against the model (module docstring of
    ssmspec.speculate.drafters.head), on the model's device. "auto": a head saved beside the model's checkpoint,
    else the MTP layer its checkpoint ships (ssmspec.hf.mtp); a path: a saved head, else a checkpoint directory or
    safetensors file holding MTP tensors."""
    if isinstance(head, str) and head == "auto":
        head = find_head(model)
        where = hf_mtp.checkpoint_dir(model) if head is None else None
        if where is not None and (tensors := hf_mtp.read_mtp(where)):
            return hf_mtp.build(model, tensors)
    elif isinstance(head, str | PathLike):
        where = Path(head)
        if (where.is_dir() and (where / HEAD_WEIGHTS).exists()) or not where.exists():
            head = DraftHead.load(where)
        elif tensors := hf_mtp.read_mtp(where):
            return hf_mtp.build(model, tensors)
        else:
            raise FileNotFoundError(f"no draft head at {where}: neither {HEAD_WEIGHTS} nor MTP (mtp.*) tensors")
    elif isinstance(head, MTPModule):
        return head
    elif head is not None and not isinstance(head, DraftHead):
        raise TypeError(
            f"draft_head must be a DraftHead, an MTP module, a path, 'auto' or None, got {type(head).__name__}"
        )
    if head is None:
        return None
    check_head(head, model)
    return head.to(hf_instance.execution_device(hf_features.lm_head(model))).eval()  # where the features are


def compile_options(device: torch.device) -> dict[str, Any]:
    """The `model.compile` keyword arguments that measured fastest for speculation on `device` (docs:
    Benchmarks): the ssmspec backend; on a CPU Inductor's C++ wrapper (it takes the Python wrapper's per-call
    cost off small graphs); on CUDA Inductor alone: ssmspec captures the compiled steps as CUDA graphs itself
    (SpecConfig.graphs; torch's `mode="reduce-overhead"` graphs failed around HF's cache updated in place)."""
    if device.type == "cuda":
        return {"backend": "ssmspec"}
    return {"backend": "ssmspec", "options": {"cpp_wrapper": True}}


def compile_fast(
    model: nn.Module, *, warmup: Sequence[int] = (1,), progress: bool = True, **compile_kwargs: Any
) -> nn.Module:
    """Compile a transformed `model` for speed and warm it up, so that no request pays for compilation.

    On a CPU, with no `compile_kwargs`, each step the default call and plain decoding take is captured and compiled
    whole (`SpecConfig.graphs` with ssmspec.compile.lower's compiler): a speculative generate per batch size in
    `warmup` on a dummy prompt compiles the plain step and, through the calibration (measured then, never read from
    disk for a compiled model), the greedy step of every tree-size bucket (verified, accepted and committed in one
    graph; a sampled call compiles its buckets' verify steps and commits on first use); the prompt runs eagerly. The
    steps compile side by side in worker processes, one per core (StepCompiler.ahead), meanwhile run op by op, so the
    warm-up runs again on the compiled steps to measure the calibration. Where
    the steps cannot be captured (the generic path, positions read from cache slots, a host read in the model's
    forward) and with `compile_kwargs`, the forward is compiled with `model.compile` (`compile_options`, overridden by
    `compile_kwargs`) and warmed up on prompts of four lengths. A failure leaves the model eager, with one warning
    naming it."""
    device = hf_instance.input_device(model)
    info = getattr(model, "ssmspec_info", None)
    steps = (device.type != "cuda" and not compile_kwargs and getattr(info, "path", "seams") == "seams"
             and not getattr(info, "slot_positions", False))  # fmt: skip
    if steps:
        try:
            compiler = model.__dict__["_ssmspec_step_compiler"] = StepCompiler(model, progress=progress)
            model.ssmspec_graphs = True
            kept = {name: model.__dict__.pop(name) for name in _MEASURED if name in model.__dict__}
            with compiler.ahead():  # each step recorded compiled in a worker process, side by side with the others
                _warm_up(model, device, warmup, (8,), progress, plain=True)
            if compiler.handed_ahead:  # what it measured, it measured on steps run op by op: made anew, compiled
                for name in _MEASURED:
                    model.__dict__.pop(name, None)
                model.__dict__.update(kept)
                _warm_up(model, device, warmup, (8,), progress, plain=True)
            else:
                model.__dict__.update({k: v for k, v in kept.items() if k not in model.__dict__})
            return model
        except Exception as e:  # noqa: BLE001 - any failure to capture or compile: Dynamo's forward, as below
            _uncompile(model)
            warnings.warn(f"ssmspec: capturing {type(model).__name__}'s steps failed, compiling its forward instead "
                          f"({type(e).__name__}: {e})", stacklevel=2)  # fmt: skip
    kwargs = {**compile_options(device), **compile_kwargs}
    options = {**compile_options(device).get("options", {}), **(compile_kwargs.get("options") or {})}
    if options:
        kwargs["options"] = options
    try:
        model.compile(**kwargs)
        if device.type == "cuda" and compile_mode(kwargs) not in CUDA_GRAPH_MODES:
            model.ssmspec_graphs = True  # its verify steps captured by ssmspec (SpecConfig.graphs)
        # two prompt lengths within one scan chunk and two over it, per batch size: after the second of each,
        # Dynamo compiles the prefill for any length on that side of the chunk size (a guard of HF's chunking)
        chunk = int(getattr(model.config.get_text_config(), "chunk_size", None) or 256)
        _warm_up(model, device, warmup, (8, 12, 2 * chunk + 5, 3 * chunk + 3), progress)
    except Exception as e:  # noqa: BLE001 - any compiler failure: eager is exact, so say it and go on
        _uncompile(model)
        warnings.warn(f"ssmspec: compiling {type(model).__name__} failed, running eager ({type(e).__name__}: {e})",
                      stacklevel=2)  # fmt: skip
    return model


# what a warm-up measures or captures and keeps on the model: the calibration, the acceptance profiles with the plain
# step's cost, the one-node path chosen, the captured steps (ssmspec.speculate.calibration, .adaptive, .runner) and a
# draft head's compiled chains
_MEASURED = ("_ssmspec_calibration", "_ssmspec_acceptance", "_ssmspec_single_node_path", "_ssmspec_workspaces",
             CHAINS_KEY)  # fmt: skip


def _warm_up(
    model: nn.Module, device: torch.device, batches: Sequence[int], lengths: Sequence[int], progress: bool,
    plain: bool = False,
) -> None:  # fmt: skip
    """Speculative generates on dummy prompts of each batch size and length, completing the calibration of the model's
    default call (every tree-size bucket verified, so compiled, now rather than on a user's call); with `plain`, a
    plain-decoding call too (its steps keep no drafter's features)."""
    vocab = int(model.config.get_text_config().vocab_size)
    spec = getattr(model, "ssmspec_config", None) or True  # (the default call's sizes)
    runs = [(batch, length) for batch in batches for length in lengths]
    for batch, length in tqdm(runs, desc="ssmspec: compiling and warming up", disable=not progress):
        ids = (torch.arange(batch * length, device=device).view(batch, length) * 7 + 3) % vocab
        calibrate(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, pad_token_id=0,
                  speculation=spec)  # fmt: skip
        if plain:
            model.generate(ids, max_new_tokens=2, pad_token_id=0, speculation=SpecConfig(drafter="none"))
            _warm_chains(model, ids, spec)


def _warm_chains(model: nn.Module, ids: torch.Tensor, spec: SpecConfig | bool) -> None:
    """Compile the draft head's chains of every depth the default call may draft at `ids`'s batch size (a model
    compiled whole whose default drafts with its head's compiled chains: drafters.head.CompiledChains), which the
    warm-up's dummy prompts do not draft."""
    head = model.__dict__.get("ssmspec_draft_head")
    if not isinstance(head, DraftHead):
        return
    speculation = spec if isinstance(spec, SpecConfig) else None
    plan = plan_call(
        model, ids, None, speculation=speculation, head=head, kwargs={"pad_token_id": 0, "max_new_tokens": 8}
    )
    if plan.spec.drafter != "draft_head" or plan.spec.tree:
        return
    chains = compiled_chains(head, model, model.get_input_embeddings(), hf_features.lm_head(model))
    if chains is None:
        return
    features = torch.zeros(ids.shape[0], int(head.config["hidden_size"]))
    for depth in range(1, plan.spec.num_draft_tokens + 1):
        chains.chains(features, ids[:, -1], depth)


def explain(
    model: nn.Module, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, *,
    prompt_lookup_num_tokens: int | None = None, assistant_model: nn.Module | None = None,
    speculation: SpecConfig | bool | None = None, **kwargs: Any,
) -> str:  # fmt: skip
    """What `model.generate(inputs, generation_config, ...)` with these arguments would run, and why (the call, the
    drafter, its sizes, the path, the policy, how steps run), as lines of text, without running it: for users and bug
    reports (`ssmspec plan` prints it). A call that speculation refuses raises as `generate` would; one that asked
    for no speculation and that HF's own generate runs instead says so."""
    if not isinstance(model, SpecGenerationMixin):
        raise TypeError("ssmspec.explain expects a model transformed by ssmspec.transform")
    call = model._speculative_call(generation_config, prompt_lookup_num_tokens, assistant_model, speculation)
    if call is None:
        return "HF's own generate (speculation=False)"
    try:
        plan = plan_call(model, inputs, generation_config, kwargs=kwargs, **call)
    except spec_generate.NotSpeculated as e:
        return f"HF's own generate: the call asked for no speculation, and speculation would refuse it: {e}"
    return plan.describe()


def calibrate(model: nn.Module, input_ids: torch.Tensor, **generate_kwargs: Any) -> torch.Tensor | ModelOutput:
    """Complete a transformed model's calibration now for calls like `model.generate(input_ids, **generate_kwargs)`
    (their batch size, device and tree sizes; ssmspec.speculate.calibration), rather than a share of each call's time
    over its first calls: for a server that would rather pay it at start-up, or a benchmark timing calibrated calls.
    Runs that call once, measuring before its first step; returns its output. The calibration is kept on the model
    and on disk, as any."""
    if not isinstance(model, SpecGenerationMixin):
        raise TypeError("ssmspec.calibrate expects a model transformed by ssmspec.transform")
    model.__dict__["_ssmspec_calibrating"] = True
    try:
        return model.generate(input_ids, **generate_kwargs)
    finally:
        model.__dict__.pop("_ssmspec_calibrating", None)


def _uncompile(model: nn.Module) -> None:
    """Undo `model.compile` (nn.Module internals, named here): the eager forward and no static shapes."""
    model._compiled_call_impl = None
    for name in ("ssmspec_static_shapes", "ssmspec_compile_call", "ssmspec_compile_options", "_ssmspec_calibration",
                 "_ssmspec_compiled_commit", "_ssmspec_single_node_path", "ssmspec_graphs", "_ssmspec_step_compiler",
                 "_ssmspec_workspaces", CHAINS_KEY):  # fmt: skip
        model.__dict__.pop(name, None)


def _set_prepack(model: nn.Module, prepack: bool) -> None:
    """Turn the prepacked linears of an already transformed model on or off."""
    if prepack:
        packed_linear.install(model)
    else:
        packed_linear.uninstall([m for m in model.modules() if isinstance(m, packed_linear.PackedLinear)])


_DRAFTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare_draft(draft: nn.Module) -> nn.Module:
    """A transformed draft for `draft` without changing it.

    Args:
        draft: any causal LM; if already transformed it is used as is.

    Returns:
        A transformed copy of its module structure sharing its parameters and buffers (made once per draft
        and remembered while the draft lives).

    Raises:
        UnsupportedModelError: the draft cannot be verified exactly (as for `transform`).
    """
    if isinstance(draft, SpecGenerationMixin):
        return draft
    clone = _DRAFTS.get(draft)
    if clone is None:
        shared = {id(t): t for t in (*draft.parameters(), *draft.buffers())}
        clone = transform(copy.deepcopy(draft, memo=dict(shared)))  # (without seams: HF's own forward drafts)
        _DRAFTS[draft] = clone
    return clone
