"""The transform-time probe: ssmspec's tree verification must compute what HF computes, or the model is refused.

It verifies random branching trees on a random prompt (one row, then a left-padded batch of two), commits
a path and verifies a second tree on top of it, and compares every node's logits and every decoder layer's
output with what HF's generate computes for the node's root-to-node path: the prompt in one forward, every
later token in a one-token decode step (the same model outside verification, where every seam is HF's own
function). A difference beyond the dtype's tolerance on two independent random inputs raises
UnsupportedModelError naming the first layer that differs: a model whose semantics ssmspec does not reproduce
(a position bias keyed on cache slots, an unknown mixer path) is refused at transform time, never run with
wrong tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ssmspec.errors import UnsupportedModelError
from ssmspec.hf import instance as hf_instance
from ssmspec.hf.generic import HFState
from ssmspec.speculate.generic import GenericRunner
from ssmspec.speculate.runner import ModelRunner
from ssmspec.tree import TokenTree

# relative tolerance (max |difference| / max |reference|, per layer output and for the logits) per dtype:
# the tree path and HF's sequential path round differently (different op orders, float32 compute of ssmspec's
# recurrences); a semantic difference is orders of magnitude above these
# (float64: HF's own fallbacks compute several recurrences in float32 even for float64 models, so its reference
# carries float32 rounding: ~1e-7 relative on the tiny test models)
TOLERANCE = {torch.float64: 1e-5, torch.float32: 2e-3, torch.bfloat16: 8e-2, torch.float16: 4e-2}
# bfloat16 / float16: a probe whose largest difference is above this share of its tolerance is re-run in float32
# (`probe`): rounding and a semantic difference overlap there. inkling2's trees differ from HF's by 6.5% in float64,
# and its bfloat16 probe measured 6.4% against 8% and accepted them; the tiny models' bfloat16 rounding is 0-4%.
UNSURE = 0.25
_TREE_A = [-1, 0, 0, 1, 1, 2, 4]  # a branching tree, node index != depth
_TREE_B = [-1, 0, 1, 1, 0]
_CHAIN = [-1, 0, 1]
_CHAIN_4 = [-1, 0, 1, 2]


@dataclass
class ProbeResult:
    """What the probe learnt: whether trees (beyond chains) and batches verify exactly, with the reason where
    they do not, whether the model reads positions from cache slots, and the largest relative differences."""

    trees: bool = True
    batches: bool = True
    limits: dict[str, str] = field(default_factory=dict)  # "trees" / "batches" -> why not (where and by how much)
    slot_positions: bool = False
    max_logit_diff: float = 0.0
    max_layer_diff: float = 0.0
    # bfloat16/float16 only: what the low-precision probe found before the float32 probe decided (None: nothing)
    rounding: str | None = None


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's list of decoder layers (the ModuleList with one entry per hidden layer), for per-layer
    comparisons; None if there is no such list."""
    n = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n and n:
            return path, module
    return None


@contextlib.contextmanager
def _capture(layers: nn.ModuleList | None, out: list) -> Iterator[None]:
    if layers is None:
        yield
        return

    def hook(_module, _args, output):
        first = output[0] if isinstance(output, (tuple, list)) else output
        out.append(first.detach() if isinstance(first, torch.Tensor) else None)

    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).abs().max() / (b.abs().max() + 1e-6))


class _Probe:
    def __init__(self, model: nn.Module, seed: int) -> None:
        self.model = model
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = model.config.get_text_config().vocab_size
        self.device = hf_instance.input_device(model)
        self.dtype = next(model.parameters()).dtype
        found = decoder_layers(model)
        self.layers_path, self.layers = found if found else ("", None)
        self.tol = _tolerance(self.dtype)
        self.max_logit = self.max_layer = 0.0

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    @torch.no_grad()
    def reference(self, tree: TokenTree, row: int, history: list[int], pad: int, prompt: int) -> dict[int, tuple]:
        """What HF's generate computes for every acceptable node of one row's tree, after `history`: the first
        `prompt` tokens of history in one forward (its prefill, `pad` pads ahead), every later token, and each node
        after its parent, in a one-token decode step on HF's cache, as its loop feeds the tokens it generates
        (depth first: each node is decoded once, the state copied at branches). Per node: logits [V] and each
        layer's output [H]. (HF's decode step and its multi-token forward may differ: Zamba2's and Nemotron-H's
        decode steps do not clamp dt to the config's `time_step_min`, their chunked forward does; speculation must
        equal the decode steps.)"""
        ids = torch.tensor([[0] * pad + history], device=self.device)
        mask = torch.tensor([[0] * pad + [1] * len(history)], device=self.device)
        state = HFState(self.model, ids[:, : pad + prompt], mask[:, : pad + prompt], as_hf=True)
        state.forward(None)
        for t in range(pad + prompt, ids.shape[1]):
            state.forward(ids[:, t : t + 1])
        ok = tree.acceptable[row].tolist()
        parents = [max(p, -1) for p in tree.parents[row].tolist()]  # the roots under -1
        children = {t: [c for c, p in enumerate(parents) if ok[c] and p == t] for t in range(-1, tree.num_nodes)}
        tokens = tree.tokens[row]
        out: dict[int, tuple] = {}

        def visit(node: int) -> None:
            if node >= 0:
                layers: list = []
                with _capture(self.layers, layers):
                    logits = state.forward(tokens[node].view(1, 1))
                out[node] = (logits[0, -1], [o[0, -1] if o is not None else None for o in layers])
            kids = children[node]
            for k, child in enumerate(kids):
                snap = state.snapshot() if k < len(kids) - 1 else None  # the last child needs no way back
                visit(child)
                if snap is not None:
                    state.restore(snap)

        visit(-1)
        return out

    def compare(self, what: str, got_logits, got_layers, want_logits, want_layers) -> None:
        diffs = []
        for i, (g, w) in enumerate(zip(got_layers, want_layers)):
            if g is None or w is None or g.shape != w.shape:
                continue
            d = _rel(g, w)
            self.max_layer = max(self.max_layer, d)
            if d > self.tol:
                diffs.append((i, d))
        d_logits = _rel(got_logits, want_logits)
        self.max_logit = max(self.max_logit, d_logits)
        if diffs or d_logits > self.tol:
            where = f"{self.layers_path}.{diffs[0][0]}" if diffs else type(self.model).__name__
            worst = diffs[0][1] if diffs else d_logits
            raise _Mismatch(
                where,
                f"{what}: output differs from what HF's generate computes for the same path by {worst:.3g} "
                f"(relative; tolerance {self.tol:g} for {self.dtype}); logits differ by {d_logits:.3g}",
            )

    def single(self, trees: bool) -> bool:
        """Two verify + commit steps on one row (branching trees, or chains); returns whether the model read
        positions from cache slots (in HF's cache layout, where it can: a model that does verifies in it; `batched`
        then checks the layout calls use)."""
        runner = ModelRunner(self.model, decode_single_nodes=False, static_kv=False)
        prompt = self.tokens(5)
        ones = torch.ones(1, 5, dtype=torch.long, device=self.device)
        runner.prefill(torch.tensor([prompt], device=self.device), ones)
        history = prompt
        slot_positions = False
        for step, parents in enumerate((_TREE_A, _TREE_B) if trees else (_CHAIN_4, _CHAIN)):
            tree = TokenTree(torch.tensor([self.tokens(len(parents))], device=self.device),
                             torch.tensor([parents], device=self.device))  # fmt: skip
            got_layers: list = []
            with _capture(self.layers, got_layers):
                logits = runner.verify(tree)
            slot_positions |= runner.cache.reads_slot_positions
            what = f"{'tree' if trees else 'chain'} verification, step {step + 1}"
            self._check_nodes(what, tree, 0, history, 0, len(prompt), logits, got_layers)
            last = torch.tensor([tree.num_nodes - 1], device=self.device)
            path, length = tree.paths(last)
            runner.commit(last)
            history = history + tree.tokens[0, path[0, : int(length[0])]].tolist()
        return slot_positions

    def batched(self, trees: bool, slot_positions: bool) -> None:
        """Two steps on a left-padded batch of two rows that accept different lengths."""
        runner = ModelRunner(self.model, decode_single_nodes=False, static_kv=False if slot_positions else None,
                             level_aligned=slot_positions)  # fmt: skip
        rows = [self.tokens(6), self.tokens(4)]
        prompts = [6, 4]
        ids = torch.tensor([rows[0], [0, 0] + rows[1]], device=self.device)
        mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]], device=self.device)
        runner.prefill(ids, mask)
        steps = ((_TREE_A, _CHAIN), (_CHAIN, _TREE_B)) if trees else ((_CHAIN_4, _CHAIN), (_CHAIN, _CHAIN_4))
        for step, shapes in enumerate(steps):
            tree = TokenTree.from_lists([self.tokens(len(p)) for p in shapes], list(shapes), device=self.device)
            tree = runner.prepare(tree)
            got_layers: list = []
            with _capture(self.layers, got_layers):
                logits = runner.verify(tree)
            for r in range(2):
                self._check_nodes(f"batched verification, row {r}, step {step + 1}", tree, r, rows[r], 2 * r,
                                  prompts[r], logits, got_layers)  # fmt: skip
            last = tree.depth.masked_fill(~tree.acceptable, -1).argmax(1)  # each row's deepest real node
            path, length = tree.paths(last)
            runner.commit(last)
            for r in range(2):
                rows[r] = rows[r] + tree.tokens[r, path[r, : int(length[r])]].tolist()

    def _check_nodes(self, what, tree, row, history, pad, prompt, logits, got_layers) -> None:
        """Compare every acceptable node of one row with what HF's generate computes for history + its root-to-node
        path (the first `prompt` tokens of history prefilled, the rest decoded)."""
        want = self.reference(tree, row, history, pad, prompt)
        nodes = sorted(want)
        got = [g[row, nodes] if g is not None else None for g in got_layers]
        layers = [None if any(want[t][1][i] is None for t in nodes) else torch.stack([want[t][1][i] for t in nodes])
                  for i in range(len(got_layers))]  # fmt: skip
        self.compare(what, logits[row, nodes], got, torch.stack([want[t][0] for t in nodes]), layers)


class _Mismatch(Exception):
    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where


def probe(model: nn.Module) -> ProbeResult:
    """Check that tree verification reproduces HF's computation on this model. Capabilities are narrowed by
    evidence: if branching trees differ but chains agree, the model verifies chains only; if one row agrees but
    a left-padded batch does not (e.g. positions read from absolute cache slots), it speculates one prompt at a
    time; the reasons name the layer. If nothing agrees, UnsupportedModelError names the first layer that
    differs. A difference must show on two independent random inputs (a float near-tie in a router flips on
    one input, a semantic difference on every input)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        if not _low_precision(model):
            return _probe(model)
        try:
            result = _probe(model)
        except UnsupportedModelError as exc:
            result, found = None, str(exc)
        else:
            found = _narrowed(result)
        limit = UNSURE * _tolerance(_dtype(model))
        unsure = result is not None and max(result.max_logit_diff, result.max_layer_diff) > limit
        if found is None and not unsure:
            return result
        # bfloat16/float16: a deep model's rounding grows layer by layer (48 random Mamba2 layers drift ~8 %
        # from HF's own forward) and can look like a semantic difference, and a semantic difference can hide in
        # the rounding (`UNSURE`); semantics do not depend on the dtype, so the float32 probe of the same weights
        # decides, and its result stands
        with _upcast(model):
            exact = _probe(model)
        exact.rounding = found
        return exact
    finally:
        for m, mode in modes:
            m.training = mode


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _low_precision(model: nn.Module) -> bool:
    return _dtype(model) in (torch.bfloat16, torch.float16)


def _tolerance(dtype: torch.dtype) -> float:
    """The probe's relative tolerance for `dtype` (TOLERANCE; bfloat16's for a dtype it does not name)."""
    return TOLERANCE.get(dtype, 8e-2)


def _narrowed(result: ProbeResult) -> str | None:
    """What a probe result gave up (trees, batches), or None."""
    return "; ".join(f"{k}: {v}" for k, v in result.limits.items()) or None


@contextlib.contextmanager
def _upcast(model: nn.Module) -> Iterator[None]:
    """The model's floating-point weights and buffers in float32 for the duration, then each back in its own
    dtype (bfloat16/float16 -> float32 -> back is exact: the user's model is left bit for bit as it was). It
    needs the float32 weights' memory while it lasts.

    Tensor by tensor, not `model.to`: accelerate refuses to move a model with layers offloaded to the CPU or disk
    ("You can't move a model that has some modules offloaded"). An offloaded weight is a meta tensor between
    forwards, and accelerate's hook casts what it loads to that tensor's dtype, so it is upcast alike (the files on
    disk are left as they are)."""

    def tensors():
        return [*model.named_parameters(), *model.named_buffers()]

    dtypes = {name: t.dtype for name, t in tensors()}
    try:
        for _, t in tensors():
            if t.is_floating_point():
                t.data = t.data.to(torch.float32)
        yield
    finally:
        for name, t in tensors():
            t.data = t.data.to(dtypes.get(name, t.dtype))


def _attempt(model: nn.Module, fn) -> tuple[_Mismatch | None, _Probe]:
    """Run one probe part on two seeds; the mismatch if both disagree with HF."""
    failure = None
    for seed in (0, 1):
        p = _Probe(model, seed)
        try:
            fn(p)
            return None, p
        except _Mismatch as exc:
            failure = failure or exc
        except UnsupportedModelError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure means this model cannot be verified as is
            raise UnsupportedModelError(
                type(model).__name__, f"tree verification probe failed: {type(exc).__name__}: {exc}"
            ) from exc
    return failure, p


def _probe(model: nn.Module) -> ProbeResult:
    result = ProbeResult()
    seen: list[bool] = []
    failure, p = _attempt(model, lambda p: seen.append(p.single(trees=True)))
    if failure is not None:
        chain_failure, p = _attempt(model, lambda p: seen.append(p.single(trees=False)))
        if chain_failure is not None:
            raise UnsupportedModelError(
                failure.where, f"tree verification does not reproduce HF's computation ({failure})"
            )
        result.trees = False
        result.limits["trees"] = f"{failure.where}: {failure}"
    result.slot_positions = any(seen)
    diffs = [p]
    batch_failure, p = _attempt(model, lambda p: p.batched(result.trees, result.slot_positions))
    diffs.append(p)
    if batch_failure is not None:
        result.batches = False
        result.limits["batches"] = f"{batch_failure.where}: {batch_failure}"
    result.max_logit_diff = max(d.max_logit for d in diffs)
    result.max_layer_diff = max(d.max_layer for d in diffs)
    return result


# the generic probe's steps: (chain length including the root, the node to commit; None: discard)
# (partial commits carry their prefix into the next forward; three long partial ones in a row overflow the carry)
_GENERIC_STEPS = [(4, 1), (3, 2), (1, 0), (5, 0), (3, None), (8, 5), (8, 5), (8, 5), (2, 1)]
# the random inputs the generic probes run, every one of which must agree: unlike the tree probe (where a
# difference must show on two inputs, a router near-tie flipping on one), HF's own forward is the only thing
# compared, and its inconsistencies can depend on the content (DeepSeek-V4's compressed-attention indexer picks
# its top-k entries differently in a multi-token forward: of the three tiny variants, one agreed on two of
# these three inputs)
_GENERIC_SEEDS = (0, 1, 2)


def probe_generic(model: nn.Module) -> str | None:
    """Check that the generic path (ssmspec.speculate.generic) reproduces HF's greedy loop on this model: on a
    random prompt, chains verified through HF's own multi-token forward, committed whole, in part (snapshot
    restored, prefix fed again), one node, nothing, each node's logits compared with HF's loop feeding the same
    tokens one at a time after the same prefill, its cache exactly as HF keeps it (HF's decode step, which is what
    its generate computes: on some models a multi-token forward after a cache differs, HF's Mamba ignoring the
    cached state for one). Returns None where it does on each of three random inputs, else why not.
    bfloat16/float16 models are checked in float32 (semantics do not depend on the dtype). Batches:
    `probe_generic_batches`."""
    return _generic_probe(
        model, _generic_once, _GENERIC_SEEDS, "HF's forward cannot continue a cached state with several tokens"
    )


def _generic_probe(model: nn.Module, once, seeds, cannot: str) -> str | None:
    """Run `once(model, seed)` for every seed (eval mode, low precision upcast); the first mismatch's message, or
    `cannot` with the exception where HF's forward fails; None where every seed agreed."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with _upcast(model) if _low_precision(model) else contextlib.nullcontext():
            for seed in seeds:
                try:
                    once(model, seed)
                except _Mismatch as exc:
                    return str(exc)
                except Exception as exc:  # noqa: BLE001 - any failure means the path cannot run this model
                    return f"{cannot} ({type(exc).__name__}: {exc})"
            return None
    finally:
        for m, mode in modes:
            m.training = mode


@torch.no_grad()
def _generic_once(model: nn.Module, seed: int) -> None:
    p = _Probe(model, seed)
    prompt = torch.tensor([p.tokens(7)], device=p.device)
    mask = torch.ones_like(prompt)
    # the reference is HF's loop: its cache as HF keeps it, fed one token per forward
    runner, reference = GenericRunner(model), GenericRunner(model, as_hf=True)
    got = runner.prefill(prompt, mask)
    _generic_compare(p, "prefill", got, reference.prefill(prompt, mask))
    for n, keep in _GENERIC_STEPS:
        chain = p.tokens(n)  # the root (a token the runner has not seen yet, as the last emitted one) and drafts
        where = f"a chain of {n} after {int(runner.n_real[0])} tokens"
        got = runner.verify(TokenTree.chain(torch.tensor([chain], device=p.device)))[0]
        snap = reference.snapshot()
        want = []
        for t in chain:
            want.append(reference.verify(TokenTree.chain(torch.tensor([[t]], device=p.device)))[0, 0])
            reference.commit(torch.zeros(1, dtype=torch.long))
        _generic_compare(p, where, got, torch.stack(want))
        reference.restore(snap)
        if keep is None:
            runner.discard()
            continue
        runner.commit(torch.tensor([keep]))
        for t in chain[: keep + 1]:
            reference.verify(TokenTree.chain(torch.tensor([[t]], device=p.device)))
            reference.commit(torch.zeros(1, dtype=torch.long))


def probe_generic_trees(model: nn.Module) -> str | None:
    """Check the generic path's tree form (ssmspec.hf.tree_modules, installed on the model) against HF's decode
    steps: on a random prompt, branching trees and chains verified in one forward each and committed in part,
    whole, at a branch, discarded, one node; every node's logits compared with HF's loop decoding that node's
    path on its cache as HF keeps it (`_Probe.reference`). Returns None where it agrees on three random inputs,
    else why not."""
    return _generic_probe(model, _generic_tree_once, _GENERIC_SEEDS, "HF's forward cannot verify a tree")


# (tree shape, node to keep; None: discarded) per step of the tree probe
_GENERIC_TREE_STEPS = [(_TREE_A, 4), (_CHAIN_4, 3), (_TREE_B, None), (_TREE_B, 3), ([-1], 0), (_TREE_A, 6),
                       (_CHAIN, 0)]  # fmt: skip


@torch.no_grad()
def _generic_tree_once(model: nn.Module, seed: int) -> None:
    p = _Probe(model, seed)
    history = p.tokens(6)
    runner = GenericRunner(model, trees=True)
    if not runner.trees:
        raise RuntimeError("no recurrence module of the model has a tree form")
    runner.prefill(torch.tensor([history], device=p.device), torch.ones(1, len(history), dtype=torch.long))
    for step, (parents, keep) in enumerate(_GENERIC_TREE_STEPS):
        tree = TokenTree(torch.tensor([p.tokens(len(parents))], device=p.device),
                         torch.tensor([parents], device=p.device))  # fmt: skip
        got = runner.verify(tree)[0]
        want = p.reference(tree, 0, history, 0, 6)
        nodes = sorted(want)
        kind = "a chain" if tree.depth_is_index else "a tree"
        _generic_compare(p, f"{kind} of {len(parents)} nodes, step {step + 1}", got[nodes],
                         torch.stack([want[t][0] for t in nodes]),
                         "HF's forward verifying a tree (each node after its parent's state) differs from its decode "
                         "steps")  # fmt: skip
        if keep is None:
            runner.discard()
            continue
        runner.commit(torch.tensor([keep]))
        history = history + tree.tokens[0, tree.path_nodes(0, keep)].tolist()


_SEVERAL_TOKENS = "HF's forward of several tokens after its cache gives logits that differ from its one-token steps"


def _generic_compare(p: _Probe, what: str, got: torch.Tensor, want: torch.Tensor, claim: str = _SEVERAL_TOKENS) -> None:
    """Raise _Mismatch (`what`: `claim` by how much) where the logits differ beyond the probe's tolerance."""
    d = _rel(got, want)
    p.max_logit = max(p.max_logit, d)
    if d > p.tol:
        raise _Mismatch(
            type(p.model).__name__, f"{what}: {claim} by {d:.3g} (relative; tolerance {p.tol:g} for {p.dtype})"
        )


def probe_generic_batches(model: nn.Module) -> str | None:
    """Check that the generic path's batches are HF's: HF's own loop over a left-padded batch of two random prompts
    (the prefill, then one token per row and forward, as its generate feeds them) against each row run alone in a
    state of its own (what the generic path verifies row by row), chains committed in part and whole. Returns
    None where they agree on two random inputs, else why not (HF's RWKV, for one, broadcasts every row's token
    shift over the whole batch in a one-token step)."""
    return _generic_probe(model, _generic_batch_once, _GENERIC_SEEDS[:2], "HF's forward cannot run a batch of prompts")


@torch.no_grad()
def _generic_batch_once(model: nn.Module, seed: int) -> None:
    p = _Probe(model, seed)
    prompt = torch.tensor([p.tokens(7), [0, 0] + p.tokens(5)], device=p.device)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    # the rows as the generic path will verify them: through the tree form where one is installed (it passed its
    # own probe, which feeds unpadded prompts only)
    batched, rows = HFState(model, prompt, mask, as_hf=True), GenericRunner(model, trees=True)
    claim = "HF's batched loop (one token per row and forward) gives logits that differ from the rows' verified alone"
    where = "a batch of two prompts (the second left-padded)"
    _generic_compare(p, f"{where}, prefill", rows.prefill(prompt, mask), batched.forward(None)[:, -1], claim)
    for n, keep in _GENERIC_BATCH_STEPS:
        chains = torch.tensor([p.tokens(n), p.tokens(n)], device=p.device)  # per row the root and drafts
        got = rows.verify(TokenTree.chain(chains))
        snap = batched.snapshot()
        want = torch.cat([batched.forward(chains[:, t : t + 1]) for t in range(n)], dim=1)
        _generic_compare(p, f"{where}, chains of {n} after {int(rows.n_real[0])} tokens", got, want, claim)
        batched.restore(snap)
        rows.commit(torch.tensor([keep, keep]))
        for t in range(keep + 1):
            batched.forward(chains[:, t : t + 1])


# (chain length, node to keep) per step of the batch probe: in part, whole, one node
_GENERIC_BATCH_STEPS = [(4, 1), (3, 2), (1, 0), (5, 2)]
