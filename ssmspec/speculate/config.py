"""SpecConfig: how a transformed model speculates (drafter, chain or tree, budgets, commit strategy)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from os import PathLike

from ssmspec.errors import GENERIC_GRAPHS, not_one_of
from ssmspec.speculate.retrieval import SuffixIndex
from ssmspec.verification import COMMIT_STRATEGIES

DRAFTERS = ("auto", "prompt_lookup", "draft_model", "draft_head", "mtp", "none")
# the most drafted nodes per row a step may verify, and the deepest draft: a verify step's buffers (its ancestor mask,
# masked scan, attention over the tree) grow with the square of the nodes, and no drafter's trees pay near this size
MAX_DRAFT_NODES = 1024
PATHS = ("auto", "seams", "generic")
SAMPLING_TREES = ("gumbel_top_k", "stochastic_beam")


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings for `model.generate(..., speculation=SpecConfig(...))` (immutable).

    Left at their defaults: the drafter `drafter="auto"` picks for the model and call, each size the one that
    drafter's size sweep on held-out code measured fastest (ssmspec.speculate.defaults.sized; an n-gram tree of 16
    nodes, 8 deep), and each step's depth chosen by its measured price (`adaptive`). On a given model a fixed
    configuration may measure faster (docs: Benchmarks, "The default configuration").

    Attributes:
        drafter: "auto" (default): "draft_model" where the call passes `assistant_model`, else "draft_head" where
            the model has a draft head (and `recycle` and `ahead` are off), else "prompt_lookup". "prompt_lookup":
            n-gram match in prompt + output; "draft_model" (needs `assistant_model`); "draft_head": an EAGLE-style
            head on the target's own features, trained for the target and attached by
            `ssmspec.transform(model, draft_head=...)` (ssmspec.speculate.drafters.head), its tree fused with prompt
            lookup's (and the corpus's); the model's MTP layer where its checkpoint ships one (ssmspec.hf.mtp) is its
            draft head ("auto" takes a head where it is small against the model, HEAD_MAX_SHARE in
            ssmspec.speculate.plan, and a trained draft head for a sampled call whatever its size); "mtp": that
            MTP layer, refused where the model has none; "none": plain decoding through ssmspec's engine.
        num_draft_tokens: maximum draft depth per step (a chain has this many drafted nodes), 1 to MAX_DRAFT_NODES;
            a call drafts no deeper than the tokens it has left and its tree budget. None (default): the drafter's
            measured depth (n-gram lookup 8; a draft head 8 greedy, 4 sampling; an MTP layer 8 greedy, 3 sampling; a
            draft model 4).
        tree: False = chain; True = a tree from several matches / candidates; None (default): a tree where the model
            verifies trees exactly (its transform-time probe), else a chain. True on a model whose trees were found
            inexact is refused before anything runs.
        tree_budget: maximum drafted nodes per row in tree mode, 1 to MAX_DRAFT_NODES. None (default): the
            drafter's measured size (n-gram lookup 16; a draft head 24 greedy, 4 sampling (a chain); an MTP layer 24
            greedy, 9 sampling; a draft model 12).
        max_matching_ngram_size: longest n-gram prompt lookup tries to match (falls back to shorter ones).
        commit: "replay" (re-run the recurrence along the accepted path; small memory) or "materialize"
            (keep every node's state; commit is a gather).
        sampling_tree: how a draft model grows a tree when sampling (`tree=True`, `do_sample=True`):
            "gumbel_top_k" (distinct children of the root, each continued as a sampled chain) or
            "stochastic_beam" (the best `tree_budget // num_draft_tokens` paths of each level by perturbed
            log-probability, as RSD's stochastic beam search; siblings are always drawn without replacement).
        adaptive: choose each step's depth and node budget (0: plain decoding) for the best expected tokens
            per unit of step cost, from each row's acceptance so far and the model's verify-cost curve, which is
            measured once per model on first use (SmartSpec style). With `recycle`, each tree is sized instead from
            its nodes' calibrated acceptance estimates: the prefix of the best-first draft with the most expected
            tokens per unit of step cost. Output is unchanged; only speed. On by default.
        static_shapes: pad trees to power-of-two node counts (at most to the largest tree the drafter can
            make) and commit fixed-length paths, so that a compiled verify step (and CUDA graphs) never
            recompile; None: on when the model was compiled (`model.compile(...)`), off in eager mode.
        corpus: retrieval drafting (REST style) for the "prompt_lookup" drafter: besides the context, what
            followed the longest match of the context's tail in this corpus is proposed. A ssmspec.SuffixIndex;
            a str or path: an index saved by `SuffixIndex.save`; or a sequence of documents (each `str` a
            text, each `pathlib.Path` a file), tokenized with generate's `tokenizer=` and indexed once per
            model. None: the context only. With the "draft_model" drafter and `tree=True` the retrieval tree is
            fused into the draft's (RASD); `draft_vocab` counts its tokens.
        draft_vocab: VocabTrim for the "draft_model" drafter: its LM head keeps only the `draft_vocab` most
            frequent tokens of `corpus` (an int), or the given token ids (a sequence, e.g.
            `ssmspec.speculate.retrieval.frequent_tokens(index, 512).tolist()`: no corpus, so no fusion), plus
            the prompt's tokens, EOS and pad; mapped back to the target's ids; lossless (drafts only change
            speed). None: the full vocabulary.
        ahead: Saguaro (speculative speculative decoding): while the target verifies a step, a background thread
            drafts the next step for the `ahead` likeliest verification outcomes (accepted path x bonus token):
            per row for the "prompt_lookup" drafter (ssmspec.speculate.drafters.ahead.AheadDrafter); for a draft model
            (chains, dynamic trees, VocabTrim, RASD; greedy decoding only) each outcome is a full proposal from
            the draft state it would leave (DraftAheadDrafter). On a hit the next draft is ready. Drafts and
            output are unchanged; `spec_stats["drafter"]` reports the hit rate and the drafting time saved.
            0: off.
        recycle: token recycling for the "prompt_lookup" drafter: the target's `recycle` most likely next tokens
            after every token it verified (its logits are computed anyway) are proposed besides the n-gram and
            corpus votes, and drafts grow best-first by acceptance estimates calibrated online on which drafted
            nodes the target accepts (ssmspec.speculate.recycling). Most useful with trees. 0: off.
        path: how the target verifies: "seams" (ssmspec's tree-aware mixers: trees, batches), "generic" (HF's
            own forward and cache, for a model without kernel seams: chains, batches row by row;
            ssmspec.speculate.generic) or "auto" (default): whichever `transform` found for the model
            (`model.ssmspec_info.path`).
        verify_memory: bytes the buffers of one verify step may hold (the tree's replay records or node states and
            its attention K/V slots, all rows): trees are cut to the nodes per row that fit, as measured on the
            steps before (`spec_stats["max_verify_bytes"]` reports the largest step). Independently of it, a verify
            step that runs out of memory (torch.OutOfMemoryError) is retried with half the nodes, down to a plain
            decode step, and later steps keep that size. None: no budget.
        graphs: capture each tree-size bucket's verify step and its commit once over static buffers and replay them
            every step (ssmspec.compile.graphs: a CUDA graph on a GPU; on a CPU model compiled whole, each step
            compiled by Inductor into one graph, verified, accepted and committed in it when greedy; otherwise on a
            CPU an op tape that replays the same ops, for tests); needs static shapes, which it turns on. None: on
            for a model `transform(compile=True)` compiled (on CUDA, or its steps compiled whole on a CPU), off
            otherwise. A step that cannot be captured raises CaptureError naming the op and where it was called.

    Raises:
        TypeError: a field of the wrong type (named).
        ValueError: a field with an invalid value (named).
    """

    drafter: str = "auto"
    num_draft_tokens: int | None = None
    tree: bool | None = None
    tree_budget: int | None = None
    max_matching_ngram_size: int = 2
    commit: str = "replay"
    sampling_tree: str = "gumbel_top_k"
    adaptive: bool = True
    static_shapes: bool | None = None
    corpus: SuffixIndex | str | PathLike | Sequence[str | PathLike] | None = None
    draft_vocab: int | Sequence[int] | None = None
    ahead: int = 0
    recycle: int = 0
    path: str = "auto"
    verify_memory: int | None = None
    graphs: bool | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.corpus, list):  # frozen and hashable: keep documents as a tuple
            object.__setattr__(self, "corpus", tuple(self.corpus))
        self._check_retrieval()
        self._check_ahead_and_recycling()
        self._check_values()

    def _check_types(self) -> None:
        """Each field of its type (a bool is not an int here), named where it is not."""
        types = {"drafter": str, "num_draft_tokens": (int, type(None)), "tree": (bool, type(None)),
                 "tree_budget": (int, type(None)),
                 "max_matching_ngram_size": int, "commit": str, "sampling_tree": str, "adaptive": bool,
                 "static_shapes": (bool, type(None)),
                 "corpus": (SuffixIndex, str, PathLike, list, tuple, type(None)),
                 "draft_vocab": (int, list, tuple, type(None)), "ahead": int, "recycle": int,
                 "path": str, "verify_memory": (int, type(None)), "graphs": (bool, type(None))}  # fmt: skip
        for f in fields(self):
            value, want = getattr(self, f.name), types[f.name]
            if not isinstance(value, want) or (
                int in (want if isinstance(want, tuple) else (want,)) and isinstance(value, bool)
            ):
                kind = {
                    "static_shapes": "a bool or None",
                    "tree": "a bool or None",
                    "graphs": "a bool or None",
                    "num_draft_tokens": "an int or None",
                    "tree_budget": "an int or None",
                    "draft_vocab": "an int, a sequence of token ids or None",
                    "corpus": "a SuffixIndex, an index path, a list of documents or None",
                    "verify_memory": "an int (bytes) or None",
                }.get(f.name)
                kind = kind or f"a {want.__name__}"
                raise TypeError(f"SpecConfig.{f.name} must be {kind}, got {value!r}")

    def _check_retrieval(self) -> None:
        """A corpus and a trimmed draft vocabulary only where the drafter uses them."""
        if self.draft_vocab is not None:
            if self.drafter != "draft_model":
                raise ValueError(
                    f"SpecConfig.draft_vocab trims a draft model's vocabulary; drafter is {self.drafter!r}"
                )
            if isinstance(self.draft_vocab, list | tuple):  # explicit ids
                object.__setattr__(self, "draft_vocab", tuple(self.draft_vocab))
                if not self.draft_vocab or not all(isinstance(t, int) and t >= 0 for t in self.draft_vocab):
                    raise ValueError("SpecConfig.draft_vocab ids must be a non-empty sequence of token ids >= 0")
            elif self.draft_vocab < 1:
                raise ValueError(f"SpecConfig.draft_vocab must be >= 1, got {self.draft_vocab}")
            elif self.corpus is None:
                raise ValueError(
                    "SpecConfig.draft_vocab needs corpus= (the text its most frequent tokens are counted on)"
                )
        if self.corpus is not None and self.drafter == "none":
            raise ValueError("SpecConfig.corpus needs a drafter ('prompt_lookup' or 'draft_model'), not 'none'")
        chain = self.tree is False
        if self.corpus is not None and self.drafter == "draft_model" and chain and self.draft_vocab is None:
            raise ValueError(
                "SpecConfig.corpus with a draft model is used by tree=True (the retrieval tree fused into the "
                "draft's) or by draft_vocab; set one of them"
            )
        if self.corpus is not None and self.drafter in ("draft_head", "mtp") and self.tree is False:
            raise ValueError(
                "SpecConfig.corpus with a draft head is used by tree=True (the retrieval tree fused into the head's)"
            )

    def _check_ahead_and_recycling(self) -> None:
        """Drafting ahead (Saguaro) and token recycling: for the drafters that have them, not together."""
        if self.ahead < 0:
            raise ValueError(f"SpecConfig.ahead must be >= 0 (outcomes drafted ahead per row), got {self.ahead}")
        if self.ahead and self.drafter in ("none", "draft_head", "mtp"):
            raise ValueError(
                "SpecConfig.ahead (Saguaro) drafts ahead for n-gram and draft-model drafters; drafter is "
                f"{self.drafter!r}"
            )
        if self.recycle < 0:
            raise ValueError(f"SpecConfig.recycle must be >= 0 (successors kept per token), got {self.recycle}")
        if self.recycle and self.drafter not in ("auto", "prompt_lookup"):
            raise ValueError(
                f"SpecConfig.recycle (token recycling) drafts for the 'prompt_lookup' drafter; drafter is "
                f"{self.drafter!r}"
            )
        if self.recycle and self.ahead:
            raise ValueError(
                "SpecConfig.recycle and SpecConfig.ahead cannot be combined: drafting ahead runs while the target "
                "verifies, before the recycled successors of that step are known"
            )

    def _check_values(self) -> None:
        """Choices among the known ones, sizes within range, captured steps where they can run."""
        for name, choices in (("drafter", DRAFTERS), ("path", PATHS), ("commit", COMMIT_STRATEGIES),
                              ("sampling_tree", SAMPLING_TREES)):  # fmt: skip
            if getattr(self, name) not in choices:
                raise not_one_of(f"SpecConfig.{name}", getattr(self, name), choices)
        if self.num_draft_tokens is not None and not 0 <= self.num_draft_tokens <= MAX_DRAFT_NODES:
            raise ValueError(
                f"SpecConfig.num_draft_tokens must be between 0 and {MAX_DRAFT_NODES} (draft depth per step), got "
                f"{self.num_draft_tokens}"
            )
        if self.graphs and self.static_shapes is False:
            raise ValueError(
                "SpecConfig.graphs captures static-shape steps; it cannot be combined with static_shapes=False"
            )
        if self.graphs and self.path == "generic":
            raise ValueError(GENERIC_GRAPHS)
        if self.verify_memory is not None and self.verify_memory < 1:
            raise ValueError(f"SpecConfig.verify_memory must be >= 1 (bytes) or None, got {self.verify_memory}")
        if self.tree_budget is not None and not 1 <= self.tree_budget <= MAX_DRAFT_NODES:
            raise ValueError(
                f"SpecConfig.tree_budget must be between 1 and {MAX_DRAFT_NODES} (drafted nodes per row and step), got "
                f"{self.tree_budget}"
            )
        if self.max_matching_ngram_size < 1:
            raise ValueError(f"SpecConfig.max_matching_ngram_size must be >= 1, got {self.max_matching_ngram_size}")
