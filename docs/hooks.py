"""MkDocs hook: render the generated parts of the docs at build time.

- `<!-- ssmspec:families -->`: the supported-families table from the family report the property suite
  writes ($SSMSPEC_FAMILY_REPORT, default build/family-report.json), and the refused families with the
  error `ssmspec.transform` raises for each (computed now, on tiny models);
- `<!-- ssmspec:bench NAME -->`: a table from docs/data/NAME.json, which the benchmark scripts write.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"
_PLACEHOLDER = re.compile(r"<!-- ssmspec:(\w+)(?: (\S+))? -->")


def _families() -> str:
    from transformers.utils import logging as hf_logging

    from ssmspec.errors import UnsupportedModelError
    from ssmspec.testing import report
    from ssmspec.testing.configs import SUPPORTED_FAMILIES, UNSUPPORTED_FAMILIES, build_tiny_model
    from ssmspec.transform import transform

    hf_logging.set_verbosity_error()  # the refused families' tiny models would print HF's kernel fallbacks
    path = Path(os.environ.get(report.ENV_VAR, ROOT / "build" / "family-report.json"))
    data = report.load(path) if path.exists() else {}
    note = (
        f"Generated from the property-suite run that wrote `{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}`."
        if data
        else "No family report found: run `bash scripts/test.sh` (it sets `SSMSPEC_FAMILY_REPORT`) before building."
    )
    out = [note, "", report.families_markdown(data, SUPPORTED_FAMILIES), "", "Refused, with the error "
           "`ssmspec.transform` raises (computed while building these docs):", "",
           "| family | error |", "|---|---|"]  # fmt: skip
    for fam in UNSUPPORTED_FAMILIES:
        try:
            transform(build_tiny_model(fam))
            msg = "**accepted** (this table is out of date: the family should move to the property suite)"
        except UnsupportedModelError as exc:
            msg = str(exc).replace("|", "\\|")
        out.append(f"| {fam} | {msg} |")
    return "\n".join(out) + "\n"


def _fmt(v) -> str:
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


def on_page_markdown(markdown: str, page, config, files) -> str:
    def render(m: re.Match) -> str:
        kind, arg = m.group(1), m.group(2)
        if kind == "families":
            return _families()
        if kind == "bench":
            return _bench(arg)
        raise ValueError(f"unknown ssmspec placeholder {m.group(0)} in {page.file.src_uri}")

    return _PLACEHOLDER.sub(render, markdown)
