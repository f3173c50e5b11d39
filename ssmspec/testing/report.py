"""What the property suite established per family, saved as JSON and rendered as the docs' family table.

The float64 and float32 suites call `record(...)` for every Hypothesis example; with the environment
variable SSMSPEC_FAMILY_REPORT set, the run ends by writing the accumulated report there
(`scripts/test.sh` does, and the docs build renders it with `families_markdown`). So the table of
supported families is whatever the last test run checked, not a hand-written list.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV_VAR = "SSMSPEC_FAMILY_REPORT"

# HF code of these families casts data-dependent values to float32 even in a float64 model (a gate or an
# MoE router), so the same token processed in a differently shaped batch (a tree vs one token) can round
# differently there: their committed states agree only to float32 accuracy (tokens must still be exact).
FLOAT32_IN_HF_CODE = {
    "kimi_linear": "KDA gate `forget_gate.float() + dt_bias.float()`; router `F.linear(h.type(torch.float32), ...)`",
    "nemotron_h": "MoE router `F.linear(hidden_states.type(torch.float32), ...)`",
    "jamba": "MoE router `softmax(router_logits, dtype=torch.float)`",
    "granitemoehybrid": "MoE router `F.linear(hidden_states, self.weight).float()`",
    "qwen3_next": "GDN gate `softplus(a.float() + dt_bias)`",
    "qwen3_5": "GDN gate `softplus(a.float() + dt_bias)`",
    "olmo_hybrid": "GDN gate `softplus(self.a_proj(hidden_states).float() + dt_bias)`",
    "inkling": "short convolutions computed and cached in float32 (`hidden_states.float()`); MoE router in float32",
    "inkling2": "residual stream, short convolutions, router and logits in float32 (`hidden_states.float()`, "
    "`lm_head(...).float()`)",
    "bailing_hybrid": "KDA recurrent state stored in float32 (explicit cast); MoE router in float32",
    "qwen3_5_moe": "GDN gate `softplus(a.float() + dt_bias)`, recurrent state in float32; MoE router in float32",
}

_REPORT: dict[str, dict[str, Any]] = {}


def record(family: str, **fields: Any) -> None:
    """Accumulate one example's facts: numbers named max_* keep their maximum, n_* and counts add up,
    sets (drafters, seams, ...) are merged, anything else keeps its latest value."""
    row = _REPORT.setdefault(family, {})
    for key, value in fields.items():
        if key.startswith("max_"):
            row[key] = max(row.get(key, value), value)
        elif key.startswith("n_"):
            row[key] = row.get(key, 0) + value
        elif isinstance(value, (set, frozenset, list, tuple)):
            row[key] = sorted(set(row.get(key, [])) | set(value))
        else:
            row[key] = value


def current() -> dict[str, dict[str, Any]]:
    """The report accumulated in this process."""
    return _REPORT


def save(path: str | os.PathLike | None = None) -> Path | None:
    """Write the report as JSON (merged into an existing file, so separate runs of the float64 and
    float32 suites add up); path defaults to $SSMSPEC_FAMILY_REPORT. Returns the path, None if unset."""
    path = path or os.environ.get(ENV_VAR)
    if not path or not _REPORT:
        return None
    path = Path(path)
    merged = load(path) if path.exists() else {}
    for family, row in _REPORT.items():
        merged.setdefault(family, {}).update(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1, sort_keys=True))
    return path


def load(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Read a saved report."""
    return json.loads(Path(path).read_text())


def families_markdown(report: dict[str, dict[str, Any]], families: list[str] | tuple[str, ...]) -> str:
    """The supported-families table: one row per family, '(not run)' where the report has no examples."""
    head = (
        "| family | HF model class | exact for | kernel seams wrapped | float64 examples | tokens compared | "
        "drafters exercised | max state diff, tree path only | max state diff, with HF decode steps | float32 "
        "tie flips / tokens |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for fam in families:
        r = report.get(fam, {})
        if not r.get("n_examples"):
            rows.append(f"| {fam} | (not run) | | | 0 | | | | | |")
            continue
        f32 = f"{r['n_tie_flips']} / {r['n_float32_tokens']}" if "n_float32_tokens" in r else "–"
        exact = "; ".join(r["limits"]) if r.get("limits") else "trees, batches"

        def diff(kind: str, r=r) -> str:
            if f"max_state_diff_{kind}" not in r:
                return "–"
            return f"{r[f'max_state_diff_{kind}']:.1e} (≤ {r[f'tolerance_{kind}']:.0e})"

        rows.append(
            f"| {fam} | `{r.get('model_class', '?')}` | {exact} | {', '.join(r.get('seams', []))} | "
            f"{r['n_examples']} | "
            f"{r.get('n_tokens', 0)} | {', '.join(r.get('drafters', []))} | {diff('tree')} | {diff('decode')} | "
            f"{f32} |"
        )
    return head + "\n".join(rows) + "\n"
