"""MkDocs hook: the generated parts of the docs, rendered at build time from the code and from docs/data.

Directives (an HTML comment, replaced by markdown when the page is built):

- `<!-- ssmspec:families -->`, `<!-- ssmspec:family-details -->`, `<!-- ssmspec:families-table -->`: the supported
  families, from the report the property suite wrote (docs/data/families.json, refreshed by scripts/docs-data.sh;
  the build fails if it is missing or does not cover exactly the families the code supports), the generic path's
  probes and the error `ssmspec.transform` raises for each refused family (computed now, on tiny models).
- `<!-- ssmspec:settings -->`: every generation setting, applied / no effect / refused, from ssmspec.hf.generation.
- `<!-- ssmspec:limitations -->`: what is refused and why, from the code's own lists.
- `<!-- ssmspec:spec-config -->`: SpecConfig's fields, defaults and documentation, from the class itself.
- `<!-- ssmspec:spec-stats -->`: the keys of `out.spec_stats`, from ssmspec.speculate.engine.SpecStats.
- `<!-- ssmspec:cli -->`: the `ssmspec` command's help, from its argument parser.
- `<!-- ssmspec:embedded-models -->`: the models shipped in the package, from ssmspec/models/report.json.
- `<!-- ssmspec:model-size -->`: docs/data/model_size.json (benchmarks/model_size.py) as a table;
  `<!-- ssmspec:plot model-size -->` and `<!-- ssmspec:plot cost-curves -->` draw it.
- `<!-- ssmspec:gpu -->`: docs/data/gpu.json (written by benchmarks/gpu.py).
- `<!-- ssmspec:bench NAME -->`: a table of docs/data/NAME.json, with what the file records of its machine, date,
  command and code revision. `<!-- ssmspec:batched NAME -->`: a batched-throughput file as one row per batch size.
  `<!-- ssmspec:batched-gpu -->`: docs/data/batched_gpu.json, one row per run.
- `<!-- ssmspec:speed-summary -->`: the table of measured speed-ups the README holds too (`SPEED_SUMMARY`).
- `<!-- ssmspec:plot KIND [ARGS] -->`: an SVG plot drawn from docs/data (`_PLOTS`): no image is committed.
- Math: `$$ ... $$` blocks (each delimiter on its own line) become MathML at build time (latex2mathml).

Numbers in prose come from data too: `{{ FILE: PATH | FORMAT }}` is replaced by the value at PATH in
docs/data/FILE.json. PATH is `/`-separated: dict keys (spaces allowed), list indices, `*` (every value), and
`[key=value]` (the list elements whose `key` is `value`; `@last`: the last element's). A path that selects several
values renders their range (`1.34–1.63x`). FORMAT: `x` (two decimals and "x"), `x1` (one decimal), `pct` (a
fraction as a percentage), `int` (thousands separated), or a Python format spec. `{{ code: module.attr.path }}`
renders a value of the code (a default, a constant). A path that the data does not hold fails the build.

The figure rule (`hand_typed_figures`): outside code, placeholders and directives, a page may not type a speed or
time figure itself: a number directly followed by `x` or `×` (`1.9x`), or by a unit of speed or time (`480 tok/s`,
`tokens/s`, `tokens per second`, `ms`, `µs`, `us`, `s`, `seconds`, `minutes`). Such a figure drifts from the
measurement it came from; cite it with a placeholder (or a table or plot) instead. The build also fails on a page
longer than `MAX_PAGE_WORDS` words of source and on words about the project's own history (`HISTORY`); the README
is held to the same rules (`check_readme`, run before every build), with `MAX_README_WORDS`.
"""

from __future__ import annotations

import functools
import html
import importlib
import importlib.util
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"
README = ROOT / "README.md"
MAX_PAGE_WORDS = 2500
MAX_README_WORDS = 1000
# the project's own history has no place in the docs: they state what the code does and what was measured
HISTORY = re.compile(
    r"sto[p] [0-9]+|sess[i]on|len[t] |devic[e] call|cal[l] limit|call[s]? (?:was |were )?stopped", re.I
)  # (bracketed: this line is no match itself)

_DIRECTIVE = re.compile(r"<!-- ssmspec:([\w-]+)(?: (.*?))? -->")
_PLACEHOLDER = re.compile(r"\{\{\s*([\w.-]+)\s*:\s*(.+?)\s*(?:\|\s*([^}|]*?)\s*)?\}\}")
_DISPLAY_MATH = re.compile(r"^\$\$\n(.+?)\n\$\$$", re.S | re.M)
_FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,})[^\n]*\n.*?^\1\2[ \t]*$", re.S | re.M)
_FIGURE = re.compile(
    r"(?<![\w.])\d(?:[\d,]*\d)?(?:\.\d+)?"  # a number
    r"(?:[x×](?!\w)"  # directly followed by x: a speed-up
    r"|\s?(?:tok(?:en)?s?/s|tokens per second|ms|µs|us|s|seconds|minutes)(?![\w/]))"  # or a unit of speed or time
)


# ---------------------------------------------------------------------------------------------- data and figures


@functools.cache
def load(name: str) -> dict:
    """docs/data/NAME.json (NAME with or without `.json`)."""
    path = DATA / (name if name.endswith(".json") else f"{name}.json")
    if not path.exists():
        raise ValueError(f"docs/data/{path.name} does not exist: run the benchmark that writes it")
    return json.loads(path.read_text())


def lookup(data, path: str, where: str = ""):
    """The value at `path` in `data` (see the module docstring); a list where the path selects several."""
    return _walk(data, [s.strip() for s in path.strip("/").split("/")], where or path)


def _walk(node, segments: list[str], where: str):
    if not segments:
        return node
    seg, rest = segments[0], segments[1:]
    if seg == "*" or (seg.startswith("[") and seg.endswith("]")):
        items = list(node.values()) if isinstance(node, dict) else node if isinstance(node, list) else None
        if items is None:
            raise ValueError(f"{where}: `{seg}` needs a list or a dict, found {type(node).__name__}")
        if seg != "*":
            conds = [c.split("=", 1) for c in seg[1:-1].split(",")]
            for key, value in conds:
                if value == "@last":
                    value = str(items[-1].get(key)) if items else ""
                items = [i for i in items if isinstance(i, dict) and str(i.get(key)) == value]
        if not items:
            raise ValueError(f"{where}: `{seg}` selects nothing")
        nested = any(s == "*" or (s.startswith("[") and s.endswith("]")) for s in rest)
        out = []
        for item in items:
            got = _walk(item, rest, where)
            out += got if nested and isinstance(got, list) else [got]  # one flat list however many selectors
        return out
    if isinstance(node, list) and re.fullmatch(r"-?\d+", seg):
        try:
            return _walk(node[int(seg)], rest, where)
        except IndexError:
            raise ValueError(f"{where}: no element {seg}") from None
    if not isinstance(node, dict) or seg not in node:
        keys = ", ".join(map(str, node)) if isinstance(node, dict) else type(node).__name__
        raise ValueError(f"{where}: no `{seg}` (there: {keys[:300]})")
    return _walk(node[seg], rest, where)


_SUFFIXED = {"x": (".2f", "x", 1.0), "x1": (".1f", "x", 1.0), "pct": (".0f", " %", 100.0), "int": (",.0f", "", 1.0)}


def fmt(value, spec: str = "") -> str:
    """A value as the docs show it; a list of numbers as its range."""
    numspec, suffix, scale = _SUFFIXED.get(spec, (spec, "", 1.0))

    def one(v) -> str:
        if v is None:
            return "not measured"
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return str(v)
        if not numspec:
            return f"{v:.2f}" if isinstance(v, float) else str(v)
        return format(v * scale, numspec)

    if isinstance(value, list):
        nums = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(nums) != len(value) or not nums:
            return ", ".join(one(v) for v in value) + suffix
        lo, hi = one(min(nums)), one(max(nums))
        return (lo if lo == hi else f"{lo}–{hi}") + suffix
    return one(value) + (suffix if isinstance(value, (int, float)) and not isinstance(value, bool) else "")


def _code_value(path: str):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ValueError(f"{{{{ code: {path} }}}}: no such module")


def placeholder(source: str, path: str, spec: str | None = None) -> str:
    """What `{{ source: path | spec }}` renders."""
    if source == "code":
        sys.path.insert(0, str(ROOT))
        value = _code_value(path)
        if value is None:  # (a page would show a blank where a value belongs: a setting resolved elsewhere)
            raise ValueError(f"{{{{ code: {path} }}}} is None: render the value the code resolves it to")
        return fmt(value, spec or "")
    return fmt(lookup(load(source), path, f"{{{{ {source}: {path} }}}}"), spec or "")


def _outside_code(markdown: str, fn) -> str:
    """`fn` applied to the parts of `markdown` outside fenced code blocks."""
    out, last = [], 0
    for m in _FENCE.finditer(markdown):
        out += [fn(markdown[last : m.start()]), m.group(0)]
        last = m.end()
    return "".join(out + [fn(markdown[last:])])


def render_placeholders(markdown: str) -> str:
    return _outside_code(markdown, lambda text: _PLACEHOLDER.sub(lambda m: placeholder(*m.groups()), text))


def hand_typed_figures(markdown: str) -> list[str]:
    """The speed or time figures a page types itself (the figure rule, module docstring), each with its context."""
    text = _FENCE.sub("", markdown)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = _PLACEHOLDER.sub("", text)
    text = _DISPLAY_MATH.sub("", text)
    text = re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)  # inline code
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    found = []
    for m in _FIGURE.finditer(text):
        a, b = max(0, m.start() - 40), min(len(text), m.end() + 20)
        found.append(" ".join(text[a:b].split()))
    return found


def history_words(text: str) -> list[str]:
    return [" ".join(text[max(0, m.start() - 40) : m.end() + 30].split()) for m in HISTORY.finditer(text)]


def words(markdown: str) -> int:
    return len(markdown.split())


def check_page(markdown: str, name: str, length: int | None = None) -> None:
    """The rules every page is held to (module docstring); raises naming what breaks them. `length`: the words to
    count, where not those of `markdown`."""
    problems = []
    figures = hand_typed_figures(markdown)
    if figures:
        problems.append("hand-typed speed figures (cite docs/data with {{ FILE: PATH | FORMAT }}): " + "; ".join(
            f"«{f}»" for f in figures))  # fmt: skip
    history = history_words(markdown)
    if history:
        problems.append("words about the project's history: " + "; ".join(f"«{h}»" for h in history))
    n = words(markdown) if length is None else length
    limit = MAX_README_WORDS if name == "README.md" else MAX_PAGE_WORDS
    if n > limit:
        problems.append(f"{n} words, more than {limit}: split the page")
    if problems:
        raise ValueError(f"{name}: " + " | ".join(problems))


# ----------------------------------------------------------------------------------------------------- provenance


def machine(data: dict) -> str:
    """The machine a data file says it was measured on (its GPU where it ran on one)."""
    device = str(data.get("device") or "")
    named = device if device.startswith("NVIDIA") else data.get("machine") or device
    setup = " ".join(str(data.get(k, "")) for k in ("setup", "model"))
    found = re.search(r"(NVIDIA [^,;]+|CPU(?:,? \d+ threads?)?)", setup)
    hw = found.group(1).replace("CPU 2", "CPU, 2") if found else ""
    if named:
        named = str(named).split(", ")[0]
        return f"{named}, {hw}" if hw and hw not in named and not hw.startswith("NVIDIA") else named
    return hw or "machine not recorded"


@functools.cache
def _registry():
    """benchmarks/all.py: each data file's command, cut-off revision and the hardware it needs."""
    spec = importlib.util.spec_from_file_location("ssmspec_benchmarks_all", ROOT / "benchmarks" / "all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def check_data() -> None:
    """Every file in docs/data is listed in benchmarks/all.py and records its provenance, and was measured on code
    that includes its cut-off; a file only a CUDA GPU can measure may be older (its pages say so)."""
    registry = _registry()
    problems = []
    for path in sorted(DATA.glob("*.json")):
        entry = registry.FILES.get(path.stem)
        lacking = registry.missing(path.stem) if entry is not None else []
        if entry is None:
            problems.append(f"{path.name}: not listed in benchmarks/all.py (its command and cut-off)")
        elif lacking:
            problems.append(f"{path.name}: records no {', '.join(lacking)} (rerun `{entry.command}`)")
        elif entry.needs != "cuda" and registry.older_than_cutoff(path.stem, registry.recorded(path.stem)):
            problems.append(f"{path.name}: measured on code older than {entry.cutoff}, the last change to {entry.why} "
                            f"(rerun `python benchmarks/all.py --only {path.stem}`)")  # fmt: skip
    if problems:
        raise ValueError("docs/data: " + "; ".join(problems))


def provenance(name: str, data: dict | None = None) -> str:
    """What docs/data/NAME.json records of how it was measured; 'not recorded' for what it does not."""
    data = data if data is not None else load(name)
    data = data.get("_provenance", data)  # families.json: the report's families, its provenance aside
    parts = [f"`docs/data/{name}.json`", machine(data), data.get("date") or "date not recorded"]
    if data.get("torch"):
        parts.append(f"torch {data['torch']}, transformers {data.get('transformers', 'not recorded')}")
    if data.get("command"):
        parts.append(f"`{data['command']}`")
    if data.get("revision"):
        parts.append(f"revision `{data['revision']}`")
    entry = _registry().FILES.get(name)
    if entry is not None and data.get("revision") and _registry().older_than_cutoff(name, data):
        parts.append(f"**measured on code older than `{entry.cutoff}`, the last change to {entry.why}: rerunning it "
                     f"needs {'a CUDA GPU' if entry.needs == 'cuda' else entry.needs}**")  # fmt: skip
    return ", ".join(parts)


def _source_line(names: list[str]) -> str:
    return "*Data: " + "; ".join(provenance(n) for n in names) + ".*\n"


# ------------------------------------------------------------------------------------------- the README's table

# the plain decoders a llama.cpp run times beside ssmspec (benchmarks/llamacpp.py): llama.cpp's among them, the
# fastest plain decoding a CPU user has (llama-bench times decoding alone: it has no whole-call rate)
LLAMACPP_PLAIN = ("HF generate", "ssmspec plain (eager)", "ssmspec plain (compiled)", "llama.cpp (Python bindings)",
                  "llama.cpp (llama-bench)")  # fmt: skip
# (what was measured, data file, path of the speed-up, its baseline, the speed-up over the fastest plain decoder
# measured in the same run: its path, or (the run's methods, the method, its plain decoders[, the rate compared]) where
# the file records only rates); every figure is the embedded 3M-parameter Mamba2 target on held-out Python files (a row
# naming the 19.6M medium model aside), outputs identical to HF's
SPEED_SUMMARY = (
    ("Default call, greedy (the draft head fused with n-grams)", "e2e_defaults",
     "methods/ssmspec default/speedup_vs_hf", "HF greedy", "methods/ssmspec default/speedup_vs_best_baseline"),
    ("Greedy, n-grams alone (`drafter=\"prompt_lookup\"`)", "e2e_defaults",
     "methods/ssmspec default without a draft head/speedup_vs_hf", "HF greedy",
     "methods/ssmspec default without a draft head/speedup_vs_best_baseline"),
    ("Default call, sampling at temperature 0.7 (the draft head)", "e2e_defaults",
     "sampling/temperatures/0.7/ssmspec default/speedup_vs_hf", "HF sampling",
     ("sampling/temperatures/0.7", "ssmspec default", ("HF sampling", "ssmspec autoregressive"))),
    ("Default call, sampling at temperature 1.0", "e2e_defaults",
     "sampling/temperatures/1.0/ssmspec default/speedup_vs_hf", "HF sampling",
     ("sampling/temperatures/1.0", "ssmspec default", ("HF sampling", "ssmspec autoregressive"))),
    ("Default call, batches of 1 to 32 prompts", "batched", "batches/*/ssmspec default/speedup_vs_hf",
     "HF greedy, batched", "batches/*/ssmspec default/speedup_vs_best_plain"),
    ("Default call, compiled (`transform(model, compile=True)`)", "llamacpp",
     "models/[model=mamba2-target]/rows/[method=ssmspec default (compiled)]/x_hf", "eager HF greedy",
     ("models/[model=mamba2-target]/rows", "ssmspec default (compiled)", LLAMACPP_PLAIN, "tokens_per_s")),
    ("Plain decoding, compiled, decoding rate", "llamacpp",
     "models/[model=mamba2-target]/rows/[method=ssmspec plain (compiled)]/x_llamacpp",
     "llama.cpp f32 (llama-bench)",
     ("models/[model=mamba2-target]/rows", "ssmspec plain (compiled)", LLAMACPP_PLAIN, "decode_tokens_per_s")),
    ("19.6M medium model: default call, compiled, decoding rate", "llamacpp_medium",
     "models/[model=nemotron-medium]/rows/[method=ssmspec default (compiled)]/x_llamacpp",
     "llama.cpp f32 (llama-bench)",
     ("models/[model=nemotron-medium]/rows", "ssmspec default (compiled)", LLAMACPP_PLAIN, "decode_tokens_per_s")),
    ("Default call on a GPU, batches of 1 to 32, eager (nothing compiled)", "batched_gpu",
     "runs/*/batches/*/ssmspec default/speedup_vs_hf", "HF greedy, eager",
     "runs/*/batches/*/ssmspec default/speedup_vs_best_plain"),
    ("Plain decoding on a GPU, compiled (captured steps)", "gpu_quick",
     "quick/rows/ssmspec plain (compiled)/speedup_vs_hf_compiled", "HF greedy, compiled",
     "quick/rows/ssmspec plain (compiled)/speedup_vs_best_plain"),
    ("Default call on a GPU, compiled", "gpu_quick",
     "quick/rows/ssmspec default (compiled)/speedup_vs_hf", "eager HF greedy",
     "quick/rows/ssmspec default (compiled)/speedup_vs_best_plain"),
)  # fmt: skip


def over_plain(data: dict, best):
    """The speed-up over the fastest plain decoder of the same run: at a path, or (where the file records only rates)
    a method's rate over the best of its plain decoders' (`best`: (the methods' path, the method, the plain decoders,
    optionally the rate: tokens_per_s where not given))."""
    if isinstance(best, str):
        return lookup(data, best)
    where, method, plains, *rate = best
    key = rate[0] if rate else "tokens_per_s"
    rates = lookup(data, where)
    if isinstance(rates, list):  # (rows naming their method, of the one run a selector found)
        (rows,) = [rates] if rates and isinstance(rates[0], dict) else rates
        rates = {row["method"]: row for row in rows}
    if key == "tokens_per_s":  # (a whole call's rate: a decoder timed on decoding alone has none)
        plains = [p for p in plains if p != "llama.cpp (llama-bench)"]
    return rates[method][key] / max(rates[p][key] for p in plains if p in rates)


def speed_summary() -> str:
    """The table of measured speed-ups (the README's, generated by scripts/readme.py, and the docs')."""
    lines = ["| measured | speed-up | over | over the fastest plain decoder | data: file, machine, date |",
             "|---|---|---|---|---|"]  # fmt: skip
    for what, name, path, base, best in SPEED_SUMMARY:
        data = load(name)
        cells = [what, f"**{fmt(lookup(data, path), 'x')}**", base, fmt(over_plain(data, best), "x")]
        source = f"`{name}.json`: {machine(data)}, {data.get('date') or 'date not recorded'}"
        if data.get("revision") and _registry().older_than_cutoff(name, data):
            source += ", **before its last change**"
        cells.append(source)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- families


def _family_report() -> dict:
    from ssmspec.testing import report
    from ssmspec.testing.configs import SUPPORTED_FAMILIES

    path = DATA / "families.json"
    if not path.exists():
        raise ValueError("docs/data/families.json is missing: run scripts/docs-data.sh (it runs the property suite)")
    data = report.load(path)
    stale = report.stale_families(data, SUPPORTED_FAMILIES)
    if stale:
        raise ValueError("docs/data/families.json is out of date (run scripts/docs-data.sh): " + "; ".join(stale))
    return data


@functools.cache
def _refused_families() -> list[tuple[str, str]]:
    from transformers.utils import logging as hf_logging

    from ssmspec.errors import UnsupportedModelError
    from ssmspec.testing.configs import UNSUPPORTED_FAMILIES, build_tiny_model
    from ssmspec.transform import transform

    hf_logging.set_verbosity_error()  # the refused families' tiny models would print HF's kernel fallbacks
    out = []
    for fam in UNSUPPORTED_FAMILIES:
        try:
            transform(build_tiny_model(fam))
        except UnsupportedModelError as exc:
            out.append((fam, f"`{exc.module_path}`: {exc.reason}"))
            continue
        raise ValueError(f"{fam} is listed as refused but transform accepts it: move it to the property suite")
    return out


@functools.cache
def _generic_families() -> list[tuple[str, str, str, str]]:
    """(family, HF class, why it has no seams, what is exact) for the families transform runs on the generic path."""
    from transformers.utils import logging as hf_logging

    from ssmspec.hf import tree_modules
    from ssmspec.testing.configs import GENERIC_FAMILIES, build_tiny_model
    from ssmspec.transform import transform

    hf_logging.set_verbosity_error()
    out = []
    for fam in GENERIC_FAMILIES:
        model = transform(build_tiny_model(fam))
        info = model.ssmspec_info
        if info.path != "generic":
            raise ValueError(f"{fam} is listed for the generic path but transform gave it {info.path!r}")
        forms = sorted({type(step.module).__name__ for step in tree_modules.installed(model)})
        shapes = f"trees (the tree form of `{'`, `'.join(forms)}`)" if info.trees else "chains"
        exact = f"{shapes}, batches (row by row)" if info.batches else f"{shapes}, one prompt at a time"
        out.append((fam, type(model).__name__, info.limits["seams"], exact))
    return out


_MEASURED = re.compile(r" by [\d.e+-]+ \(relative; tolerance [^)]*\)")


def _overview() -> str:
    """Every family of the pinned transformers with recurrent state: the path it verifies on and what is exact,
    from the property suite's report (seams), the generic probes (generic) and transform's errors (refused)."""
    from ssmspec.hf import mtp as hf_mtp
    from ssmspec.testing import report
    from ssmspec.testing.configs import SUPPORTED_FAMILIES
    from ssmspec.testing.mtp import MTP_FAMILIES

    def native(fam: str) -> str:  # the drafter the family's checkpoints ship (guides/mtp.md)
        return "MTP layer" if fam in MTP_FAMILIES else "MTP layer: refused" if fam in hf_mtp.REFUSED else "none shipped"

    data = _family_report()
    lines = ["| family | path | what verifies it | exact for | native drafter |", "|---|---|---|---|---|"]
    for fam in SUPPORTED_FAMILIES:
        seams = ", ".join(data[fam].get("seams", []))
        lines.append(f"| {fam} | seams | {seams} | {report._exact(data[fam])} | {native(fam)} |")
    for fam, _, _, exact in _generic_families():
        lines.append(f"| {fam} | generic | HF's own forward and cache (no kernel seam) | {exact} | {native(fam)} |")
    for fam, why in _refused_families():  # without the measured differences: the table states what, not how much
        lines.append(f"| {fam} | refused | {_cell(_MEASURED.sub('', why))} | nothing (refused) | {native(fam)} |")
    return "\n".join(lines) + "\n"


def families_line() -> str:
    """The README's one line on the supported families (scripts/readme.py writes it; the build checks it)."""
    from ssmspec.testing.configs import GENERIC_FAMILIES, SUPPORTED_FAMILIES, UNSUPPORTED_FAMILIES

    seams, generic, refused = (", ".join(f) for f in (SUPPORTED_FAMILIES, GENERIC_FAMILIES, UNSUPPORTED_FAMILIES))
    seam = "[kernel seams](docs/reference/glossary.md#kernel-seam)"
    return (f"{len(SUPPORTED_FAMILIES)} families through ssmspec's {seam} (trees and batches: {seams}), "
            f"{len(GENERIC_FAMILIES)} through Hugging Face's own forward ({generic}); refused, naming the module: "
            f"{refused}.\n")  # fmt: skip


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _families() -> str:
    from ssmspec.testing import report
    from ssmspec.testing.configs import SUPPORTED_FAMILIES

    data = _family_report()
    out = [report.families_markdown(data, SUPPORTED_FAMILIES), "",
           "Refused, with the error `ssmspec.transform` raises (computed while building these docs):", "",
           "| family | refused: the module and why |", "|---|---|"]  # fmt: skip
    out += [f"| {fam} | {_cell(msg)} |" for fam, msg in _refused_families()]
    out += ["", "Through the generic path (HF's own forward and cache: chains, trees where the model's recurrence "
            "module has a tree form; batches row by row where a second probe "
            "finds HF's batched loop equal to its rows run alone; the transform found no kernel seam and the generic "
            "probe found HF's multi-token forward exact; computed while building these docs; "
            "`tests/speculate/test_generic.py` holds them to HF greedy in float64):", "",
            "| family | class | why no seams | exact for |", "|---|---|---|---|"]  # fmt: skip
    out += [f"| {fam} | `{cls}` | {_cell(why)} | {exact} |" for fam, cls, why, exact in _generic_families()]
    return "\n".join(out) + "\n"


def _family_details() -> str:
    from ssmspec.testing import report
    from ssmspec.testing.configs import SUPPORTED_FAMILIES

    return report.family_details_markdown(_family_report(), SUPPORTED_FAMILIES)


# ------------------------------------------------------------------------------------------ reference from code


def _settings() -> str:
    from ssmspec.hf.generation import settings_table

    lines = ["| setting | speculative generate | note |", "|---|---|---|"]
    lines += [f"| `{name}` | {status} | {_cell(note)} |" for name, status, note in settings_table()]
    return "\n".join(lines) + "\n"


def _limitations() -> str:
    from ssmspec.hf.generation import settings_table
    from ssmspec.hf.layers import SUPPORTED_ATTENTION_TYPES

    refused = [(n, note) for n, status, note in settings_table() if status.startswith("refused")]
    lines = ["### Generation settings refused", "", "| setting | why |", "|---|---|"]
    lines += [f"| `{n}` | {_cell(note)} |" for n, note in refused]
    lines += ["", "### Model families refused", "", "| family | the module and why |", "|---|---|"]
    lines += [f"| {fam} | {_cell(msg)} |" for fam, msg in _refused_families()]
    lines += ["", "### Families on the generic path", "",
              "No kernel seam: HF's own forward verifies chains (see [Models without kernel seams]"
              "(../explanation/generic-path.md)), and trees only where the model's recurrence modules have tree "
              "forms; elsewhere `SpecConfig(tree=True)` is refused naming the path. A batch is verified row by row "
              "where HF's batched loop computes what its rows compute alone; a default call on a batch runs HF's "
              "own batched generate.", "", "| family | why no seams | exact for |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {fam} | {_cell(why)} | {exact} |" for fam, _, why, exact in _generic_families()]
    limited = [(fam, "; ".join(r["limits"])) for fam, r in sorted(_family_report().items()) if r.get("limits")]
    lines += ["", "### Supported, within limits the probe found", "", "| family | exact for |", "|---|---|"]
    lines += [f"| {fam} | {_cell(lim)} |" for fam, lim in limited]
    lines += ["", "### Attention", "",
              f"Cache layer types that take a tree mask: {', '.join(f'`{t}`' for t in SUPPORTED_ATTENTION_TYPES)}; "
              "attention implementations: `sdpa`, `eager`. Others (flash / flex attention, chunked or indexed sparse "
              "attention, sliding-window layers with different windows) are refused by `ssmspec.transform`, naming "
              "the layer."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _docstring_sections(doc: str) -> dict[str, str]:
    """A Google-style `Attributes:` section as {name: text}."""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return out
    indent, name = None, None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:
            break
        m = re.match(r"\s*(\w+): (.*)", line)
        if width == indent and m:
            name = m.group(1)
            out[name] = m.group(2)
        elif name:
            out[name] += " " + line.strip()
    return out


def _spec_config() -> str:
    import dataclasses

    from ssmspec.speculate.config import SpecConfig

    docs = _docstring_sections(SpecConfig.__doc__ or "")
    lines = ["| field | default | what it does |", "|---|---|---|"]
    for f in dataclasses.fields(SpecConfig):
        if f.name not in docs:
            raise ValueError(f"SpecConfig.{f.name} is not documented in the class's Attributes section")
        lines.append(f"| `{f.name}` | `{f.default!r}` | {_cell(docs[f.name])} |")
    return "\n".join(lines) + "\n"


# what each key of `out.spec_stats` means; the build fails where the code has a key this does not describe
_SPEC_STATS = {
    "verify_steps": "verify steps of the call (one forward each, all rows together)",
    "accepted_tokens": "drafted tokens the target accepted, summed over rows",
    "emitted_tokens": "tokens appended to the outputs: accepted drafts plus each step's own token, after EOS and "
    "length cuts",
    "tree_nodes_per_step": "per step, the nodes per row verified (the largest over rows): a list",
    "row_steps": "verify steps counted per active row",
    "near_ties": "emitted tokens whose two best logits were closer than `near_tie_tolerance`: where float32 or "
    "bfloat16 arithmetic may pick the other token (never in float64)",
    "near_tie_tolerance": "the gap, relative to max(1, |top logit|), below which a token counts as a near-tie",
    "max_verify_bytes": "the largest verify step's buffers (replay records or node states, tree K/V), all rows",
    "out_of_memory": "verify steps that ran out of memory and were retried with a smaller tree",
    "calibration_seconds": "seconds this call spent measuring the model's verify costs",
    "calibrated": "whether the model's calibration is complete for this batch size and device after the call",
    "drafter": "the drafter's own counters: drafting ahead's `hit_rate`, `saved_s`, `waited_s`, `thread_s`; RASD's "
    "`pruned`; ...",
    "mean_accepted_per_step": "tokens gained per verify step and row: accepted drafts plus the step's own token",
    "path": '"seams" or "generic": which path verified',
}


def _spec_stats() -> str:
    import dataclasses

    from ssmspec.speculate.engine import SpecStats

    keys = [f.name for f in dataclasses.fields(SpecStats)] + ["mean_accepted_per_step", "path"]
    missing = [k for k in keys if k not in _SPEC_STATS]
    if missing:
        raise ValueError(f"spec_stats keys not described in docs/hooks.py _SPEC_STATS: {missing}")
    stale = [k for k in _SPEC_STATS if k not in keys]
    if stale:
        raise ValueError(f"docs/hooks.py _SPEC_STATS describes keys the code no longer has: {stale}")
    lines = ["| key | what |", "|---|---|"] + [f"| `{k}` | {_cell(_SPEC_STATS[k])} |" for k in keys]
    return "\n".join(lines) + "\n"


def _embedded_models() -> str:
    from ssmspec import models

    report = models.report()
    about = {
        "mamba2-target": "Mamba2, the default target (ships a draft head)",
        "mamba2-draft": "Mamba2 draft model, the same tokenizer",
        "bamba-hybrid": "Bamba (Mamba2 + attention)",
        "nemotron-mtp": "Nemotron-H (Mamba2 + attention + MLP), its checkpoint shipping an MTP layer",
        "nemotron-medium": "Nemotron-H with an MTP layer and a draft head, sized so that a decode step reads its "
        "weights from memory (trained on the whole standard library)",
    }
    lines = ["| name | what | parameters | held-out bits per byte | where |", "|---|---|---|---|---|"]
    for name in models.NAMES:
        r = report.get(name, {})
        where = "the wheel" if name in models.EMBEDDED else "the source repository (not the wheel)"
        lines.append(f"| `{name}` | {about.get(name, '')} | {r.get('params', 0) / 1e6:.2f}M | "
                     f"{fmt(r.get('held_out_bits_per_byte'))} | {where} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _cli() -> str:
    from ssmspec.cli import build_parser

    os.environ["COLUMNS"] = "100"  # the same wrapping on every machine
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")  # argparse internals
    out = ["```text", parser.format_help().rstrip(), "```"]
    for name, p in sub.choices.items():
        out += ["", f"### `ssmspec {name}`", "", "```text", p.format_help().rstrip(), "```"]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------------- data tables


def _gpu() -> str:
    path = DATA / "gpu.json"
    if not path.exists():
        return ("**No GPU measurements.** `docs/data/gpu.json` does not exist: `python benchmarks/gpu.py` on a "
                "CUDA machine writes it, and this page then shows its numbers.\n")  # fmt: skip
    data = json.loads(path.read_text())
    lines = [f"*Data: `docs/data/gpu.json`, {data['device']}, torch {data['torch']}, "
             f"{data.get('date') or 'date not recorded'}.*"]  # fmt: skip
    kernels = data.get("kernels")
    if isinstance(kernels, list) and kernels:
        lines += ["", "#### Tree SSD kernel (bf16, 64 heads x 64 x state 128, batch 1)", "",
                  "| nodes | kernel ms | reference over kernel | unrolled paths over kernel | N single-token updates "
                  "over kernel |", "|---|---|---|---|---|"]  # fmt: skip
        for r in kernels:
            k = r["kernel_ms"]
            lines.append(f"| {r['nodes']} | {k:.3f} | {r['reference_ms'] / k:.2f} | {r['unrolled_ms'] / k:.2f} | "
                         f"{r['single_token_ms'] / k:.2f} |")  # fmt: skip
    vod = data.get("verify_over_decode", {})
    modes = {"eager": "eager", "graphs": "CUDA graphs", "compiled": "compiled", "graphs (compiled)":
             "compiled + CUDA graphs"}  # fmt: skip
    lines += ["", "#### verify(N) + commit over one decode step (1.3B-class Mamba2, bf16)", "",
              "| N | " + " | ".join(modes.values()) + " |", "|---" * (len(modes) + 1) + "|"]  # fmt: skip
    ns = sorted({int(k) for m in modes for k in vod.get(m, {})})
    for n in ns:
        cells = [f"{vod[m][str(n)]:.2f}" if str(n) in vod.get(m, {}) else "not measured" for m in modes]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if vod.get("decode_ms"):
        lines += ["", "HF decode step: " + ", ".join(f"{modes.get(m, m)} {v:.2f} ms" for m, v in
                                                     vod["decode_ms"].items()) + "."]  # fmt: skip
    for mode, err in vod.get("errors", {}).items():
        lines += ["", f"*{modes.get(mode, mode)}: {err}*"]
    lines += ["", "#### End to end", "", "| model | method | tokens/s | vs HF greedy | vs best plain decoder | "
              "identical | near-ties |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for model, rows in data.get("e2e", {}).items():
        for method, r in rows.items():
            if "tokens_per_s" not in r:
                lines.append(f"| {model} | {method} | failed: {r.get('error', '')[:120]} | | | | |")
                continue
            lines.append(f"| {model} | {method} | {r['tokens_per_s']:.1f} | {r['speedup_vs_hf']:.2f} | "
                         f"{r['speedup_vs_best_ar']:.2f} | {r['identical']} | {r['near_ties']} |")  # fmt: skip
    families = data.get("families", {})
    if families:
        lines += ["", '#### Families under backend="ssmspec" in bf16 on CUDA (tiny models, speculative vs HF greedy)',
                  "", "| family | result | identical | near-ties | Inductor fallbacks |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for fam, r in sorted(families.items()):
            if r.get("ok"):
                lines.append(f"| {fam} | ran | {r['identical']} | {r['near_ties']} | {r['inductor_fallbacks']} |")
            else:
                lines.append(f"| {fam} | failed: {r.get('error', '')[-120:]} | | | |")
    return "\n".join(lines) + "\n"  # (how the sections were run is in the data file's notes)


def _bench(name: str) -> str:
    data = load(name)
    setup = data.get("setup") or data.get("model") or ""
    if "methods" in data:  # e2e
        rows = [{"method": k, **v} for k, v in data["methods"].items()]
        setup = setup or (f"{data['prompts']} held-out prompts, {data['tokens']} generated tokens")
    else:
        rows = data["rows"]
    cols = [c for c in rows[0] if not isinstance(rows[0][c], (list, dict))]
    for r in rows[1:]:
        cols += [c for c in r if c not in cols and not isinstance(r[c], (list, dict))]
    lines = [f"*{setup}*", "", "| " + " | ".join(c.replace("_", " ") for c in cols) + " |",
             "|" + "---|" * len(cols)]  # fmt: skip
    plain = data.get("methods", {}).get("ssmspec autoregressive", {}).get("tokens_per_s")
    lines += ["| " + " | ".join(_bench_cell(r, c, plain) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n\n" + _source_line([name])


def _bench_cell(row: dict, column: str, plain: float | None) -> str:
    """A cell of a benchmark table: the row's value, else what its data implies (a rate's ratio to ssmspec's plain
    decoding's; one token a step for HF's decoding; HF greedy against itself), else "not measured"."""
    method = str(row.get("method", ""))
    if row.get(column) is not None:
        return fmt(row[column])
    if column == "speedup_vs_ssmspec_ar" and plain and row.get("tokens_per_s"):
        return fmt(row["tokens_per_s"] / plain)
    if column == "mean_accepted_per_step" and method.startswith("HF "):
        return "one token a step"
    if column == "worst_prompt_speedup_vs_hf" and method == "HF greedy":
        return fmt(1.0)
    return "not measured"


def _batched_table(batches: dict, methods: list[str], best: str | None) -> list[str]:
    head = "| batch | " + " | ".join(f"{m} tok/s (x HF)" for m in methods)
    lines = [head + (f" | {best} over the best plain decoder | accepted / step |" if best else " |")]
    lines.append("|---:" * (len(methods) + 1 + (2 if best else 0)) + "|")
    for b, row in batches.items():
        cells = [f"{row[m]['tokens_per_s']:,.0f} ({row[m]['speedup_vs_hf']:.2f}x)" if m in row else "not measured"
                 for m in methods]  # fmt: skip
        if best:
            r = row.get(best, {})
            cells += [fmt(r.get("speedup_vs_best_plain"), "x"), fmt(r.get("mean_accepted_per_step"))]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines


def _batched(name: str) -> str:
    data = load(name)
    methods = list(dict.fromkeys(m for row in data["batches"].values() for m in row))
    best = "ssmspec default (compiled)" if "ssmspec default (compiled)" in methods else "ssmspec default"
    lines = [f"*{data['setup']}*", "", *_batched_table(data["batches"], methods, best)]
    return "\n".join(lines) + "\n\n" + _source_line([name])


def _batched_gpu() -> str:
    data = load("batched_gpu")
    sizes = sorted({int(b) for run in data["runs"] for b in run["batches"]})
    lines = [f"*{data['setup']}. {data.get('notes', '')}*", "",
             "The default call over the fastest plain decoder of the same run (HF's or ssmspec's), per run:", "",
             "| run | command | " + " | ".join(f"batch {b}" for b in sizes) + " |",
             "|---|---|" + "---:|" * len(sizes)]  # fmt: skip
    for i, run in enumerate(data["runs"], 1):  # (each run's revision is in the data file)
        cells = [fmt(run["batches"][str(b)]["ssmspec default"]["speedup_vs_best_plain"], "x")
                 if str(b) in run["batches"] else "not measured" for b in sizes]  # fmt: skip
        lines.append(f"| {i} | `{run['command']}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + _source_line(["batched_gpu"])


# ---------------------------------------------------------------------------------------------------- SVG plots

_COLORS = ("#3949ab", "#ef6c00", "#2e7d32", "#8e24aa", "#00838f", "#c62828", "#6d4c41", "#546e7a")
_FONT = 'font-family="system-ui, sans-serif"'


def _t(x: float, y: float, text: str, size: int = 11, anchor: str = "middle", extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" {_FONT} {extra}>'
            f"{html.escape(str(text))}</text>")  # fmt: skip


def _ylabel(text: str, middle: float) -> str:
    return _t(14, middle, text, extra=f'transform="rotate(-90 14 {middle})"')


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    span = max(hi - lo, 1e-9)
    raw = span / n
    step = min((s * 10 ** math.floor(math.log10(raw)) for s in (1, 2, 2.5, 5, 10)), key=lambda s: abs(s - raw))
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _figure(svg: list[str], width: int, height: int, title: str, caption: str) -> str:
    body = "".join(svg)
    return (f'<div class="plot"><svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
            f'role="img" aria-label="{html.escape(title)}">{body}</svg></div>\n\n{caption}')  # fmt: skip


def line_plot(series: dict[str, list[tuple[float, float]]], *, title: str, xlabel: str, ylabel: str,
              caption: str, logx: bool = False, ref: float | None = 1.0) -> str:  # fmt: skip
    """Lines with markers (one per series), a dashed reference line, the legend on the right."""
    width, height, left, right, top, bottom = 720, 360, 56, 210, 30, 46
    pts = [p for s in series.values() for p in s]
    fx = (lambda v: math.log2(v)) if logx else (lambda v: v)
    x0, x1 = min(fx(p[0]) for p in pts), max(fx(p[0]) for p in pts)
    ys = [p[1] for p in pts] + ([ref] if ref is not None else [])
    y0, y1 = min(0.0, min(ys)), max(ys) * 1.08
    px = lambda v: left + (fx(v) - x0) / max(x1 - x0, 1e-9) * (width - left - right)  # noqa: E731
    py = lambda v: height - bottom - (v - y0) / max(y1 - y0, 1e-9) * (height - top - bottom)  # noqa: E731
    svg = [_t(width / 2, 16, title, 13, extra='font-weight="600"')]
    for v in _ticks(y0, y1):
        svg.append(f'<line x1="{left}" x2="{width - right}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="#ddd"/>')
        svg.append(_t(left - 6, py(v) + 4, f"{v:g}", anchor="end"))
    xticks = sorted({p[0] for p in pts})
    for v in xticks:
        svg.append(f'<line x1="{px(v):.1f}" x2="{px(v):.1f}" y1="{top}" y2="{height - bottom}" stroke="#f0f0f0"/>')
        svg.append(_t(px(v), height - bottom + 16, f"{v:g}"))
    svg.append(_t((left + width - right) / 2, height - 8, xlabel))
    svg.append(_ylabel(ylabel, (top + height - bottom) / 2))
    if ref is not None:
        svg.append(f'<line x1="{left}" x2="{width - right}" y1="{py(ref):.1f}" y2="{py(ref):.1f}" stroke="#777" '
                   'stroke-dasharray="5 4"/>')  # fmt: skip
    for i, (label, s) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        s = sorted(s)
        svg.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                   + " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s) + '"/>')  # fmt: skip
        svg += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>' for x, y in s]
        ly = top + 10 + 18 * i
        svg.append(f'<line x1="{width - right + 12}" x2="{width - right + 30}" y1="{ly}" y2="{ly}" stroke="{color}" '
                   'stroke-width="2"/>')  # fmt: skip
        svg.append(_t(width - right + 36, ly + 4, label, 11, anchor="start"))
    return _figure(svg, width, height, title, caption)


def bar_plot(groups: list[str], series: dict[str, list[float]], *, title: str, ylabel: str, caption: str,
             ref: float | None = 1.0) -> str:  # fmt: skip
    """Grouped vertical bars, each labelled with its value."""
    width, height, left, right, top, bottom = 720, 340, 56, 16, 52, 40
    y1 = max([v for vs in series.values() for v in vs] + [ref or 0]) * 1.12
    py = lambda v: height - bottom - v / y1 * (height - top - bottom)  # noqa: E731
    svg = [_t(width / 2, 16, title, 13, extra='font-weight="600"')]
    for i, label in enumerate(series):
        lx = left + 10 + 190 * i
        svg.append(f'<rect x="{lx}" y="30" width="12" height="12" fill="{_COLORS[i % len(_COLORS)]}"/>')
        svg.append(_t(lx + 18, 40, label, 11, anchor="start"))
    for v in _ticks(0, y1):
        svg.append(f'<line x1="{left}" x2="{width - right}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="#ddd"/>')
        svg.append(_t(left - 6, py(v) + 4, f"{v:g}", anchor="end"))
    svg.append(_ylabel(ylabel, (top + height - bottom) / 2))
    gw = (width - left - right) / len(groups)
    bw = gw * 0.8 / len(series)
    for g, group in enumerate(groups):
        gx = left + g * gw + gw * 0.1
        svg.append(_t(left + g * gw + gw / 2, height - bottom + 16, group))
        for i, vs in enumerate(series.values()):
            v = vs[g]
            x = gx + i * bw
            svg.append(f'<rect x="{x:.1f}" y="{py(v):.1f}" width="{bw - 3:.1f}" height="{py(0) - py(v):.1f}" '
                       f'fill="{_COLORS[i % len(_COLORS)]}"/>')  # fmt: skip
            svg.append(_t(x + (bw - 3) / 2, py(v) - 4, f"{v:.2f}", 10))
    if ref is not None:
        svg.append(f'<line x1="{left}" x2="{width - right}" y1="{py(ref):.1f}" y2="{py(ref):.1f}" stroke="#777" '
                   'stroke-dasharray="5 4"/>')  # fmt: skip
    return _figure(svg, width, height, title, caption)


def hbar_plot(values: dict[str, float], *, title: str, xlabel: str, caption: str, ref: float | None = 1.0) -> str:
    """One horizontal bar per entry, in order, its value at its end."""
    names = list(values)
    width, left, right, top, row = 820, 430, 50, 30, 18
    height = top + row * len(names) + 34
    x1 = max(list(values.values()) + [ref or 0]) * 1.05
    px = lambda v: left + v / x1 * (width - left - right)  # noqa: E731
    svg = [_t(width / 2, 16, title, 13, extra='font-weight="600"')]
    for v in _ticks(0, x1):
        svg.append(f'<line x1="{px(v):.1f}" x2="{px(v):.1f}" y1="{top}" y2="{height - 30}" stroke="#e4e4e4"/>')
        svg.append(_t(px(v), height - 16, f"{v:g}"))
    for i, name in enumerate(names):
        y = top + i * row
        svg.append(f'<rect x="{left}" y="{y + 2}" width="{px(values[name]) - left:.1f}" height="{row - 5}" '
                   f'fill="{_COLORS[0]}"/>')  # fmt: skip
        svg.append(_t(left - 6, y + row - 6, name, 10, anchor="end"))
        svg.append(_t(px(values[name]) + 4, y + row - 6, f"{values[name]:.2f}", 10, anchor="start"))
    if ref is not None:
        svg.append(f'<line x1="{px(ref):.1f}" x2="{px(ref):.1f}" y1="{top}" y2="{height - 30}" stroke="#777" '
                   'stroke-dasharray="5 4"/>')  # fmt: skip
    svg.append(_t((left + width - right) / 2, height - 2, xlabel))
    return _figure(svg, width, height, title, caption)


_PROMPT_SETS = {"held-out code": "e2e_defaults", "third-party code": "e2e_third_party_default",
                "prose": "e2e_prose", "random tokens": "e2e_random"}  # fmt: skip


def _plot_prompt_sets(_: str) -> str:
    series = {"default (the draft head + n-grams)": "ssmspec default", "n-gram tree (no head)": "ssmspec default "
              "without a draft head", "ssmspec plain decoding": "ssmspec autoregressive"}  # fmt: skip
    values = {label: [load(f)["methods"][m]["speedup_vs_hf"] for f in _PROMPT_SETS.values()]
              for label, m in series.items()}  # fmt: skip
    return bar_plot(list(_PROMPT_SETS), values, title="Speed-up over HF greedy per prompt set (embedded target)",
                    ylabel="x HF greedy", caption=_source_line(list(_PROMPT_SETS.values())))  # fmt: skip


def _latest_runs(data: dict) -> list[dict]:
    return [r for r in data["runs"] if r["code"] == data["runs"][-1]["code"]]


def _plot_batches(_: str) -> str:
    cpu, gpu = load("batched"), load("batched_gpu")
    runs = _latest_runs(gpu)
    series = {}
    for label, method in (("default", "ssmspec default"), ("plain decoding", "ssmspec autoregressive")):
        series[f"CPU: {label}"] = [(int(b), r[method]["speedup_vs_hf"]) for b, r in cpu["batches"].items()]
        sizes = sorted({int(b) for run in runs for b in run["batches"]})
        series[f"GPU: {label} (median)"] = [
            (b, statistics.median(run["batches"][str(b)][method]["speedup_vs_hf"] for run in runs
                                  if str(b) in run["batches"])) for b in sizes]  # fmt: skip
    caption = (f"GPU points: the median of the {len(runs)} runs of code `{runs[-1]['code']}` in the data file. "
               + _source_line(["batched", "batched_gpu"]))  # fmt: skip
    return line_plot(series, title="Speed-up over HF greedy (batched), per batch size and device", logx=True,
                     xlabel="batch size (different prompts)", ylabel="x HF greedy, batched",
                     caption=caption)  # fmt: skip


def _plot_verify_cost(arg: str) -> str:
    series, names = {}, []
    for item in arg.split(";"):
        name, _, label = item.partition("=")
        name = name.strip()
        data = load(name)
        rows = [r for r in data["rows"] if r.get("shape", "chain") == "chain"]
        series[label.strip() or name] = [(r["nodes"], r["ratio"]) for r in rows]
        names.append(name)
    return line_plot(series, title="Verify + commit of a chain of N tokens, in HF decode steps", logx=True,
                     xlabel="tokens verified (N)", ylabel="cost / HF decode step",
                     caption=_source_line(names))  # fmt: skip


def _plot_tree_vs_chain(_: str) -> str:
    data = load("tree_vs_chain")
    shapes = list(dict.fromkeys(r["shape"] for r in data["rows"] if r["budget"]))
    series = {s: [(r["budget"], r["speedup_vs_ar"]) for r in data["rows"] if r["shape"] == s] for s in shapes}
    return line_plot(series, title="Tree against chain at equal node budget (n-gram drafts)", logx=True,
                     xlabel="drafted nodes per step", ylabel="x ssmspec plain decoding",
                     caption=_source_line(["tree_vs_chain"]))  # fmt: skip


def _model_size_cases(rows: list[dict]) -> list[str]:
    """The cases a model_size file measured (greedy, sampling T ..., random prompts), in its order."""
    return [c for c in rows[0] if isinstance(rows[0][c], dict) and "speedup" in rows[0][c]]


def _plot_model_size(_: str) -> str:
    rows = load("model_size")["rows"]
    trained = [r for r in rows if r.get("variant") == "default"]  # (not the same model with its MTP layer)
    millions = lambda r: round(r["params"] / 1e6, 1)  # noqa: E731
    series = {c: [(millions(r), r[c]["speedup"]) for r in trained] for c in _model_size_cases(trained)}
    projected = [(millions(r), r["projected_greedy_speedup"]) for r in rows if "projected_greedy_speedup" in r]
    if projected:
        series["greedy, bound from the cost curve"] = projected
    return line_plot(series, title="The default call over ssmspec's plain decoding, by model size", logx=True,
                     xlabel="parameters (millions)", ylabel="x ssmspec plain decoding",
                     caption=_source_line(["model_size"]))  # fmt: skip


def _plot_cost_curves(_: str) -> str:
    rows = load("model_size")["rows"]
    series = {f"{r['model']} ({r['params'] / 1e6:.0f}M)": [(int(k), v) for k, v in r["curve"].items()]
              for r in rows if r.get("variant") != "MTP layer"}  # fmt: skip
    return line_plot(series, title="Verify cost of k nodes, in plain decode steps (each model's calibration)",
                     logx=True, xlabel="nodes verified (k)", ylabel="cost / plain step",
                     caption=_source_line(["model_size"]))  # fmt: skip


def _model_size() -> str:
    """docs/data/model_size.json as a table: per model, its size, its plain step, its cost curve at 8 nodes and the
    default call's speed-up over plain decoding (tokens accepted per step) in each case measured."""
    data = load("model_size")
    rows = data["rows"]
    cases = _model_size_cases([r for r in rows if not r.get("cost_only")])
    # (a model measured twice, with its draft head and with its MTP layer: both rows, the default's first)
    lines = [f"*{data['setup']}*", "",
             "| model | parameters | float32 weights | plain step | verify(8) / plain | "
             + " | ".join(f"{c} (accepted / step)" for c in cases) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(cases)]  # fmt: skip
    for r in rows:
        variant = {"MTP layer": ", drafting with its MTP layer", None: " (random, cost only)"}.get(r.get("variant"), "")
        cells = [f"`{r['model']}`{variant}",
                 f"{r['params'] / 1e6:.1f}M", f"{r['weight_mib_fp32']:.0f} MiB", f"{r['plain_step_ms']:.1f} ms",
                 fmt(r["curve"].get("8"), "x")]  # fmt: skip
        for c in cases:
            if c in r:
                cells.append(f"{fmt(r[c]['speedup'], 'x')} ({r[c]['accepted_per_step']:.2f})")
            elif c == "greedy" and "projected_greedy_speedup" in r:
                cells.append(f"at most {fmt(r['projected_greedy_speedup'], 'x')} (cost bound)")
            else:
                cells.append("not measured")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + _source_line(["model_size"])


def _plot_methods(name: str) -> str:
    data = load(name)
    values = {m: r["speedup_vs_hf"] for m, r in data["methods"].items()}
    return hbar_plot(values, title=f"Speed-up over eager HF greedy ({data.get('prompt_set', name)} prompts)",
                     xlabel="x HF greedy", caption=_source_line([name]))  # fmt: skip


_PLOTS = {"prompt-sets": _plot_prompt_sets, "batches": _plot_batches, "verify-cost": _plot_verify_cost,
          "tree-vs-chain": _plot_tree_vs_chain, "methods": _plot_methods, "model-size": _plot_model_size,
          "cost-curves": _plot_cost_curves}  # fmt: skip


# ----------------------------------------------------------------------------------------------------- the hook


def _math(markdown: str) -> str:
    from latex2mathml.converter import convert

    return _DISPLAY_MATH.sub(lambda m: '<div class="math">' + convert(m.group(1), display="block") + "</div>",
                             markdown)  # fmt: skip


def _mtp() -> str:
    """The families whose checkpoints ship MTP layers: the layout ssmspec builds (ssmspec.hf.mtp), or why not."""
    from ssmspec.hf import mtp as hf_mtp

    layouts = {
        "qwen3_next": "`mtp.fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layers.0` (full attention, MoE), "
        "`norm`",
        "qwen3_5_text": "as Qwen3-Next, `layers.0` with a dense MLP",
        "qwen3_5_moe_text": "as Qwen3-Next, `layers.0` with a MoE MLP (fused or per-expert tensors)",
        "nemotron_h": "`mtp.layers.{i}`: one block per `mtp_layers_block_type` entry, `enorm`/`hnorm`/`eh_proj` on the "
        "first, `final_layernorm` on the last",
    }
    missing = set(hf_mtp.FAMILIES) - set(layouts)
    if missing:
        raise ValueError(f"docs/hooks.py describes no MTP layout for {sorted(missing)}")
    rows = ["| model type | native drafter | checkpoint tensors |", "|---|---|---|"]
    rows += [f"| {fam} | MTP layer | {layouts[fam]} |" for fam in hf_mtp.FAMILIES]
    rows += [f"| {fam} | refused | {_cell(why)} |" for fam, why in hf_mtp.REFUSED.items()]
    return "\n".join(rows)


def _data_files() -> str:
    """Every file in docs/data: the command that writes it, its cut-off (benchmarks/all.py) and what it records."""
    registry = _registry()
    rows = ["| data file | command | cut-off: the last change to | measured (revision) |", "|---|---|---|---|"]
    for name, entry in registry.FILES.items():
        found = registry.recorded(name)
        needs = {"cuda": " (needs a CUDA GPU)", "llama.cpp": " (needs a llama.cpp build)"}.get(entry.needs, "")
        rows.append(f"| `{name}.json` | `{_cell(entry.command)}`{needs} | `{entry.cutoff}`, {entry.why} | "
                    f"{found.get('date', 'not recorded')} (`{found.get('revision', 'not recorded')}`) |")  # fmt: skip
    return "\n".join(rows) + "\n"


_RENDERERS = {
    "data-files": _data_files,
    "mtp": _mtp,
    "families-table": _overview,
    "families": _families,
    "family-details": _family_details,
    "settings": _settings,
    "limitations": _limitations,
    "spec-config": _spec_config,
    "spec-stats": _spec_stats,
    "cli": _cli,
    "embedded-models": _embedded_models,
    "model-size": _model_size,
    "gpu": _gpu,
    "speed-summary": speed_summary,
    "batched-gpu": _batched_gpu,
}
_WITH_ARG = {"bench": _bench, "batched": _batched, "provenance": lambda n: _source_line(n.split(","))}


def render(markdown: str, where: str = "") -> str:
    """A page's directives and placeholders rendered (not its math)."""

    def directive(m: re.Match) -> str:
        kind, arg = m.group(1), (m.group(2) or "").strip()
        if kind == "plot":
            plot, _, rest = arg.partition(" ")
            if plot not in _PLOTS:
                raise ValueError(f"unknown plot {plot!r} in {where}: one of {sorted(_PLOTS)}")
            return _PLOTS[plot](rest)
        if kind == "snippet":  # how the test suite runs the next code block (tests/test_docs_snippets.py): no output
            return ""
        if kind in _WITH_ARG:
            return _WITH_ARG[kind](arg)
        if kind in _RENDERERS:
            return _RENDERERS[kind]()
        raise ValueError(f"unknown ssmspec directive {m.group(0)} in {where}")

    return render_placeholders(_outside_code(markdown, lambda text: _DIRECTIVE.sub(directive, text)))


def on_page_markdown(markdown: str, page, config, files) -> str:
    check_page(markdown, page.file.src_uri)
    return _math(render(markdown, page.file.src_uri))


def rendered_history(html: str) -> list[str]:
    """Words about the project's own history in a rendered page's text (its markup and scripts left out): what the
    data rendered into it says too (notes, row labels), not only its markdown."""
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S | re.I)
    return history_words(re.sub(r"<[^>]+>", " ", text))


# what a table cell may not show where a value belongs (a cell that means "nothing" says so in words)
_BLANK_CELLS = {"", "None", "none", "nan", "null", "–", "—", "-", "?"}


def rendered_blanks(html_text: str) -> list[str]:
    """The table cells of a rendered page that show a blank, a dash or None (outside code: a default that is None
    in code is a value), as `row: column` of each."""
    found = []
    for table in re.findall(r"<table.*?</table>", html_text, flags=re.S):
        head = [_text(c) for c in re.findall(r"<th[^>]*>(.*?)</th>", table, flags=re.S)]
        for row in re.findall(r"<tr>(.*?)</tr>", table, flags=re.S):
            cells = re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)
            found += [f"{_text(cells[0])[:40]}: {column}" for column, cell in zip(head, cells)
                      if _text(cell) in _BLANK_CELLS and "<code>" not in cell]  # fmt: skip
    return found


def _text(cell: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()


def on_post_page(output: str, page, config) -> str:
    hits = rendered_history(output)
    if hits:
        raise ValueError(f"{page.file.src_uri}, as rendered: words about the project's history: " + "; ".join(hits))
    blanks = rendered_blanks(output)
    if blanks:
        raise ValueError(f"{page.file.src_uri}, as rendered: table cells without a value: " + "; ".join(blanks))
    return output


# ------------------------------------------------------------------------------------------------------ README

_README_BLOCKS = {"speed-table": speed_summary, "families-line": families_line}


def readme_block(text: str, name: str) -> str:
    m = re.search(rf"<!-- ssmspec:{name} -->\n(.*?)<!-- /ssmspec:{name} -->", text, re.S)
    if m is None:
        raise ValueError(f"README.md has no <!-- ssmspec:{name} --> ... <!-- /ssmspec:{name} --> block")
    return m.group(1)


def readme_without_blocks(text: str) -> str:
    return re.sub(r"<!-- ssmspec:([\w-]+) -->\n.*?<!-- /ssmspec:\1 -->", "", text, flags=re.S)


def write_readme(blocks: tuple[str, ...] = tuple(_README_BLOCKS)) -> None:
    """Rewrite the README's generated blocks (scripts/readme.py)."""
    text = README.read_text()
    for name in blocks:
        readme_block(text, name)
        text = re.sub(rf"(<!-- ssmspec:{name} -->\n).*?(<!-- /ssmspec:{name} -->)",
                      lambda m: m.group(1) + _README_BLOCKS[name]() + m.group(2), text, flags=re.S)  # fmt: skip
    README.write_text(text)


def check_readme(blocks: tuple[str, ...] = tuple(_README_BLOCKS)) -> None:
    """The README's generated blocks are what the data and the code give now, and its prose follows the rules."""
    text = README.read_text()
    for name in blocks:
        if readme_block(text, name) != _README_BLOCKS[name]():
            raise ValueError(f"README.md's {name} block is out of date: run `python scripts/readme.py`")
    check_page(readme_without_blocks(text), "README.md", length=words(text))
    if history_words(text):
        raise ValueError("README.md: words about the project's history: " + "; ".join(history_words(text)))


def on_pre_build(config) -> None:
    sys.path.insert(0, str(ROOT))
    check_readme()
    check_data()
