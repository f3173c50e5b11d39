"""Every fenced Python block in README.md and docs/ runs, on the embedded models, so that no snippet a user copies
fails on a missing import or an argument that no longer exists.

A page's blocks run in order in one namespace (a later block continues an earlier one), in a scratch directory. The
namespace starts empty: a page's first block builds what the page uses (`model`, `ids`, a checkpoint's `path`, ...)
and imports what it uses, so that a user who copies it gets a program that runs. A block preceded by
`<!-- ssmspec:snippet replace: OLD => NEW; ... -->` runs with those texts replaced (a checkpoint path by an embedded
model's, a slow compile option by a quick one), one preceded by `<!-- ssmspec:snippet skip: REASON -->` does not
run, for that reason.
Steps compiled by `transform(compile=True)` run their recorded graphs without Inductor's code generation (as in
tests/test_compiled_steps.py): the same calls, in seconds instead of minutes.
"""

from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"(?:<!-- ssmspec:snippet (?P<how>.*?) -->\n+)?^```python[^\n]*\n(?P<code>.*?)^```", re.S | re.M)


def blocks(markdown: str) -> list[tuple[str, str]]:
    """(how, code) of each Python block of a page, in order (`how`: the snippet directive's text, or "")."""
    return [(m.group("how") or "", m.group("code")) for m in _BLOCK.finditer(markdown)]


def prepared(code: str, how: str) -> str | None:
    """The code to run (None: skipped), the directive's replacements made; a replacement that matches nothing fails."""
    if how.startswith("skip:"):
        assert how[5:].strip(), "a skipped snippet names its reason"
        return None
    if how.startswith("replace:"):
        for pair in how[8:].split(";"):
            old, new = (part.strip() for part in pair.split("=>"))
            assert old in code, f"the snippet directive replaces {old!r}, which the block does not contain"
            code = code.replace(old, new)
    elif how:
        raise AssertionError(f"unknown snippet directive {how!r}: 'skip: REASON' or 'replace: OLD => NEW; ...'")
    return code


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p.read_text())], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_of_a_page_runs(page, tmp_path, monkeypatch):
    from ssmspec.compile.lower import StepCompiler

    monkeypatch.chdir(tmp_path)
    # the recorded graphs run as they are, no Inductor code generation (the module by name: `ssmspec.transform`, the
    # function, shadows it as an attribute of the package)
    transform_module = importlib.import_module("ssmspec.transform")
    monkeypatch.setattr(transform_module, "StepCompiler", functools.partial(StepCompiler, inductor=False))
    namespace: dict = {}  # (nothing given: each page builds what it uses)
    found = blocks(page.read_text())
    ran = 0
    for i, (how, code) in enumerate(found):
        code = prepared(code, how)
        if code is None:
            continue
        try:
            exec(compile(code, f"{page.relative_to(ROOT)}: block {i + 1}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"{page.relative_to(ROOT)}, Python block {i + 1} failed: {exc!r}\n{code}") from exc
        ran += 1
    assert ran or all(how.startswith("skip:") for how, _ in found)


def test_the_snippet_directives_do_what_they_say():
    assert prepared("x = f('a')\n", "skip: needs a GPU") is None
    assert prepared("x = f('a')\n", "replace: 'a' => 'b'") == "x = f('b')\n"
    with pytest.raises(AssertionError, match="does not contain"):
        prepared("x = f('a')\n", "replace: 'c' => 'b'")
    with pytest.raises(AssertionError, match="names its reason"):
        prepared("x = 1\n", "skip:")
    text = "<!-- ssmspec:snippet skip: a reason -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n"
    assert blocks(text) == [("skip: a reason", "x = 1\n"), ("", "y = 2\n")]
