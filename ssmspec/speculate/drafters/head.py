"""Draft heads (EAGLE style): a small network that drafts from the target's own features.

The target's LM head turns its feature f_t (the last hidden state after the final norm, ssmspec.hf.features) into
the distribution of token t+1. A draft head predicts the next feature from f_t and the embedding of token t+1,
f_(t+1) ~ head(f_t, e(x_(t+1))), and the target's own LM head turns the prediction into a distribution over
token t+2; fed its own predictions it drafts deeper. It reads the target's embedding and LM head (frozen, not
copied), so it adds two small layers: on the embedded 3M-parameter target, 0.4M parameters and about 0.3 ms per
drafted level on a 2-core CPU, where a draft model's forward costs what the target's does. Its proposals are a
distribution q per node: greedy decoding drafts a best-first tree (`trees.best_first_tree`), sampling draws each
node's children from q without replacement (`trees.sample_tree`) and verifies them losslessly (recursive
rejection sampling with q). A head is trained for one target (`ssmspec.speculate.head_training`), saved beside
its checkpoint (`draft_head.safetensors`, `draft_head.json`) and found there by `ssmspec.transform`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ssmspec.compiled import compiled_as
from ssmspec.errors import UnsupportedModelError, not_one_of
from ssmspec.hf import features as hf_features
from ssmspec.hf import instance as hf_instance
from ssmspec.speculate.config import SAMPLING_TREES
from ssmspec.speculate.drafters.base import Drafter
from ssmspec.speculate.drafters.trees import best_first_tree, sample_tree

WEIGHTS, CONFIG = "draft_head.safetensors", "draft_head.json"
# the rounds of head calls a greedy tree grows in, at most: each costs about as much whatever its node count
ROUNDS = 4


class DraftHead(nn.Module):
    """Predicts the target's next feature from its feature and the next token's embedding:
    f' = f + W2 silu(W1 [norm(f); norm(e)]). The target's embedding and LM head are not part of it.

    Args:
        hidden_size: the target's feature width (its LM head's input size).
        embedding_size: the target's token embedding width.
        inner_size: the hidden layer's width (default: 2 x hidden_size).
        vocab_size: the target's vocabulary (recorded, checked when the head is bound to a target).
    """

    def __init__(self, hidden_size: int, embedding_size: int, vocab_size: int, inner_size: int | None = None) -> None:
        super().__init__()
        self.config = {"hidden_size": int(hidden_size), "embedding_size": int(embedding_size),
                       "vocab_size": int(vocab_size), "inner_size": int(inner_size or 2 * hidden_size)}  # fmt: skip
        self.feature_norm = nn.LayerNorm(hidden_size)
        self.token_norm = nn.LayerNorm(embedding_size)
        self.fc1 = nn.Linear(hidden_size + embedding_size, self.config["inner_size"])
        self.fc2 = nn.Linear(self.config["inner_size"], hidden_size)
        self.about: dict = {}  # what it was trained on and how it measured (`save`'s `about`, kept by `load`)

    def forward(self, features: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The predicted next features [*, H] from features [*, H] and the next tokens' embeddings [*, E]."""
        x = torch.cat([self.feature_norm(features), self.token_norm(embedded)], dim=-1)
        return features + self.fc2(nn.functional.silu(self.fc1(x)))

    @classmethod
    def for_model(cls, model: nn.Module, inner_size: int | None = None) -> DraftHead:
        """A new (untrained) head sized for `model`'s features, embedding and vocabulary."""
        return cls(**head_sizes(model), inner_size=inner_size)

    def save(self, directory: str | Path, **about) -> Path:
        """Write the head's weights (safetensors) and config (with `about`: what it was trained on) to
        `directory` (created), beside a checkpoint as `ssmspec.transform` looks for it there."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(out / WEIGHTS))
        (out / CONFIG).write_text(json.dumps({**self.about, **about, **self.config}, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path) -> DraftHead:
        """A head saved by `save` (FileNotFoundError naming the missing file)."""
        from safetensors.torch import load_file

        where = Path(directory)
        for name in (WEIGHTS, CONFIG):
            if not (where / name).exists():
                raise FileNotFoundError(f"no draft head at {where}: {name} is missing")
        config = json.loads((where / CONFIG).read_text())
        keys = ("hidden_size", "embedding_size", "vocab_size", "inner_size")
        head = cls(**{k: config[k] for k in keys})
        head.load_state_dict(load_file(str(where / WEIGHTS)))
        head.about = {k: v for k, v in config.items() if k not in keys}
        return head.eval()


def find_head(model: nn.Module) -> DraftHead | None:
    """The draft head saved beside `model`'s checkpoint (its `name_or_path` a local directory holding
    `draft_head.safetensors`), or None."""
    where = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not where or not (Path(where) / WEIGHTS).exists():
        return None
    return DraftHead.load(where)


def head_sizes(model: nn.Module) -> dict[str, int]:
    """What a head for `model` is sized by: its feature width, token embedding width and vocabulary."""
    embed = model.get_input_embeddings()
    return {"hidden_size": hf_features.feature_size(model), "embedding_size": int(embed.weight.shape[1]),
            "vocab_size": int(embed.weight.shape[0])}  # fmt: skip


def check_head(head: DraftHead, model: nn.Module) -> None:
    """A head drafts for a target only with the target's feature width, embedding width and vocabulary
    (UnsupportedModelError naming what differs)."""
    wrong = {k: (head.config[k], v) for k, v in head_sizes(model).items() if head.config[k] != v}
    if wrong:
        diffs = ", ".join(f"{k} {a} != the target's {b}" for k, (a, b) in wrong.items())
        raise UnsupportedModelError(type(model).__name__, f"the draft head was made for another model ({diffs})")


class HeadChain:
    """A head's greedy chain as tensor ops (a `ssmspec.speculate.step.StepDraft`): each level the head's predicted
    feature, the target's LM head and the argmax. What `CompiledChains` compiles alone, and what a greedy step compiled
    whole runs in its own graph after its commit (`ModelRunner.verify_greedy`)."""

    def __init__(self, head: DraftHead, embed: nn.Module, lm_head: nn.Module) -> None:
        self.head, self.embed, self.lm_head = head, embed, lm_head
        self.module = head  # (the embedding and the LM head are the target's: constants of its steps already)
        self.key = ("head chain", id(head), id(embed), id(lm_head))

    def __call__(self, features: torch.Tensor, roots: torch.Tensor, depth: int) -> torch.Tensor:
        """`depth` levels of head, LM head and argmax from features [B, H] and roots [B]: the chain [B, depth]."""
        dtype = next(self.head.parameters()).dtype
        out, f, t = [], features.to(dtype), roots
        for _ in range(depth):
            f = self.head(f, self.embed(t).to(dtype))
            t = self.lm_head(f.to(self.lm_head.weight.dtype)).float().argmax(-1)
            out.append(t)
        return torch.stack(out, 1)


# where a target keeps its heads' compiled chains (id(head) -> CompiledChains) and the lock that guards them
CHAINS_KEY = "_ssmspec_head_chains"


class CompiledChains:
    """A draft head's greedy chains as one replay of a step compiled whole (ssmspec.compile.graphs.StepGraph, compiled
    by a CPU step compiler): every level's head call, the target's LM head and the argmax in one call, for a target
    whose own steps are compiled whole on a CPU, where the step before did not draft the chain in its graph (after the
    prompt or a plain step, or deeper than it drafted: `HeadChain`). Called op by op the head's one-row linears cost as
    much as the target's compiled step (on the 19.6M Nemotron-H, 2.1 ms of head calls a drafted step against a 2.6 ms
    plain step). One graph per batch size and depth, kept for the target's later calls; a replay and its read hold a
    lock (two calls on one model in two threads share the graph's buffers)."""

    def __init__(self, head: DraftHead, embed: nn.Module, lm_head: nn.Module, options: dict | None,
                 progress: bool) -> None:  # fmt: skip
        from ssmspec.compile.lower import StepCompiler

        self.head, self.embed, self.lm_head = head, embed, lm_head
        self.step = HeadChain(head, embed, lm_head)
        self.compiler = StepCompiler(nn.ModuleList([head, embed, lm_head]), options=options, progress=progress)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (batch, depth) -> (graph, features, roots)
        self.lock = threading.Lock()

    def chains(self, features: torch.Tensor, roots: torch.Tensor, depth: int) -> list[list[int]]:
        """The head's argmax chain of `depth` tokens after each row's root [B], from the target's features [B, H] at
        the root's parent."""
        from ssmspec.compile.graphs import StepGraph

        key = (int(roots.shape[0]), int(depth))
        with self.lock, torch.no_grad():
            entry = self.graphs.get(key)
            if entry is None:
                dtype = next(self.head.parameters()).dtype
                feats, tokens = features.to(dtype).clone(), roots.clone()
                graph = StepGraph(torch.device("cpu"), compiler=self.compiler)
                graph.capture(lambda: self.step(feats, tokens, depth))
                self.graphs[key] = (graph, feats, tokens)
            else:
                graph, feats, tokens = entry
                feats.copy_(features)
                tokens.copy_(roots)
                graph.replay()
            return graph.outputs.tolist()


def compiled_whole_on_cpu(head: DraftHead, target: nn.Module, embed: nn.Module, lm_head: nn.Module):
    """The step compiler of `target` where its steps are compiled whole on a CPU and the head, the embedding and the LM
    head are on the CPU (the head's greedy chains may then run in the target's greedy steps: `HeadChain`), else None."""
    compiler = compiled_as(target).step_compiler
    tensors = [*head.parameters(), *embed.parameters(), *lm_head.parameters()]
    return None if compiler is None or any(t.device.type != "cpu" for t in tensors) else compiler


def compiled_chains(head: DraftHead, target: nn.Module, embed: nn.Module, lm_head: nn.Module) -> CompiledChains | None:
    """`head`'s compiled chains for `target` (made once per pair and kept on the target, as its compiled steps are),
    where `target`'s steps are compiled whole on a CPU and the head, the embedding and the LM head are on the CPU; else
    None (the head is called op by op)."""
    compiler = compiled_whole_on_cpu(head, target, embed, lm_head)
    if compiler is None or not getattr(compiler, "inductor", True):
        return None
    store = target.__dict__.get(CHAINS_KEY)
    if store is None:
        store = target.__dict__.setdefault(CHAINS_KEY, (threading.Lock(), {}))
    lock, per_target = store
    with lock:
        chains = per_target.get(id(head))
        if chains is None or chains.head is not head or chains.embed is not embed or chains.lm_head is not lm_head:
            chains = per_target[id(head)] = CompiledChains(head, embed, lm_head, compiler.options, compiler.progress)
        return chains


class HeadDrafter(Drafter):
    """Drafts from the target's features with a DraftHead (see the module docstring). The engine hands it the
    target's feature at the last position it committed (`observe_features`); each proposal predicts the root's
    feature from it and the root token, then grows the tree one level of the head per round.

    Args:
        head: a DraftHead checked against `target` (`check_head`).
        target: the (transformed) target model: its input embedding and LM head are read, not copied.
        tree: greedy decoding drafts a best-first tree (False: a chain of the head's argmax).
        branches: when sampling, children of the root (Gumbel-top-k) or the beam width (stochastic beam search).
        sampling_tree: "gumbel_top_k" or "stochastic_beam".
        min_path_prob: a greedy tree never holds a node whose path probability under the head is below this.
    """

    target_features = True
    rounds = ROUNDS  # a greedy tree's rounds of head calls, at most
    compiles_chains = True  # greedy chains as one compiled call on a target compiled whole (`CompiledChains`)

    def __init__(
        self, head: DraftHead, target: nn.Module, tree: bool = True, branches: int = 1,
        sampling_tree: str = "gumbel_top_k", min_path_prob: float = 0.02,
    ) -> None:  # fmt: skip
        if sampling_tree not in SAMPLING_TREES:
            raise not_one_of("sampling_tree", sampling_tree, SAMPLING_TREES)
        self.head = head
        self.target = target
        self.tree = tree
        self.branches = max(1, int(branches))
        self.sampling_tree = sampling_tree
        self.min_path_prob = min_path_prob
        self.dtype = next(head.parameters()).dtype
        self.head_device = next(head.parameters()).device
        self.embed: nn.Module | None = None  # the target's embedding and LM head, bound at each call's `start`
        self.lm_head: nn.Module | None = None
        self.embed_device: torch.device | None = None
        self.features: list[torch.Tensor | None] = []
        self.steps = 0  # head calls in this generate call (one per drafted level)
        self.chain_fallbacks = 0
        # per row, the head's logits [V] at the nodes of its last greedy tree whose children it scored (what a
        # FusedDrafter prunes retrieved branches with)
        self.scored: list[dict[int, torch.Tensor]] = []
        self.predicted: list[dict[int, torch.Tensor]] = []  # per row, node -> the head's output there (this proposal)
        self.chains: CompiledChains | None = None  # bound at `start` where the target's steps are compiled whole
        self.in_step: HeadChain | None = None  # ... and its chains as the target's greedy steps run them (`step_draft`)
        # the next chain per row a greedy step drafted in its graph (`observe_drafted`) and the context lengths it
        # follows, or None
        self.drafted: tuple[list[list[int]], list[int]] | None = None

    def start(self, input_ids, attention_mask):
        """Bind to the target for this call: its embedding and LM head, where they execute now (a device_map may put
        them apart, or offload them: weights on meta between calls), the head checked against it."""
        check_head(self.head, self.target)
        self._bind(input_ids.shape[0])

    def _bind(self, batch: int) -> None:
        """The target's embedding and LM head where they execute now, and the call's counters reset."""
        self.embed = self.target.get_input_embeddings()
        self.lm_head = hf_features.lm_head(self.target)
        self.embed_device = hf_instance.execution_device(self.embed)
        self.features = [None] * batch
        self.steps = 0
        self.chain_fallbacks = 0  # rows a greedy tree fell back to a chain for (`trees.best_first_tree`)
        self.chains, self.drafted, self.in_step = None, None, None
        if self.compiles_chains and not self.tree and compiled_whole_on_cpu(self.head, self.target, self.embed,
                                                                            self.lm_head) is not None:  # fmt: skip
            self.chains = compiled_chains(self.head, self.target, self.embed, self.lm_head)
            self.in_step = HeadChain(self.head, self.embed, self.lm_head)

    def observe_features(self, row: int, feature: torch.Tensor) -> None:
        """The target's feature [H] at the last position it committed for `row` (whose logits chose the next root)."""
        self.features[row] = feature

    def step_draft(self) -> HeadChain | None:
        """The head's greedy chains in the target's greedy steps, where those are compiled whole on a CPU."""
        sampling = self.decoding is not None and self.decoding.do_sample
        return None if sampling else self.in_step

    def observe_drafted(self, chains, contexts) -> None:
        self.drafted = ([list(c) for c in chains], [len(c) for c in contexts])

    def has_drafted(self, contexts, max_depth: int) -> bool:
        if self.drafted is None:
            return False
        chains, lengths = self.drafted
        return len(chains) == len(contexts) and all(
            len(chain) > max_depth and len(c) == n and int(c[-1]) == chain[0]
            for chain, c, n in zip(chains, contexts, lengths)
        )

    def finish(self, stats) -> None:
        stats.drafter["head_calls"] = self.steps
        if self.chain_fallbacks:  # rows whose head was too unsure for a tree (`trees.best_first_tree`)
            stats.drafter["chain_fallbacks"] = self.chain_fallbacks

    @torch.no_grad()
    def _predict(self, parents: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the predicted features [M, H] after `tokens` given their parents' features [M, H], their logits [M, V])."""
        self.steps += 1
        ids = torch.tensor(list(tokens), device=self.embed_device)
        embedded = self.embed(ids).to(self.head_device, self.dtype)
        out = self.head(parents.to(self.head_device, self.dtype), embedded)
        logits = self.lm_head(out.to(self.lm_head.weight.dtype))
        return out, logits.float()

    def _root_logits(self, contexts) -> torch.Tensor | None:
        """The head's logits [B, V] after every row's root (None: no draft this step, a row has no feature yet);
        remembers the predicted root features the tree grows from."""
        if any(f is None for f in self.features):
            return None
        roots, root_logits = self._predict(torch.stack(self.features), [int(c[-1]) for c in contexts])
        self.predicted = [{0: roots[r]} for r in range(len(contexts))]  # per row, node -> its predicted feature
        return root_logits

    def _logits_at(self, trees, new) -> torch.Tensor:
        """The head's logits [M, V] after every row's new nodes (rows in order), from their parents' features."""
        nodes = [(r, n) for r, row in enumerate(new) for n in row]
        parent = torch.stack([self.predicted[r][trees[r][1][n]] for r, n in nodes])
        out, logits = self._predict(parent, [trees[r][0][n] for r, n in nodes])
        for i, (r, n) in enumerate(nodes):
            self.predicted[r][n] = out[i]
        return logits

    def propose(self, contexts, max_nodes, max_depth):
        depth = min(max_nodes, max_depth)
        self.scored = []
        sampling = self.decoding is not None and self.decoding.do_sample
        if not sampling and depth > 0 and self.has_drafted(contexts, depth):
            self.steps += depth  # (drafted in the step before: `step_draft`)
            return [(chain[: depth + 1], list(range(-1, depth))) for chain in self.drafted[0]]
        if self.chains is not None and not sampling and depth > 0 and all(f is not None for f in self.features):
            roots = torch.tensor([int(c[-1]) for c in contexts])
            self.steps += depth
            chains = [[int(c[-1]), *row] for c, row in zip(contexts, self.chains.chains(torch.stack(self.features),
                                                                                       roots, depth))]  # fmt: skip
            return [(c, list(range(-1, len(c) - 1))) for c in chains]
        root_logits = self._root_logits(contexts) if depth > 0 else None
        if root_logits is None:
            return [([int(c[-1])], [-1]) for c in contexts]
        self.scored = [{0: root_logits[r]} for r in range(len(contexts))]

        def logits_at(trees, new):  # the head's logits after every row's new nodes (kept for FusedDrafter's pruning)
            logits = self._logits_at(trees, new)
            for i, (r, n) in enumerate((r, n) for r, row in enumerate(new) for n in row):
                self.scored[r][n] = logits[i]
            return logits

        if self.decoding is not None and self.decoding.do_sample:
            width = max(1, min(self.branches, max_nodes // depth))
            return sample_tree(contexts, root_logits, logits_at, depth, width, self.sampling_tree, self.decoding)
        if not self.tree:  # a greedy chain: the head's argmax, level by level
            chains, at = [[int(c[-1])] for c in contexts], root_logits
            for level in range(depth):
                for chain, x in zip(chains, at.argmax(-1).tolist()):
                    chain.append(x)
                if level < depth - 1:
                    at = logits_at([(c, list(range(-1, len(c) - 1))) for c in chains], [[level + 1]] * len(chains))
            return [(c, list(range(-1, len(c) - 1))) for c in chains]
        # a round is one head call whatever its nodes: a few rounds of many nodes (at most `rounds`)
        per_round = max(1, -(-max_nodes // depth), -(-max_nodes // self.rounds))
        trees, fallbacks = best_first_tree(contexts, root_logits, logits_at, max_nodes, depth, per_round,
                                           self.min_path_prob)  # fmt: skip
        self.chain_fallbacks += fallbacks
        return trees
