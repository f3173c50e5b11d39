"""End-to-end benchmark behind `ssmspec bench` and benchmarks/e2e.py: tokens/s on the embedded target over
held-out real code, side by side in one run — HF generate greedy, ssmspec autoregressive (no drafts), chain
speculation (n-gram; draft model), tree speculation (n-gram). Every output is asserted identical to HF
greedy. With `--sampling`, also speculative sampling against HF's sampling at each temperature. Prompts: the
first tokens of each held-out standard-library file (left out of training).
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

import ssmspec
from ssmspec import models
from ssmspec.models import corpus_files
from ssmspec.speculate.retrieval import frequent_tokens

# the rows of what a user gets without tuning: generate() with no speculation kwarg, and with a draft model only
DEFAULT = "ssmspec default"
DRAFT_DEFAULT = "ssmspec default, draft model"
THIRD_PARTY = ("hypothesis", "einops", "tqdm", "safetensors", "numpy", "transformers")


PROMPT_SETS = {
    "held-out": "held-out",
    "third-party": "third-party (installed packages' sources)",
    "prose": "prose (installed packages' descriptions)",
    "random": "random-token",
}


def best_time(fn, repeats: int, warm=None) -> tuple[float, object]:
    """The fastest of `repeats` calls of fn (seconds) and its last result; `warm`: an untimed call made first."""
    if warm is not None:
        warm()
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def held_out_prompts(tok, count: int, prompt_tokens: int, prompt_set: str = "held-out") -> list[torch.Tensor]:
    """The first `prompt_tokens` tokens of each file of a prompt set (deterministic order): "held-out" (the
    standard-library files left out of training), "third-party" (installed packages' sources: code the model
    never saw, by other authors), "prose" (installed packages' long descriptions: English prose, where a code
    model's drafts are rarely accepted) or "random" (uniformly random non-special tokens, seeded): the last
    two measure what speculation costs where it does not pay."""
    if prompt_set == "random":
        special = set(tok.all_special_ids)
        allowed = torch.tensor([t for t in range(len(tok)) if t not in special])
        gen = torch.Generator().manual_seed(0)
        return [allowed[torch.randint(len(allowed), (1, prompt_tokens), generator=gen)] for _ in range(count)]
    prompts = []
    for text in prompt_texts(prompt_set):
        ids = tok(text, return_tensors="pt")["input_ids"]
        if ids.shape[1] >= prompt_tokens:
            prompts.append(ids[:, :prompt_tokens])
        if len(prompts) == count:
            break
    return prompts


def prompt_texts(prompt_set: str) -> Iterator[str]:
    """The texts of a prompt set other than "random", in order (read as they are asked for)."""
    if prompt_set in ("held-out", "third-party"):
        files = corpus_files()[1] if prompt_set == "held-out" else third_party_files()
        return (path.read_text(encoding="utf-8", errors="replace") for path in files)
    if prompt_set == "prose":
        return iter(package_descriptions())
    raise ValueError(f"prompt_set must be one of {sorted(PROMPT_SETS)}, got {prompt_set!r}")


def package_descriptions() -> list[str]:
    """The long descriptions (README prose) of installed distributions, in name order, with code blocks and
    lines that look like markup or code left out."""
    from importlib.metadata import distributions

    out = {}
    for dist in distributions():
        meta = dist.read_text("METADATA") or ""
        head, _, body = meta.partition("\n\n")
        name = next((line[5:].strip() for line in head.splitlines() if line.startswith("Name:")), "")
        lines, fenced = [], False
        for line in body.splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
                continue
            text = line.strip()
            if fenced or not text or text[0] in "#|<[!-*=>.:`$" or sum(c.isalpha() for c in text) < 0.7 * len(text):
                continue
            lines.append(text)
        prose = " ".join(lines)
        if len(prose) > 2000:
            out.setdefault(name.lower(), prose)
    return [out[name] for name in sorted(out)]


def third_party_files() -> list[Path]:
    """Python sources of installed third-party packages (THIRD_PARTY, those present), at most 4 per package,
    files of 4-64 KB chosen by a hash of their path inside the package (the same on every machine)."""
    import importlib.util

    out = []
    for name in THIRD_PARTY:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        files = [p for p in root.rglob("*.py") if 4096 <= p.stat().st_size <= 65536 and "test" not in p.name]
        files.sort(key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())
        out += files[:4]
    return out


def training_index(tok) -> ssmspec.SuffixIndex:
    """A retrieval corpus: the embedded models' training files (never the held-out ones), indexed."""
    train, _ = corpus_files()
    return ssmspec.SuffixIndex.from_files(train, tok)


def greedy_methods(k: int, budget: int, corpus, draft) -> dict[str, dict]:
    """The compared configurations: (name -> generate kwargs)."""
    # the named configurations as they were measured before the defaults changed: chains unless `tree=True`,
    # fixed depth unless `adaptive=True`, n-gram lookup unless another drafter is named (the embedded target has a
    # draft head, which drafter "auto" would pick)
    spec = functools.partial(ssmspec.SpecConfig, drafter="prompt_lookup", tree=False, adaptive=False)
    head = functools.partial(ssmspec.SpecConfig, drafter="draft_head", tree=True, adaptive=True)
    return {
        DEFAULT: {},  # what a user gets without any speculation kwarg
        "ssmspec default without a draft head": dict(speculation=ssmspec.SpecConfig(drafter="prompt_lookup")),
        "ssmspec autoregressive": dict(speculation=spec(drafter="none")),
        "tree draft head + n-gram": dict(speculation=head(num_draft_tokens=k, tree_budget=budget)),
        "tree draft head + n-gram + corpus": dict(speculation=head(num_draft_tokens=k, tree_budget=budget,
                                                                   corpus=corpus)),
        "chain n-gram": dict(speculation=spec(num_draft_tokens=k)),
        "tree n-gram": dict(speculation=spec(num_draft_tokens=k, tree=True, tree_budget=budget)),
        "tree n-gram adaptive": dict(speculation=spec(num_draft_tokens=k, tree=True, tree_budget=budget,
                                                      adaptive=True)),
        "chain n-gram + corpus": dict(speculation=spec(num_draft_tokens=k, corpus=corpus)),
        f"tree n-gram + corpus ({k} nodes)": dict(speculation=spec(num_draft_tokens=k, tree=True, tree_budget=k,
                                                                    corpus=corpus)),
        "tree n-gram + corpus": dict(speculation=spec(num_draft_tokens=k, tree=True, tree_budget=budget,
                                                      corpus=corpus)),
        f"tree n-gram + corpus ({k} nodes) + Saguaro": dict(speculation=spec(
            num_draft_tokens=k, tree=True, tree_budget=k, corpus=corpus, ahead=2)),
        "tree n-gram + corpus adaptive": dict(speculation=spec(num_draft_tokens=k, tree=True, tree_budget=budget,
                                                               corpus=corpus, adaptive=True)),
        "tree n-gram + recycling": dict(speculation=spec(num_draft_tokens=k, tree=True, tree_budget=budget,
                                                         recycle=4)),
        f"tree n-gram + corpus ({k} nodes) + recycling": dict(speculation=spec(
            num_draft_tokens=k, tree=True, tree_budget=k, corpus=corpus, recycle=4)),
        "tree n-gram + corpus + recycling": dict(speculation=spec(num_draft_tokens=k, tree=True, tree_budget=budget,
                                                                  corpus=corpus, recycle=4)),
        DRAFT_DEFAULT: dict(assistant_model=draft),  # what a user gets with a draft model and no other kwarg
        "chain draft model": dict(assistant_model=draft, speculation=spec(drafter="draft_model",
                                                                          num_draft_tokens=min(k, 4))),
        "dynamic tree draft model": dict(assistant_model=draft, speculation=spec(
            drafter="draft_model", num_draft_tokens=min(k, 4), tree=True, tree_budget=12)),
        "dynamic tree draft model + VocabTrim": dict(assistant_model=draft, speculation=spec(
            drafter="draft_model", num_draft_tokens=min(k, 4), tree=True, tree_budget=12,
            draft_vocab=frequent_tokens(corpus, 512).tolist())),
        "dynamic tree draft model + corpus (RASD)": dict(assistant_model=draft, speculation=spec(
            drafter="draft_model", num_draft_tokens=min(k, 4), tree=True, tree_budget=12, corpus=corpus)),
        "RASD + VocabTrim": dict(assistant_model=draft, speculation=spec(
            drafter="draft_model", num_draft_tokens=min(k, 4), tree=True, tree_budget=12, corpus=corpus,
            draft_vocab=512)),
        "dynamic tree draft model + VocabTrim + Saguaro": dict(assistant_model=draft, speculation=spec(
            drafter="draft_model", num_draft_tokens=min(k, 4), tree=True, tree_budget=12,
            draft_vocab=frequent_tokens(corpus, 512).tolist(), ahead=2)),
        "RASD + VocabTrim + Saguaro": dict(assistant_model=draft, speculation=spec(
            drafter="draft_model", num_draft_tokens=min(k, 4), tree=True, tree_budget=12, corpus=corpus,
            draft_vocab=512, ahead=2)),
    }  # fmt: skip


def compiled_methods(greedy: dict[str, dict], k: int, draft: torch.nn.Module | None = None) -> dict[str, dict]:
    """The configurations of `greedy_methods` also timed on the compiled target
    (`model.compile(backend="ssmspec", options=COMPILE_OPTIONS)`: static shapes, reference tree ops fused by
    Inductor, its C++ wrapper), under their compiled row names; with `draft` (the draft compiled alike), the
    draft-model configurations too, drafting with it."""
    names = {DEFAULT: f"{DEFAULT} (compiled)", "ssmspec autoregressive": "ssmspec autoregressive (compiled)",
             "chain n-gram + corpus": "chain n-gram + corpus (compiled)",
             f"tree n-gram + corpus ({k} nodes)": f"tree n-gram + corpus ({k} nodes, compiled)",
             f"tree n-gram + corpus ({k} nodes) + Saguaro": None, f"tree n-gram + corpus ({k} nodes) + recycling": None,
             "tree n-gram + corpus": "tree n-gram + corpus (compiled)"}  # fmt: skip
    out = {compiled or f"{name} (compiled)": greedy[name] for name, compiled in names.items()}
    if draft is not None:
        for name in (
            DRAFT_DEFAULT,
            "chain draft model",
            "dynamic tree draft model + corpus (RASD)",
            "RASD + VocabTrim",
        ):
            out[f"{name} (compiled, compiled draft)"] = {**greedy[name], "assistant_model": draft}
    return out


# the plain decoders (no speculation) a user could run instead; "vs best" divides by the fastest of them
BASELINES = ("HF greedy", "HF greedy (compiled)", "HF greedy (compiled, C++ wrapper)", "ssmspec autoregressive",
             "ssmspec autoregressive (compiled)")  # fmt: skip
# Inductor's C++ wrapper: the fastest compiled configuration on CPU for both HF and ssmspec (it takes the
# Python wrapper's per-call overhead off small graphs), at minutes of compilation instead of seconds
COMPILE_OPTIONS = {"cpp_wrapper": True}


def _same_as_hf(name: str, out: torch.Tensor, want: torch.Tensor, prompt: int) -> None:
    """A timed method's output is HF greedy's (a benchmark never times a method that gives other tokens)."""
    if not torch.equal(out, want):
        raise AssertionError(f"{name}: output differs from HF greedy on prompt {prompt}")


def warm_up(model, ids: torch.Tensor, **kw):
    """One untimed call: first calls pay one-time costs (allocator, lazy imports, compilation) that must not land on
    one method; on a transformed model its calibration completed now (`ssmspec.calibrate`), so the timed calls are
    the calibrated calls a user gets after the first few (or at once where it is cached on disk)."""
    if getattr(model, "ssmspec_info", None) is not None:
        return ssmspec.calibrate(model, ids, **kw)
    return model.generate(ids, **kw)


def run(args: argparse.Namespace, progress: bool = True) -> dict:
    """Greedy end to end: every method on every prompt, timed side by side (best of `args.repeats` per
    prompt and method), outputs asserted identical to HF greedy. With `args.compiled`, also HF greedy on a
    `model.compile()`d model (with Inductor's Python wrapper and with its C++ wrapper) and the main
    configurations on a target compiled with the ssmspec backend and the C++ wrapper (compilation and every
    tree-size bucket are warmed up on two prompts before timing)."""
    ref, tok = models.load("mamba2-target")
    target = ssmspec.transform(copy.deepcopy(ref))
    draft, _ = models.load("mamba2-draft")
    prompt_set = getattr(args, "prompt_set", "held-out")
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens, prompt_set)
    if not prompts:
        raise ValueError(f"no {prompt_set} file has {args.prompt_tokens} tokens")
    greedy = greedy_methods(args.draft_tokens, args.tree_budget, training_index(tok), draft)
    methods = {name: (target, kw) for name, kw in greedy.items() if _chosen(name, args)}
    baselines = {"HF greedy": ref}
    plain = {"do_sample": False}
    warm = [(ref, plain, prompts[0], 8)] + [(model, kw, prompts[0], 8) for model, kw in methods.values()]
    if getattr(args, "compiled", False):
        compiled_ref = copy.deepcopy(ref)
        compiled_ref.compile()
        compiled_ref_cpp = copy.deepcopy(ref)
        compiled_ref_cpp.compile(options=COMPILE_OPTIONS)
        compiled = ssmspec.transform(copy.deepcopy(ref))
        compiled.compile(backend="ssmspec", options=COMPILE_OPTIONS)
        compiled_draft = ssmspec.transform(copy.deepcopy(draft))
        compiled_draft.compile(backend="ssmspec", options=COMPILE_OPTIONS)
        baselines["HF greedy (compiled)"] = compiled_ref
        baselines["HF greedy (compiled, C++ wrapper)"] = compiled_ref_cpp
        extra = {name: kw for name, kw in compiled_methods(greedy, args.draft_tokens, compiled_draft).items()
                 if _chosen(name, args)}  # fmt: skip
        methods.update({name: (compiled, kw) for name, kw in extra.items()})
        warm += [(m, kw, p, args.max_new_tokens) for p in prompts[:2]
                 for m, kw in [(compiled_ref, plain), (compiled_ref_cpp, plain),
                               *[(compiled, kw) for kw in extra.values()]]]  # fmt: skip
    # warm-up: first calls pay one-time costs (allocator, lazy imports, compilation) that must not land on
    # one method
    for model, kw, ids, n in tqdm(warm, desc="warm-up", disable=not progress):
        warm_up(model, ids, max_new_tokens=n, **kw)
    names = [*baselines, *methods]
    secs = {m: [] for m in names}  # per prompt
    accepted = {m: [] for m in methods}
    tokens = 0
    for i, ids in enumerate(tqdm(prompts, desc="prompts", disable=not progress)):
        best = dict.fromkeys(names, float("inf"))
        steps = {}
        for _ in range(max(1, getattr(args, "repeats", 1))):
            want = None
            for name, model in baselines.items():
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
                best[name] = min(best[name], time.perf_counter() - t0)
                if want is None:
                    want = out
                else:
                    _same_as_hf(name, out, want, i)
            for name, (model, kw) in methods.items():
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True, **kw)
                best[name] = min(best[name], time.perf_counter() - t0)
                _same_as_hf(name, out.sequences, want, i)
                steps[name] = out.spec_stats["mean_accepted_per_step"]
        for name in methods:
            accepted[name].append(steps[name])
        tokens += want.shape[1] - ids.shape[1]
        for name in names:
            secs[name].append(best[name])
    return _summary(secs, accepted, tokens, prompts, args, prompt_set)


def _chosen(name: str, args: argparse.Namespace) -> bool:
    """Whether `--methods` (exact names; default all) selects the method `name` (ssmspec's own plain decoding
    always runs: it is one of the plain decoders)."""
    wanted = getattr(args, "methods", None)
    return not wanted or name.startswith("ssmspec autoregressive") or name in wanted


def _summary(secs, accepted, tokens, prompts, args, prompt_set) -> dict:
    what = PROMPT_SETS[prompt_set]
    setup = (f"embedded mamba2-target, CPU {torch.get_num_threads()} threads, float32, {len(prompts)} {what} "
             f"prompts x {args.max_new_tokens} new tokens, {tokens} generated tokens; "
             "all outputs identical to HF greedy")  # fmt: skip
    result = {"setup": setup, "prompt_set": prompt_set, "tokens": tokens, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "methods": {}}  # fmt: skip
    hf, ar = secs["HF greedy"], secs.get("ssmspec autoregressive")
    best = min((name for name in BASELINES if name in secs), key=lambda name: sum(secs[name]))
    result["best_baseline"] = best
    for name, times in secs.items():
        row = {"tokens_per_s": tokens / sum(times), "speedup_vs_hf": sum(hf) / sum(times),
               "speedup_vs_best_baseline": sum(secs[best]) / sum(times)}  # fmt: skip
        if name in accepted:
            row["mean_accepted_per_step"] = sum(accepted[name]) / len(accepted[name])
            row["speedup_vs_ssmspec_ar"] = sum(ar) / sum(times)
            row["worst_prompt_speedup_vs_hf"] = min(h / t for h, t in zip(hf, times))
        result["methods"][name] = row
    return result


def run_sampling(args: argparse.Namespace, progress: bool = True) -> dict:
    """Speculative sampling side by side with HF's sampling, per temperature: tokens/s, speed-up and accepted
    tokens per step for chain / tree x n-gram / draft model. Outputs are random, so they are not compared
    here (tests/speculate/test_sampling.py proves the distributions equal); every method samples with HF's
    default warpers (top-k 50) and top-p `args.top_p` at the same temperature and seeds."""
    ref, tok = models.load("mamba2-target")
    target = ssmspec.transform(copy.deepcopy(ref))
    draft, _ = models.load("mamba2-draft")
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens)
    k, budget = args.draft_tokens, args.tree_budget
    spec = functools.partial(ssmspec.SpecConfig, drafter="prompt_lookup", tree=False, adaptive=False)  # as greedy
    head = functools.partial(ssmspec.SpecConfig, drafter="draft_head", adaptive=True)
    methods = {
        DEFAULT: {},
        "ssmspec default without a draft head": dict(speculation=ssmspec.SpecConfig(drafter="prompt_lookup")),
        "tree draft head + n-gram": dict(speculation=head(num_draft_tokens=4, tree_budget=12)),
        "chain draft head": dict(speculation=head(num_draft_tokens=4, tree=False)),
        "ssmspec autoregressive": dict(speculation=spec(drafter="none")),
        "chain n-gram": dict(speculation=spec(num_draft_tokens=k)),
        "tree n-gram": dict(speculation=spec(num_draft_tokens=k, tree=True, tree_budget=budget)),
        "tree n-gram adaptive": dict(speculation=spec(num_draft_tokens=k, tree=True, tree_budget=budget,
                                                      adaptive=True)),
        DRAFT_DEFAULT: dict(assistant_model=draft),
        "chain draft model": dict(assistant_model=draft, speculation=spec(drafter="draft_model", num_draft_tokens=4)),
        "tree draft model": dict(assistant_model=draft, speculation=spec(drafter="draft_model", num_draft_tokens=4,
                                                                         tree=True, tree_budget=12)),
    }  # fmt: skip
    methods = {name: kw for name, kw in methods.items() if _chosen(name, args)}
    warp = {"do_sample": True, "top_p": args.top_p}
    ref.generate(prompts[0], max_new_tokens=8, **warp)
    for kw in methods.values():
        target.generate(prompts[0], max_new_tokens=8, **warp, **kw)
    result = {"setup": f"embedded mamba2-target, CPU {torch.get_num_threads()} threads, float32, {len(prompts)} "
              f"held-out prompts x {args.max_new_tokens} new tokens, do_sample=True (top-k 50, top-p "
              f"{args.top_p}), seeded",
              "temperatures": {}}  # fmt: skip
    for temperature in args.temperatures:
        secs = {"HF sampling": 0.0, **dict.fromkeys(methods, 0.0)}
        made = dict.fromkeys(secs, 0)
        accepted = {m: [] for m in methods}
        for i, ids in enumerate(tqdm(prompts, desc=f"T={temperature}", disable=not progress)):
            torch.manual_seed(i)
            t0 = time.perf_counter()
            out = ref.generate(ids, max_new_tokens=args.max_new_tokens, temperature=temperature, **warp)
            secs["HF sampling"] += time.perf_counter() - t0
            made["HF sampling"] += out.shape[1] - ids.shape[1]
            for name, kw in methods.items():
                gen = torch.Generator().manual_seed(i)
                t0 = time.perf_counter()
                out = target.generate(ids, max_new_tokens=args.max_new_tokens, temperature=temperature, **warp,
                                      generator=gen, return_dict_in_generate=True, **kw)  # fmt: skip
                secs[name] += time.perf_counter() - t0
                made[name] += out.sequences.shape[1] - ids.shape[1]
                accepted[name].append(out.spec_stats["mean_accepted_per_step"])
        base = made["HF sampling"] / secs["HF sampling"]
        rows = {}
        for name in secs:
            rate = made[name] / secs[name]
            rows[name] = {"tokens_per_s": rate, "speedup_vs_hf": rate / base}
            if name in accepted:
                rows[name]["mean_accepted_per_step"] = sum(accepted[name]) / len(accepted[name])
        result["temperatures"][str(temperature)] = rows
    result["rows"] = [{"temperature": t, "method": name, **row} for t, rows in result["temperatures"].items()
                      for name, row in rows.items()]  # fmt: skip
    return result


def report_sampling(result: dict) -> None:
    """Print the sampling tables."""
    print(result["setup"])
    for temperature, rows in result["temperatures"].items():
        print(f"temperature {temperature}")
        print(f"{'method':>24} {'tok/s':>8} {'vs HF':>6} {'accepted/step':>14}")
        for name, row in rows.items():
            print(f"{name:>24} {row['tokens_per_s']:>8.1f} {row['speedup_vs_hf']:>6.2f} "
                  f"{row.get('mean_accepted_per_step', float('nan')):>14.2f}")  # fmt: skip


def batch_prompts(
    tok, count: int, prompt_tokens: int, stride: int = 400, prompt_set: str = "held-out"
) -> list[torch.Tensor]:
    """`count` different prompts of `prompt_tokens` tokens from a prompt set (`held_out_prompts`'): windows `stride`
    tokens apart in its texts, taken round robin over the texts (a batch mixes files), each window once, the same on
    every machine; "random": seeded random non-special tokens."""
    if prompt_set == "random":
        return [p[0] for p in held_out_prompts(tok, count, prompt_tokens, "random")]
    windows: list[list[torch.Tensor]] = []
    for text in prompt_texts(prompt_set):
        ids = tok(text, return_tensors="pt")["input_ids"][0]
        windows.append([ids[s : s + prompt_tokens] for s in range(0, ids.shape[0] - prompt_tokens + 1, stride)])
    out, seen = [], set()
    for k in range(max(map(len, windows), default=0)):
        for w in windows:  # a window met before (a licence header several files open with) is left out
            if k < len(w) and (key := tuple(w[k].tolist())) not in seen:
                seen.add(key)
                out.append(w[k])
    if len(out) < count:
        raise ValueError(f"the {PROMPT_SETS[prompt_set]} texts hold {len(out)} windows of {prompt_tokens} tokens, "
                         f"not {count}")  # fmt: skip
    return out[:count]


def run_batched(args: argparse.Namespace, progress: bool = True) -> dict:
    """Batched throughput: for each batch size, a batch of different held-out prompts generated by HF greedy
    (batched: one forward a token for all rows) and by ssmspec's default call (speculative, adaptive: it backs off to
    plain decoding where speculating measured slower) and its plain decoding; generated tokens per second, best of
    `args.repeats` (every other repeat in reverse order), every output asserted identical to HF's. With
    `args.compiled`, also HF greedy on a compiled model and ssmspec's default and plain decoding on a target compiled
    with the ssmspec backend (each batch size warmed up first); "vs best plain" is against the fastest plain decoder,
    compiled ones included."""
    device = torch.device(getattr(args, "device", None) or "cpu")
    ref, tok = models.load("mamba2-target")
    ref = ref.to(device)
    target = ssmspec.transform(copy.deepcopy(ref))
    prompt_set = getattr(args, "prompt_set", "held-out")
    prompts = batch_prompts(tok, max(args.batch), args.prompt_tokens, prompt_set=prompt_set)
    plain = {"do_sample": False}
    runs = {"HF greedy": (ref, plain), DEFAULT: (target, {}),
            "ssmspec autoregressive": (target, dict(speculation=ssmspec.SpecConfig(drafter="none")))}  # fmt: skip
    if getattr(args, "compiled", False):
        compiled_ref = copy.deepcopy(ref)
        compiled_ref.compile(options=COMPILE_OPTIONS)
        compiled = ssmspec.transform(copy.deepcopy(ref))
        compiled.compile(backend="ssmspec", options=COMPILE_OPTIONS)
        runs["HF greedy (compiled)"] = (compiled_ref, plain)
        runs[f"{DEFAULT} (compiled)"] = (compiled, {})
        # ssmspec's own plain decoding, compiled: the best plain decoder where the default is compiled
        runs["ssmspec autoregressive (compiled)"] = (compiled, dict(speculation=ssmspec.SpecConfig(drafter="none")))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {torch.get_num_threads()} threads"
    setup = (f"embedded mamba2-target, {where}, float32, batches of different {PROMPT_SETS[prompt_set]} prompts x "
             f"{args.prompt_tokens} tokens, {args.max_new_tokens} new tokens per row, best of {args.repeats}; all "
             "outputs identical to HF greedy batched")  # fmt: skip
    result = {"setup": setup, "batches": {}}
    result["best_plain"] = {}  # per batch size: the faster of HF's and ssmspec's own plain decoding
    for batch in tqdm(args.batch, desc="batch sizes", disable=not progress):
        ids = torch.stack(prompts[:batch]).to(device)
        for model, kw in runs.values():  # warm-up: the calibration and compiled graphs of this batch size
            warm_up(model, ids, max_new_tokens=args.max_new_tokens, **kw)
        best = dict.fromkeys(runs, float("inf"))
        accepted = {}
        want = None
        for repeat in range(max(1, args.repeats)):
            # side by side, every repeat, every other one in reverse: in one fixed order the default always ran right
            # after HF's generate and before ssmspec's plain decoding, and at batch 32, where it decodes plainly, it
            # measured 0.94-0.96x ssmspec's plain decoding (alternated: 0.997x)
            order = list(runs.items()) if repeat % 2 == 0 else list(runs.items())[::-1]
            for name, (model, kw) in order:
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True, **kw)
                best[name] = min(best[name], time.perf_counter() - t0)
                want = out.sequences if want is None else want
                if not torch.equal(out.sequences, want):
                    raise AssertionError(f"{name}: output differs from HF greedy at batch {batch}")
                if getattr(out, "spec_stats", None):
                    accepted[name] = out.spec_stats["mean_accepted_per_step"]
        tokens = generated_tokens(want[:, ids.shape[1] :], ref.generation_config)
        # the best plain decoder a user has: HF's (eager, compiled) or ssmspec's own plain decoding
        decoders = [n for n in runs if n.startswith(("HF greedy", "ssmspec autoregressive"))]
        best_plain = min(decoders, key=best.__getitem__)
        plain_best = best[best_plain]
        rows = {}
        for name, secs in best.items():
            rows[name] = {"tokens_per_s": tokens / secs, "speedup_vs_hf": best["HF greedy"] / secs,
                          "speedup_vs_best_plain": plain_best / secs}  # fmt: skip
            if name in accepted:
                rows[name]["mean_accepted_per_step"] = accepted[name]
        result["batches"][str(batch)] = rows
        result["best_plain"][str(batch)] = best_plain
    return result


def generated_tokens(new: torch.Tensor, generation_config) -> int:
    """Tokens a batch really generated: each row's new tokens up to and including its first EOS (HF pads a row
    that stopped early)."""
    from ssmspec.speculate.engine import eos_and_pad

    eos, _ = eos_and_pad(generation_config)
    total = 0
    for row in new.tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), len(row) - 1)
        total += stop + 1
    return total


def command_line() -> str:
    """The command this process was started with, as a user would type it (`ssmspec ...` or `python FILE ...`)."""
    import shlex
    import sys

    program = Path(sys.argv[0])
    head = ["ssmspec"] if program.name == "ssmspec" else ["python", _relative(program)]
    return shlex.join([*head, *sys.argv[1:]])


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def provenance(command: str | None = None) -> dict[str, str]:
    """How a data file was measured: date, machine, threads, torch / transformers / ssmspec versions, the code
    revision (git, where the code is a checkout) and the command (this process's own unless given)."""
    import subprocess
    from datetime import date

    import transformers

    from ssmspec._version import __version__
    from ssmspec.speculate.calibration import _cpu_name

    git = ["git", "-C", str(Path(__file__).parent.parent)]
    try:
        revision = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        changed = subprocess.run([*git, "status", "--porcelain", "--", "ssmspec", "benchmarks"], capture_output=True,
                                 text=True).stdout.strip()  # fmt: skip
    except OSError:
        revision, changed = "", ""
    revision += "+uncommitted" if revision and changed else ""
    return {"date": date.today().isoformat(), "machine": _cpu_name(), "threads": str(torch.get_num_threads()),
            "torch": torch.__version__, "transformers": transformers.__version__, "ssmspec": __version__,
            "revision": revision or f"ssmspec {__version__}", "command": command or command_line()}  # fmt: skip


def write_json(result: dict, path: str | Path) -> None:
    """Write a benchmark's result to `path` with its provenance (kept where the result already records it)."""
    Path(path).write_text(json.dumps({**provenance(), **result}, indent=2) + "\n")


def report_batched(result: dict, args: argparse.Namespace) -> None:
    """Print the batched-throughput table; write JSON when asked."""
    print(result["setup"])
    print(f"{'batch':>5} {'method':>34} {'tok/s':>8} {'vs HF':>6} {'vs best plain':>13} {'accepted/step':>14}")
    for batch, rows in result["batches"].items():
        for name, row in rows.items():
            print(
                f"{batch:>5} {name:>34} {row['tokens_per_s']:>8.1f} {row['speedup_vs_hf']:>6.2f} "
                f"{row['speedup_vs_best_plain']:>13.2f} {row.get('mean_accepted_per_step', float('nan')):>14.2f}"
            )
    print("best plain decoding:", ", ".join(f"batch {b}: {name}" for b, name in result["best_plain"].items()))
    if args.json:
        write_json(result, args.json)


# the options only one mode of the benchmark reads: batched throughput (--batch) or the per-prompt methods
_PER_PROMPT_ONLY = ("prompts", "draft_tokens", "tree_budget", "methods", "sampling", "temperatures", "top_p")
_BATCHED_ONLY = ("device",)


def unused_options(args: argparse.Namespace) -> list[str]:
    """The options set away from their defaults that the mode `args` asks for does not read (`--batch` times HF
    greedy, the default call and plain decoding on a batch of prompts; without it, the methods on one prompt at a
    time): a benchmark must not run while quietly ignoring one."""
    defaults = vars(add_arguments(argparse.ArgumentParser()).parse_args([]))
    ignored = _PER_PROMPT_ONLY if getattr(args, "batch", None) else _BATCHED_ONLY
    return [f"--{name.replace('_', '-')}" for name in ignored if getattr(args, name, defaults[name]) != defaults[name]]


def refuse_unused_options(args: argparse.Namespace) -> None:
    """ValueError naming the options the mode `args` asks for does not read (`unused_options`), if any."""
    unused = unused_options(args)
    if unused:
        mode = (
            "batched throughput (--batch)" if getattr(args, "batch", None) else "the per-prompt benchmark (no --batch)"
        )
        raise ValueError(f"{', '.join(unused)} not used by {mode}")


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1 (anything else is a usage error naming the value, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark's options (shared by the script and the `ssmspec bench` command)."""
    p.add_argument("--prompts", type=positive, default=12, help="held-out files to use (12: all of them)")
    p.add_argument("--prompt-tokens", type=positive, default=96)
    p.add_argument("--max-new-tokens", type=positive, default=128)
    p.add_argument("--draft-tokens", type=positive, default=8)
    p.add_argument("--tree-budget", type=positive, default=16)
    p.add_argument(
        "--prompt-set",
        choices=list(PROMPT_SETS),
        default="held-out",
        help="held-out standard-library files, installed third-party packages' sources, their descriptions "
        "(prose), or random tokens (the last two: where drafts are rarely accepted)",
    )
    p.add_argument("--repeats", type=positive, default=1, help="time each prompt and method this often, keep the best")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="also time compiled models: HF greedy after model.compile(), ssmspec with the ssmspec backend",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        help="time only these speculative methods (their row names; the plain decoders always run)",
    )
    p.add_argument("--sampling", action="store_true", help="also benchmark speculative sampling vs HF sampling")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling for every sampling method (1.0: off)")
    p.add_argument("--json", help="also write the results to this file (JSON)")
    p.add_argument(
        "--batch",
        type=positive,
        nargs="+",
        help="batched throughput instead: batches of this many different held-out prompts, HF greedy batched vs "
        "ssmspec's default (e.g. --batch 1 4 8 16 32)",
    )
    p.add_argument("--device", default="cpu", help="batched throughput: where the models run (cpu, cuda, cuda:1)")
    return p


def report(result: dict, args: argparse.Namespace) -> None:
    """Print the table; write JSON when asked."""
    print(result["setup"])
    best = result["best_baseline"]
    for name in (DEFAULT, f"{DEFAULT} (compiled)", DRAFT_DEFAULT):
        if name in result["methods"]:
            row = result["methods"][name]
            print(f"{name}: {row['speedup_vs_hf']:.2f}x HF greedy, {row['speedup_vs_best_baseline']:.2f}x the best "
                  f"plain decoder ({best})")  # fmt: skip
    print(f"best plain decoding: {best}")
    print(f"{'method':>42} {'tok/s':>8} {'vs HF':>6} {'vs best':>7} {'vs AR':>6} {'accepted/step':>14} "
          f"{'worst prompt':>13}")  # fmt: skip
    for name, row in result["methods"].items():
        print(f"{name:>42} {row['tokens_per_s']:>8.1f} {row['speedup_vs_hf']:>6.2f} "
              f"{row['speedup_vs_best_baseline']:>7.2f} {row.get('speedup_vs_ssmspec_ar', float('nan')):>6.2f} "
              f"{row.get('mean_accepted_per_step', float('nan')):>14.2f} "
              f"{row.get('worst_prompt_speedup_vs_hf', float('nan')):>13.2f}")  # fmt: skip
    if "sampling" in result:
        report_sampling(result["sampling"])
    if args.json:
        write_json(result, args.json)
