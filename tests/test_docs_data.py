"""The committed docs data describe the code: the families report covers exactly the supported families, and
a stale report is detected (the docs build fails on it)."""

from __future__ import annotations

from pathlib import Path

from ssmspec.testing import report
from ssmspec.testing.configs import SUPPORTED_FAMILIES

ROOT = Path(__file__).resolve().parent.parent


def test_committed_family_report_covers_the_supported_families():
    data = report.load(ROOT / "docs" / "data" / "families.json")
    assert report.stale_families(data, SUPPORTED_FAMILIES) == [], "run scripts/docs-data.sh and commit the result"


def test_stale_reports_are_detected():
    data = report.load(ROOT / "docs" / "data" / "families.json")
    missing = {k: v for k, v in data.items() if k != "mamba"}
    assert report.stale_families(missing, SUPPORTED_FAMILIES) == ["mamba: no examples in the report"]
    extra = {**data, "retired_family": {"n_examples": 3}}
    assert report.stale_families(extra, SUPPORTED_FAMILIES) == [
        "retired_family: in the report but not a supported family"
    ]
