"""Retrieval drafting (REST / SuffixDecoding style): a suffix array over a token corpus proposes what followed
the longest earlier occurrence of the context's tail, weighted by how often each continuation occurred.

    index = SuffixIndex.from_files(paths, tokenizer)      # or from_texts / from_sequences
    index.save("corpus.safetensors"); SuffixIndex.load("corpus.safetensors")
    model.generate(ids, speculation=SpecConfig(corpus=index))   # or corpus="corpus.safetensors"

The array is built once (numpy prefix doubling, sorted on the first `sort_depth` tokens of every suffix) and
queried by binary search: the longest suffix of the context (up to `max_match` tokens) that occurs in the
corpus selects a contiguous range of suffixes, whose continuations are sorted, so evenly spaced samples of
that range represent each continuation in proportion to its frequency. Drafts only change speed: the
verifier keeps the target's own tokens whatever the corpus says.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from array import array
from collections.abc import Iterable, Iterator, Sequence
from os import PathLike
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from ssmspec.errors import VocabMismatchError

SENTINEL = -1  # separates documents; never matched (token ids are >= 0)
FORMAT = "ssmspec.SuffixIndex/1"


class SuffixIndex:
    """A suffix array over one or more token sequences (documents), for retrieval drafting.

    Args:
        tokens: all documents concatenated, each followed by SENTINEL (int32).
        suffix_array: start positions of the suffixes, sorted on their first `sort_depth` tokens.
        sort_depth: how many leading tokens the order is exact for; queries match at most this many.

    Raises:
        ValueError: arrays that do not describe a suffix array (lengths, dtypes, the final sentinel).
    """

    def __init__(self, tokens: np.ndarray, suffix_array: np.ndarray, sort_depth: int) -> None:
        if tokens.ndim != 1 or suffix_array.shape != tokens.shape:
            raise ValueError(f"tokens {tokens.shape} and suffix_array {suffix_array.shape} must be 1-D, same length")
        if len(tokens) and int(tokens[-1]) != SENTINEL:
            raise ValueError("the token array must end with the document separator (-1)")
        self.sort_depth = int(sort_depth)
        self.np_tokens = tokens.astype(np.int32, copy=False)
        self.np_suffix_array = suffix_array.astype(np.int64, copy=False)
        # array.array: fast scalar indexing and lexicographic slice comparison for the binary searches
        self._tokens = array("i", self.np_tokens.tobytes())
        self._sa = array("q", self.np_suffix_array.tobytes())
        counts = np.bincount(self.np_tokens.astype(np.int64) - SENTINEL)  # the separator lands in bin 0
        self.documents = int(counts[0])
        self.token_counts = counts[1:]  # occurrences of each token id (VocabTrim counts on them)
        self.max_token = len(self.token_counts) - 1  # the largest token id indexed (-1: none)

    def __len__(self) -> int:
        """Tokens indexed (separators excluded)."""
        return len(self._tokens) - self.documents

    def __repr__(self) -> str:
        return f"SuffixIndex({len(self)} tokens, {self.documents} documents)"

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def from_sequences(cls, sequences: Iterable[Sequence[int]], sort_depth: int = 64) -> SuffixIndex:
        """Index token sequences (one document each).

        Raises:
            ValueError: a negative token id, or sort_depth < 1.
        """
        if sort_depth < 1:
            raise ValueError(f"sort_depth must be >= 1, got {sort_depth}")
        parts = []
        for seq in sequences:
            arr = np.asarray(list(seq) if not isinstance(seq, np.ndarray | torch.Tensor) else seq, dtype=np.int64)
            arr = arr.reshape(-1)
            if arr.size and int(arr.min()) < 0:
                raise ValueError("token ids must be >= 0")
            parts.append(arr)
            parts.append(np.array([SENTINEL], dtype=np.int64))
        tokens = np.concatenate(parts) if parts else np.array([SENTINEL], dtype=np.int64)
        return cls(tokens.astype(np.int32), _suffix_array(tokens, sort_depth), sort_depth)

    @classmethod
    def from_texts(cls, texts: Iterable[str], tokenizer, sort_depth: int = 64) -> SuffixIndex:
        """Index texts, tokenized with the target's tokenizer (no special tokens added)."""
        seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return cls.from_sequences(seqs, sort_depth)

    @classmethod
    def from_files(cls, paths: Iterable[str | PathLike], tokenizer, sort_depth: int = 64) -> SuffixIndex:
        """Index text files (UTF-8; undecodable bytes replaced), one document each.

        Raises:
            FileNotFoundError: a path that does not exist (named).
        """
        texts = []
        for p in paths:
            p = Path(p)
            if not p.is_file():
                raise FileNotFoundError(f"corpus file not found: {p}")
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
        return cls.from_texts(texts, tokenizer, sort_depth)

    def save(self, path: str | PathLike) -> None:
        """Write the index (safetensors: tokens, suffix array, sort depth)."""
        meta = {"format": FORMAT, "sort_depth": json.dumps(self.sort_depth)}
        save_file({"tokens": self.np_tokens, "suffix_array": self.np_suffix_array}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | PathLike) -> SuffixIndex:
        """Read an index written by `save`.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file is not an ssmspec suffix index.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"suffix index not found: {path}")
        from safetensors import safe_open

        with safe_open(str(path), framework="np") as f:
            meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not an ssmspec suffix index (format {meta.get('format')!r})")
        arrays = load_file(str(path))
        return cls(arrays["tokens"], arrays["suffix_array"], json.loads(meta["sort_depth"]))

    # ------------------------------------------------------------------------------------------ queries
    def _range(self, pattern: array) -> tuple[int, int]:
        """[lo, hi) of the suffixes that start with `pattern` (len(pattern) <= sort_depth)."""
        toks, m = self._tokens, len(pattern)

        def key(p):
            return toks[p : p + m]

        lo = bisect.bisect_left(self._sa, pattern, key=key)
        hi = bisect.bisect_right(self._sa, pattern, lo=lo, key=key)
        return lo, hi

    def longest_match(self, context: Sequence[int], max_match: int) -> tuple[int, int, int]:
        """(m, lo, hi): the longest tail of `context` (m <= max_match tokens) that occurs in the corpus and the
        range of suffixes starting with it; m = 0 when even the last token never occurs."""
        longest = min(max_match, self.sort_depth, len(context))
        best, lo, hi = 0, 0, 0
        low, high = 1, longest
        while low <= high:  # occurrence is monotone in the tail length: binary search it
            m = (low + high) // 2
            r = self._range(array("i", context[len(context) - m :]))
            if r[1] > r[0]:
                best, (lo, hi) = m, r
                low = m + 1
            else:
                high = m - 1
        return best, lo, hi

    def continuations(
        self, context: Sequence[int], depth: int, max_match: int = 16, max_samples: int = 32
    ) -> tuple[int, list[tuple[list[int], float]]]:
        """What followed the longest occurrence of the context's tail: (match length, [(continuation, weight)])
        with weights summing to 1 (each continuation's share of the occurrences; at most `max_samples`
        evenly spaced occurrences are read, which keeps those shares since the range is sorted)."""
        m, lo, hi = self.longest_match(context, max_match)
        count = hi - lo
        if m == 0 or depth <= 0 or count == 0:
            return m, []
        k = min(count, max_samples)
        toks, out = self._tokens, []
        for j in range(k):
            p = self._sa[lo + (j * count) // k] + m
            cont = toks[p : p + depth]
            cut = cont.index(SENTINEL) if SENTINEL in cont else len(cont)
            if cut:
                out.append((cont[:cut].tolist(), 1.0 / k))
        return m, out


class ContextIndex:
    """An incremental n-gram index over one growing token sequence (a row's prompt and output): for every
    n <= `max_ngram`, the end positions of each n-gram, appended as tokens arrive. Finding the earlier
    occurrences of the context's tail then costs what it finds, not a scan of the whole context.

    The end positions are hash chains (each n-gram's latest end, and per position the previous end of the n-gram
    ending there): a handful of containers per index whatever its length. A batch's indexes live through a whole
    generate call, and as one list per n-gram (8k at batch 32 on the embedded target) they were what made Python's
    garbage collector run full collections during the call (150-180 ms each, one every few calls at batch 32).

    Args:
        max_ngram: the longest tail match looked up (prompt lookup's `max_matching_ngram_size`).
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max(1, int(max_ngram))
        self._start()
        self._source: Sequence[int] | None = None  # the sequence last synced (the engine appends to it)

    def _start(self) -> None:
        """Empty: per n, each n-gram's latest end, and per position the previous end of the n-gram ending there."""
        self.tokens: list[int] = []
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_ngram)]
        self._previous: list[list[int]] = [[] for _ in range(self.max_ngram)]

    def extend(self, tokens: Iterable[int]) -> None:
        """Index tokens appended to the sequence."""
        toks = self.tokens
        start = len(toks)
        toks.extend(map(int, tokens))
        n = len(toks)
        for m in range(1, self.max_ngram + 1):  # one n at a time over all new ends (a prompt: 3k tokens at batch 32)
            latest, previous = self._latest[m - 1], self._previous[m - 1]
            first = max(start, m - 1)  # the first new position an m-gram ends at
            previous.extend([-1] * (min(first, n) - start))  # positions too early for an m-gram
            get = latest.get
            # the m-grams ending at first..n-1: their j-th tokens are toks[first - m + 1 + j : n - m + 1 + j]
            for i, key in enumerate(zip(*(toks[first - m + 1 + j : n - m + 1 + j] for j in range(m))), first):
                previous.append(get(key, -1))
                latest[key] = i

    def ends(self, ngram: Sequence[int]) -> Iterator[int]:
        """Where `ngram` ends in the indexed sequence, latest first."""
        m = len(ngram)
        if not 1 <= m <= self.max_ngram:
            return
        end, previous = self._latest[m - 1].get(tuple(ngram), -1), self._previous[m - 1]
        while end >= 0:
            yield end
            end = previous[end]

    def sync(self, context: Sequence[int]) -> None:
        """Bring the index to `context`: extend it when `context` continues what was indexed, else rebuild."""
        n = len(self.tokens)
        grows = len(context) >= n and (
            context is self._source
            or (n == 0 or context[n - 1] == self.tokens[-1])
            and list(context[:n]) == self.tokens
        )
        if not grows:
            self._start()
            n = 0
        self.extend(context[n:])
        self._source = context

    def matches(self, context: Sequence[int], limit: int) -> list[tuple[int, int]]:
        """(match length, end) of the earlier occurrences of `context`'s last token, longest match of its tail
        (up to `max_ngram`) first, then latest; at most `limit`. `context` is the indexed sequence, possibly
        followed by a few tokens not indexed (they are scanned)."""
        n, k = len(context), len(self.tokens)
        if n < 1 or limit <= 0:
            return []

        def length(end: int) -> int:
            m = 1
            while m < self.max_ngram and end - m >= 0 and context[end - m] == context[n - 1 - m]:
                m += 1
            return m

        found = [(length(e), e) for e in range(k, n - 1) if context[e] == context[n - 1]]
        for m in range(min(self.max_ngram, n), 0, -1):
            taken = 0
            for end in self.ends(context[n - m :]):
                if end >= n - 1 or length(end) != m:  # the tail itself, or a longer match (counted above)
                    continue
                found.append((m, end))
                taken += 1
                if taken == limit:
                    break
        found.sort(key=lambda f: (-f[0], -f[1]))
        return found[:limit]


def _suffix_array(tokens: np.ndarray, sort_depth: int) -> np.ndarray:
    """Suffix start positions sorted on their first `sort_depth` tokens (prefix doubling; ties by position)."""
    n = len(tokens)
    rank = tokens.astype(np.int64) + 1  # the separator ranks lowest (0)
    sa = np.argsort(rank, kind="stable")
    k = 1
    while k < sort_depth:
        second = np.zeros(n, dtype=np.int64)
        second[: n - k] = rank[k:]
        sa = np.lexsort((second, rank))
        r, s = rank[sa], second[sa]
        new = np.empty(n, dtype=np.int64)
        new[sa] = np.concatenate([[0], np.cumsum((r[1:] != r[:-1]) | (s[1:] != s[:-1]))])
        rank = new
        k *= 2
        if int(rank[sa[-1]]) == n - 1:  # every suffix distinct: the order is final
            break
    return sa


def corpus_index(corpus, tokenizer, vocab_size: int, cache: dict) -> SuffixIndex:
    """The SuffixIndex a `SpecConfig(corpus=...)` names, built or loaded once and then reused from `cache`
    (a dict the caller owns: the model keeps one, so two models never share state).

    corpus: a SuffixIndex; a str or path: an index file written by `SuffixIndex.save`; a sequence of
    documents: each `str` is a text, each `os.PathLike` a text file (both tokenized with `tokenizer`).

    Raises:
        ValueError: documents without a tokenizer, a str document that names an existing file (ambiguous:
            pass a pathlib.Path to index the file), or an index with token ids outside the vocabulary.
        FileNotFoundError: a missing index or corpus file.
    """
    if isinstance(corpus, SuffixIndex):
        index = corpus
    else:
        key = _cache_key(corpus, tokenizer)
        index = cache.get(key)
        if index is None:
            if isinstance(corpus, str | PathLike):
                index = SuffixIndex.load(corpus)
            else:
                if tokenizer is None:
                    raise ValueError(
                        "SpecConfig(corpus=[...documents]) needs generate(..., tokenizer=) to tokenize them "
                        "(or pass a prebuilt ssmspec.SuffixIndex)"
                    )
                for doc in corpus:
                    if isinstance(doc, str) and "\n" not in doc and len(doc) < 4096 and Path(doc).is_file():
                        raise ValueError(
                            f"corpus document {doc!r} is a str naming an existing file: pass pathlib.Path({doc!r}) "
                            "to index the file's text (a str is indexed as text)"
                        )
                texts = [Path(d).read_text(encoding="utf-8", errors="replace") if isinstance(d, PathLike) else d
                         for d in corpus]  # fmt: skip
                index = SuffixIndex.from_texts(texts, tokenizer)
            while len(cache) >= 4:  # a few corpora per model at most
                cache.pop(next(iter(cache)))
            cache[key] = index
    if index.max_token >= vocab_size:
        raise VocabMismatchError(
            f"the corpus index holds token id {index.max_token} >= the target's vocab_size {vocab_size}"
        )
    return index


def _cache_key(corpus, tokenizer) -> tuple:
    """Identifies a corpus by its documents (files by path, size and modification time) and tokenizer."""
    if isinstance(corpus, str | PathLike):
        st = Path(corpus).stat() if Path(corpus).is_file() else None
        return ("index", str(corpus), st and (st.st_size, st.st_mtime_ns))
    docs = []
    for d in corpus:
        if isinstance(d, PathLike):
            p = Path(d)
            if not p.is_file():
                raise FileNotFoundError(f"corpus file not found: {p}")
            st = p.stat()
            docs.append(("file", str(p.resolve()), st.st_size, st.st_mtime_ns))
        elif isinstance(d, str):
            docs.append(("text", hashlib.sha1(d.encode("utf-8", "surrogatepass")).hexdigest()))
        else:
            raise TypeError(f"corpus documents must be str (text) or os.PathLike (file), got {type(d).__name__}")
    tok = (type(tokenizer).__name__, getattr(tokenizer, "name_or_path", None), len(tokenizer)) if tokenizer else None
    return ("docs", tuple(docs), tok)


def frequent_tokens(index: SuffixIndex, k: int) -> torch.Tensor:
    """The `k` most frequent token ids of a corpus (VocabTrim's kept draft vocabulary), most frequent first."""
    counts = index.token_counts
    order = np.argsort(-counts, kind="stable")[: min(k, int((counts > 0).sum()))]
    return torch.from_numpy(order.astype(np.int64))
