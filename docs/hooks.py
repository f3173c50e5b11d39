"""MkDocs hook: render the generated parts of the docs at build time, from the code and committed data.

- `<!-- ssmspec:families -->` / `<!-- ssmspec:family-details -->`: the supported families, from the report the
  property suite wrote (docs/data/families.json, refreshed by scripts/docs-data.sh); the build fails if it is
  missing or does not cover exactly the families the code supports. Refused families with the error
  `ssmspec.transform` raises for each (computed now, on tiny models).
- `<!-- ssmspec:settings -->`: every generation setting, applied / no effect / refused, from ssmspec.hf.generation.
- `<!-- ssmspec:limitations -->`: what is refused and why, from the code's own lists.
- `<!-- ssmspec:gpu -->`: docs/data/gpu.json (written by benchmarks/gpu.py), or a plain statement that it is missing.
- `<!-- ssmspec:bench NAME -->`: a table from docs/data/NAME.json, which the benchmark scripts write.
- Math: `$$ ... $$` blocks (each delimiter on its own line) become MathML at build time (latex2mathml):
  rendered by the browser, nothing loaded from a CDN.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"
_PLACEHOLDER = re.compile(r"<!-- ssmspec:([\w-]+)(?: (\S+))? -->")
_DISPLAY_MATH = re.compile(r"^\$\$\n(.+?)\n\$\$$", re.S | re.M)


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


def _overview() -> str:
    """Every family of the pinned transformers with recurrent state: the path it verifies on and what is exact,
    from the property suite's report (seams), the generic probes (generic) and transform's errors (refused),
    computed now. The README holds the same table (`python docs/hooks.py --write-readme`; the build checks it)."""
    from ssmspec.testing import report
    from ssmspec.testing.configs import SUPPORTED_FAMILIES

    data = _family_report()
    lines = ["| family | path | what verifies it | exact for |", "|---|---|---|---|"]
    for fam in SUPPORTED_FAMILIES:
        seams = ", ".join(data[fam].get("seams", []))
        lines.append(f"| {fam} | seams | {seams} | {report._exact(data[fam])} |")
    for fam, _, _, exact in _generic_families():
        lines.append(f"| {fam} | generic | HF's own forward and cache (no kernel seam) | {exact} |")
    for fam, why in _refused_families():  # without the measured differences: the table states what, not how much
        lines.append(f"| {fam} | refused | {_cell(_MEASURED.sub('', why))} | – |")
    return "\n".join(lines) + "\n"


_MEASURED = re.compile(r" by [\d.e+-]+ \(relative; tolerance [^)]*\)")
_README_BLOCK = re.compile(r"(<!-- ssmspec:families-overview -->\n)(.*?)(<!-- /ssmspec:families-overview -->)", re.S)


def _readme_block(readme: str) -> str:
    m = _README_BLOCK.search(readme)
    if m is None:
        raise ValueError("README.md has no <!-- ssmspec:families-overview --> block")
    return m.group(2)


def write_readme() -> None:
    """Rewrite the README's families table from `_overview()`."""
    path = ROOT / "README.md"
    text = path.read_text()
    _readme_block(text)
    path.write_text(_README_BLOCK.sub(lambda m: m.group(1) + _overview() + m.group(3), text))


def on_pre_build(config) -> None:
    """The README's families table is generated too: fail the build where it differs from what the code finds."""
    if _readme_block((ROOT / "README.md").read_text()) != _overview():
        raise ValueError("README.md's families table is out of date: run `python docs/hooks.py --write-readme`")


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
              "No kernel seam: HF's own forward verifies chains (see How it works, \"The generic path\"), and trees "
              "only where the model's recurrence modules have tree forms (xLSTM, RWKV, MiniMax, ZAYA); elsewhere "
              "`SpecConfig(tree=True)` is refused naming the path. A batch is verified row by row where HF's batched "
              "loop computes what its rows compute alone (HF's RWKV does not: it is refused there); a default call on "
              "a batch runs HF's own batched generate.", "", "| family | why no seams | exact for |",
              "|---|---|---|"]  # fmt: skip
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


def _gpu() -> str:
    path = DATA / "gpu.json"
    if not path.exists():
        return ("**No GPU measurements yet.** `docs/data/gpu.json` does not exist: `python benchmarks/gpu.py` on a "
                "CUDA machine writes it, and this page then shows its numbers.\n")  # fmt: skip
    data = json.loads(path.read_text())
    lines = [f"Measured on **{data['device']}**, torch {data['torch']}."]
    kernels = data.get("kernels")
    if isinstance(kernels, list) and kernels:
        lines += ["", "### Tree SSD kernel (bf16, 64 heads x 64 x state 128, batch 1)", "",
                  "| nodes | kernel ms | x reference | x unrolled paths | x N single-token updates |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in kernels:
            k = r["kernel_ms"]
            lines.append(f"| {r['nodes']} | {k:.3f} | {r['reference_ms'] / k:.2f} | {r['unrolled_ms'] / k:.2f} | "
                         f"{r['single_token_ms'] / k:.2f} |")  # fmt: skip
    vod = data.get("verify_over_decode", {})
    modes = {"eager": "eager", "graphs": "CUDA graphs", "compiled": "compiled", "graphs (compiled)":
             "compiled + CUDA graphs"}  # fmt: skip
    lines += ["", "### verify(N) + commit / decode (1.3B-class Mamba2, bf16)", "",
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
    lines += ["", "### End to end", "", "| model | method | tokens/s | vs HF greedy | vs best plain decoder | "
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
        lines += ["", '### Families under backend="ssmspec" in bf16 on CUDA (tiny models, speculative vs HF greedy)',
                  "", "| family | result | identical | near-ties | Inductor fallbacks |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for fam, r in sorted(families.items()):
            if r.get("ok"):
                lines.append(f"| {fam} | ran | {r['identical']} | {r['near_ties']} | {r['inductor_fallbacks']} |")
            else:
                lines.append(f"| {fam} | failed: {r.get('error', '')[-120:]} | | | |")
    for key, note in data.get("notes", {}).items():
        lines += ["", f"*{key}: {note}*"]
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if v is None:  # not measured for that row (a default call that ran HF's own generate has no acceptance)
        return "–"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _bench(name: str) -> str:
    path = DATA / f"{name}.json"
    if not path.exists():
        return f"*(no data: run the benchmark that writes docs/data/{name}.json)*\n"
    data = json.loads(path.read_text())
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
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _math(markdown: str) -> str:
    from latex2mathml.converter import convert

    return _DISPLAY_MATH.sub(lambda m: '<div class="math">' + convert(m.group(1), display="block") + "</div>",
                             markdown)  # fmt: skip


_RENDERERS = {
    "families-table": _overview,
    "families": _families,
    "family-details": _family_details,
    "settings": _settings,
    "limitations": _limitations,
    "gpu": _gpu,
}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def render(m: re.Match) -> str:
        kind, arg = m.group(1), m.group(2)
        if kind == "bench":
            return _bench(arg)
        if kind in _RENDERERS:
            return _RENDERERS[kind]()
        raise ValueError(f"unknown ssmspec placeholder {m.group(0)} in {page.file.src_uri}")

    return _math(_PLACEHOLDER.sub(render, markdown))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-readme"]:
        raise SystemExit("usage: python docs/hooks.py --write-readme")
    sys.path.insert(0, str(ROOT))
    write_readme()
