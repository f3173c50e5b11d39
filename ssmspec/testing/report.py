"""What the property suite established per family, saved as JSON and rendered as the docs' family tables.

The float64 and float32 suites call `record(...)` for every Hypothesis example; with the environment
variable SSMSPEC_FAMILY_REPORT set, the run ends by writing the accumulated report there. The docs render
the report committed as `docs/data/families.json` (refreshed by `scripts/docs-data.sh`, which runs the
suites); the docs build fails if it is missing or does not cover exactly the supported families. So the
table of supported families is what a test run checked, not a hand-written list.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV_VAR = "SSMSPEC_FAMILY_REPORT"
PROVENANCE = "_provenance"  # the key under which docs/data/families.json records how it was measured

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
    "glm5_next": "gated delta rule in float32, its recurrent state cached in float32; MoE router in float32",
    "qwen4_exp": "GDN gate `softplus(a.float() + dt_bias)`, gated delta rule inputs cast to float32",
}


def computes_in_float32(model: Any) -> bool:
    """Whether `model`'s HF code is one of FLOAT32_IN_HF_CODE's (by its config's model_type, a composite model's
    text config's too; "qwen3_5_text" is qwen3_5): its committed states agree only to float32 accuracy."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    types = {getattr(config, "model_type", None), getattr(config.get_text_config(), "model_type", None)}
    return any(t is not None and t.removesuffix("_text") in FLOAT32_IN_HF_CODE for t in types)


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
    path.parent.mkdir(parents=True, exist_ok=True)
    # test processes running side by side (pytest-xdist workers) merge into one file: one at a time
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        _lock(lock)
        merged = load(path) if path.exists() else {}
        for family, row in _REPORT.items():
            merged.setdefault(family, {}).update(row)
        path.write_text(json.dumps(merged, indent=1, sort_keys=True))
    return path


def _lock(file) -> None:
    """An exclusive lock on an open file until it is closed (POSIX; elsewhere one process is assumed)."""
    try:
        import fcntl
    except ImportError:  # Windows: no fcntl
        return
    fcntl.flock(file.fileno(), fcntl.LOCK_EX)


def load(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Read a saved report's families (without the `_provenance` that scripts/docs-data.sh adds)."""
    return {k: v for k, v in json.loads(Path(path).read_text()).items() if k != PROVENANCE}


def stale_families(report: dict[str, dict[str, Any]], families: list[str] | tuple[str, ...]) -> list[str]:
    """Why a report does not describe these families (missing ones, ones without examples, extra ones); empty
    when it does."""
    problems = [f"{fam}: no examples in the report" for fam in families if not report.get(fam, {}).get("n_examples")]
    problems += [f"{fam}: in the report but not a supported family" for fam in report if fam not in families]
    return problems


_VARIANTS = 3  # structural variants the suites draw per family (ssmspec.testing.configs)


def _exact(r: dict[str, Any]) -> str:
    """ "trees, batches", narrowed where the probe found a variant inexact ("variant 1: one prompt at a time")."""
    by_limit: dict[str, list[str]] = {}
    for item in r.get("limits", []):
        variant, limit = item.split(": ", 1)
        by_limit.setdefault(limit, []).append(variant.removeprefix("variant "))
    parts = []
    for full, limit in (("trees", "chains only"), ("batches", "one prompt at a time")):
        variants = by_limit.get(limit, [])
        if len(variants) >= _VARIANTS:
            parts.append(limit)
        elif variants:
            parts.append(f"{full} ({limit} for variant {', '.join(sorted(variants))})")
        else:
            parts.append(full)
    return ", ".join(parts)


def families_markdown(report: dict[str, dict[str, Any]], families: list[str] | tuple[str, ...]) -> str:
    """The compact supported-families table: what is exact, how many examples and tokens checked it."""
    head = (
        "| family | exact for | float64 examples | tokens compared | float32 tie flips / tokens |\n"
        "|---|---|---|---|---|\n"
    )
    rows = []
    for fam in families:
        r = report[fam]
        f32 = f"{r['n_tie_flips']} / {r['n_float32_tokens']}" if "n_float32_tokens" in r else "not drawn"
        rows.append(f"| {fam} | {_exact(r)} | {r['n_examples']} | {r.get('n_tokens', 0)} | {f32} |")
    return head + "\n".join(rows) + "\n"


def family_details_markdown(report: dict[str, dict[str, Any]], families: list[str] | tuple[str, ...]) -> str:
    """One section per family: model class, seams, drafters, commits, state differences and their tolerances."""
    out = []
    for fam in families:
        r = report[fam]

        def diff(kind: str, r=r) -> str:
            if f"max_state_diff_{kind}" not in r:
                return "not drawn"
            return f"{r[f'max_state_diff_{kind}']:.1e} (tolerance {r[f'tolerance_{kind}']:.0e})"

        out += [
            f"## {fam}",
            "",
            f"- HF model class: `{r.get('model_class', '?')}`",
            f"- exact for: {_exact(r)}",
            f"- kernel seams made tree-aware: {', '.join(f'`{s}`' for s in r.get('seams', []))}",
            f"- float64 examples: {r['n_examples']}, tokens compared with HF greedy: {r.get('n_tokens', 0)}",
            f"- drafters exercised: {', '.join(r.get('drafters', []))}; commits: {', '.join(r.get('commits', []))}",
            f"- largest committed-state difference (relative), tree path only: {diff('tree')}",
            f"- largest committed-state difference (relative), with HF decode steps: {diff('decode')}",
        ]
        if "n_float32_tokens" in r:
            out.append(f"- float32: {r['n_tie_flips']} tie flips over {r['n_float32_tokens']} compared tokens")
        if fam in FLOAT32_IN_HF_CODE:
            out.append(f"- HF's code computes in float32 here: {FLOAT32_IN_HF_CODE[fam]}")
        out.append("")
    return "\n".join(out)
