"""The `ssmspec` command: demo, generate, bench, check; user mistakes give one line and exit code 2."""

from __future__ import annotations

import json

from ssmspec.cli import main


def test_demo_runs_the_embedded_model_and_reports_identity(capsys):
    assert main(["demo", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "embedded mamba2-target" in out
    assert "identical:    yes" in out
    assert "class Config" in out  # the decoded prompt, as text
    for line in ("HF greedy:", "ssmspec AR:", "speculative:", "accepted:"):
        assert line in out


def test_generate_prints_the_continuation(capsys):
    assert main(["generate", "def add(a, b):\n", "--max-new-tokens", "12", "--tree"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "verify steps" in captured.err


def test_bench_writes_json(tmp_path, capsys):
    target = tmp_path / "bench.json"
    args = ["bench", "--prompts", "1", "--max-new-tokens", "12", "--no-progress", "--json", str(target)]
    assert main(args) == 0
    result = json.loads(target.read_text())
    assert set(result["methods"]) == {
        "HF greedy", "ssmspec autoregressive", "chain n-gram", "chain draft model", "tree n-gram"
    }  # fmt: skip
    assert "all outputs identical to HF greedy" in capsys.readouterr().out


def test_check_on_a_family(capsys):
    assert main(["check", "--family", "mamba2"]) == 0  # mamba2: HF's decode path rounds differently (1e-6 rule)
    out = capsys.readouterr().out
    assert "tree path only: runs 16," in out and "with HF decode steps: runs 16," in out
    assert out.count("tie flips 0,") == 2


def test_user_mistakes_are_one_line_errors(capsys):
    assert main(["generate", "x", "--family", "mamba2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ssmspec: error:")
    assert main(["demo", "--model", "/does/not/exist"]) == 2
    assert capsys.readouterr().err.startswith("ssmspec: error:")
