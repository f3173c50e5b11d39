"""The README and the docs follow the rules docs/hooks.py states: every speed figure comes from docs/data (the
README's table is what scripts/readme.py generates from it, no page types a figure of its own), no page is too long,
and nothing in them is about the project's own history. Fast (JSON and text only): the docs build checks the rest."""

from __future__ import annotations

import importlib.util
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))


def _load_hooks():
    spec = importlib.util.spec_from_file_location("ssmspec_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _load_hooks()


def test_readme_speed_table_is_generated_from_the_data():
    assert hooks.readme_block(README.read_text(), "speed-table") == hooks.speed_summary(), (
        "README.md's speed table differs from docs/data: run `python scripts/readme.py`"
    )


def test_readme_table_fails_when_the_data_changes(monkeypatch):
    load, data = hooks.load, hooks.load("e2e_defaults")
    default = {**data["methods"]["ssmspec default"], "speedup_vs_hf": 9.99}
    changed = {**data, "methods": {**data["methods"], "ssmspec default": default}}
    monkeypatch.setattr(hooks, "load", lambda name: changed if name == "e2e_defaults" else load(name))
    assert hooks.readme_block(README.read_text(), "speed-table") != hooks.speed_summary()


def test_readme_is_a_landing_page():
    text = README.read_text()
    assert hooks.words(text) <= hooks.MAX_README_WORDS
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text
    hooks.check_page(hooks.readme_without_blocks(text), "README.md", length=hooks.words(text))
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to a missing file: {target}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_docs_pages_follow_the_rules(page):
    hooks.check_page(page.read_text(), str(page.relative_to(ROOT)))


def test_nothing_in_the_readme_or_docs_is_about_the_projects_history():
    hits = []
    for path in [README, ROOT / "mkdocs.yml", *sorted(DOCS.rglob("*"))]:
        if path.is_file() and path.suffix in {".md", ".py", ".json", ".css", ".svg", ".yml"}:
            hits += [f"{path.relative_to(ROOT)}: {hit}" for hit in hooks.history_words(path.read_text())]
    assert not hits, hits


def test_every_figure_a_page_cites_is_in_the_data():
    data_directives = {"bench", "batched", "batched-gpu", "provenance", "plot", "speed-summary"}
    for page in PAGES:
        text = hooks._FENCE.sub("", page.read_text())
        for m in hooks._PLACEHOLDER.finditer(text):
            if m.group(1) != "code":  # the code's values: the docs build renders them
                hooks.placeholder(*m.groups())
        for m in hooks._DIRECTIVE.finditer(text):
            if m.group(1) in data_directives:
                hooks.render(m.group(0), str(page))


def test_plots_are_drawn_from_the_data_as_svg():
    for kind, arg in [("prompt-sets", ""), ("batches", ""), ("tree-vs-chain", ""), ("methods", "e2e"),
                      ("verify-cost", "verify_cost_embedded=a;verify_cost_mamba2_24x768=b")]:  # fmt: skip
        rendered = hooks.render(f"<!-- ssmspec:plot {kind} {arg} -->".replace("  ", " "), kind)
        svg = re.search(r"<svg .*?</svg>", rendered, re.S)
        assert svg is not None, kind
        ET.fromstring(svg.group(0))  # well-formed
        assert "docs/data/" in rendered  # says where its data came from


def test_the_rules_catch_what_they_are_for():
    for typed in ("The default runs 1.9x faster.", "It reached 480 tok/s.", "A step takes 5.5 ms here.",
                  "2.07× HF greedy", "Compiling takes 30 s."):  # fmt: skip
        with pytest.raises(ValueError, match="hand-typed"):
            hooks.check_page(typed, "page.md")
    with pytest.raises(ValueError, match="history"):
        hooks.check_page(" ".join(["Measured in", "stop", "43."]), "page.md")
    with pytest.raises(ValueError, match="words"):
        hooks.check_page("word " * (hooks.MAX_PAGE_WORDS + 1), "page.md")
    with pytest.raises(ValueError, match="no `nope`"):
        hooks.placeholder("e2e", "methods/nope/speedup_vs_hf", "x")
    # what is allowed: figures from the data, code, shapes and counts
    hooks.check_page("It gives {{ e2e: methods/HF greedy/speedup_vs_hf | x }} on a 24 x 768 model, 16 nodes, "
                     "`ssmspec bench --repeats 2`, torch 2.13.\n\n```\n1.9x\n```\n", "page.md")  # fmt: skip


def test_placeholders_format_values_and_ranges():
    default = hooks.load("e2e_defaults")["methods"]["ssmspec default"]["speedup_vs_hf"]
    assert hooks.placeholder("e2e_defaults", "methods/ssmspec default/speedup_vs_hf", "x") == f"{default:.2f}x"
    assert hooks.fmt([1.344, 1.63], "x") == "1.34–1.63x"
    assert hooks.fmt(0.5, "pct") == "50 %"
    batches = hooks.lookup(hooks.load("batched"), "batches/*/ssmspec default/speedup_vs_hf")
    assert len(batches) == len(hooks.load("batched")["batches"])


def test_a_code_value_that_is_none_fails_the_build_instead_of_rendering_a_blank():
    """`{{ code: ssmspec.SpecConfig.tree_budget }}` rendered "–" once the default moved into speculate/defaults.py:
    a value the code leaves None is refused, naming the placeholder; the pages read the resolved defaults."""
    with pytest.raises(ValueError, match="SpecConfig.tree_budget .* is None"):
        hooks.placeholder("code", "ssmspec.SpecConfig.tree_budget")
    from ssmspec.speculate.defaults import NGRAM

    assert hooks.placeholder("code", "ssmspec.speculate.defaults.NGRAM.tree_budget") == str(NGRAM.tree_budget)


# statements a page must not make while the code does the opposite: (what, pattern, whether the code contradicts it)
def _captures_steps() -> bool:
    import dataclasses

    from ssmspec import SpecConfig
    from ssmspec.speculate.runner import ModelRunner

    return "graphs" in {f.name for f in dataclasses.fields(SpecConfig)} and hasattr(ModelRunner, "verify_greedy")


def _default_drafts_with_mtp() -> bool:
    from ssmspec.speculate import plan

    return plan.HEAD_MAX_SHARE > 0


CONTRADICTIONS = [
    ("the engine does not capture its steps", r"(?:does not|doesn't|never) capture (?:its|the|a)? ?steps?"
     r"|does not capture it\b|no captured steps", _captures_steps),
    ("an MTP layer is opt-in", r"MTP[^.\n]{0,80}\bopt-in|opt-in[^.\n]{0,80}\bMTP", _default_drafts_with_mtp),
]  # fmt: skip


@pytest.mark.parametrize("what, pattern, contradicted", CONTRADICTIONS, ids=[c[0] for c in CONTRADICTIONS])
def test_no_page_states_the_opposite_of_what_the_code_does(what, pattern, contradicted):
    """A page that says what the code no longer does (the engine captures its steps; the default drafts with a small
    MTP layer) fails here, naming the page and the words."""
    assert contradicted(), f"the code no longer does the opposite of '{what}': drop or invert this check"
    hits = []
    for path in [README, *PAGES]:
        text = " ".join(path.read_text().split())
        hits += [f"{path.relative_to(ROOT)}: ...{text[max(0, m.start() - 60) : m.end() + 40]}..."
                 for m in re.finditer(pattern, text, re.I)]  # fmt: skip
    assert not hits, f"pages say {what!r}, which the code contradicts: {hits}"


def test_a_contradiction_is_found_where_a_page_makes_it():
    text = "Fused kernels are next. The ssmspec step can be captured, but the engine does not capture its steps yet."
    assert re.search(CONTRADICTIONS[0][1], text, re.I)
    assert re.search(CONTRADICTIONS[1][1], "Drafting with an MTP layer is opt-in: pass drafter='mtp'.", re.I)


def test_the_readme_compares_sampling_with_the_fastest_plain_decoder_of_its_run():
    """The sampling rows' "over the fastest plain decoder" is the default's rate over the best of HF's sampling and
    ssmspec's plain decoding at that temperature, not a blank."""
    data = hooks.load("e2e_defaults")
    table = hooks.speed_summary().splitlines()
    for t in ("0.7", "1.0"):
        rates = {k: v["tokens_per_s"] for k, v in data["sampling"]["temperatures"][t].items()}
        want = rates["ssmspec default"] / max(rates["HF sampling"], rates["ssmspec autoregressive"])
        row = next(line for line in table if f"temperature {t}" in line)
        assert row.split("|")[4].strip() == hooks.fmt(want, "x")


def test_the_readmes_llamacpp_rows_compare_with_llamacpps_plain_decoding_too():
    """In a run that timed llama.cpp beside ssmspec, "over the fastest plain decoder" counts llama.cpp's plain decoding
    among the plain decoders, at the row's own rate (a decoding rate against decoding rates, llama-bench's included;
    a whole call's against whole calls)."""
    table = hooks.speed_summary().splitlines()
    for what, name, model, method, key in (
        ("Default call, compiled", "llamacpp", "mamba2-target", "ssmspec default (compiled)", "tokens_per_s"),
        ("Plain decoding, compiled", "llamacpp", "mamba2-target", "ssmspec plain (compiled)", "decode_tokens_per_s"),
        ("19.6M medium model", "llamacpp_medium", "nemotron-medium", "ssmspec default (compiled)",
         "decode_tokens_per_s"),
    ):  # fmt: skip
        rows = {r["method"]: r for m in hooks.load(name)["models"] if m["model"] == model for r in m["rows"]}
        assert {"llama.cpp (llama-bench)", "llama.cpp (Python bindings)"} <= set(rows)
        plains = [
            r[key]
            for m, r in rows.items()
            if "plain" in m or m.startswith(("HF", "llama.cpp"))
            if not (key == "tokens_per_s" and m == "llama.cpp (llama-bench)")
        ]  # (llama-bench: no whole call)
        row = next(line for line in table if line.startswith(f"| {what}"))
        assert row.split("|")[4].strip() == hooks.fmt(rows[method][key] / max(plains), "x")


# terms a reader may not know, the glossary's section for each, and the pages that define them where they are used
GLOSSARY_TERMS = {
    "kernel seam": ("kernel-seam", {"explanation/how-it-works.md", "explanation/generic-path.md"}),
    "GDN": ("gdn-kda", set()),
    "KDA": ("gdn-kda", {"explanation/how-it-works.md"}),
    "RASD": ("rasd", {"guides/draft-model.md"}),
    "DySpec": ("dyspec", {"guides/draft-model.md"}),
    "Saguaro": ("saguaro", {"guides/drafters.md"}),
    "VocabTrim": ("vocabtrim", {"guides/draft-model.md"}),
    "op tape": ("op-tape", {"guides/compile.md"}),
    "near-tie": ("near-tie", set()),
}


FIRST_USE = 150  # characters from a term's first use to its glossary link at most


def test_every_page_that_uses_a_term_of_the_glossary_links_it():
    """The glossary has a section for each term, and a page that uses one in its prose (not in code) links to that
    section at the term's first use, unless the page is where the term is defined."""
    glossary = (DOCS / "reference" / "glossary.md").read_text()
    missing = []
    for term, (anchor, homes) in GLOSSARY_TERMS.items():
        assert any(re.sub(r"[^\w]+", "-", h.lower()).strip("-") == anchor
                   for h in re.findall(r"^## (.+)$", glossary, re.M)), f"no glossary section #{anchor}"  # fmt: skip
        for path in [README, *PAGES]:
            name = str(path.relative_to(DOCS)) if path != README else "README.md"
            if name in homes or name == "reference/glossary.md":
                continue
            prose = re.sub(r"`[^`\n]*`", "", hooks._FENCE.sub("", path.read_text()))
            prose = re.sub(r"^(?:    |#).*$", "", prose, flags=re.M)  # (indented code, headings)
            prose = re.sub(r"\[[^\]]*\]\((?!\S*glossary\.md)[^)]*\)", "", prose)  # (other links' texts)
            first = re.search(rf"(?<![\w-]){re.escape(term)}", prose)
            link = prose.find(f"glossary.md#{anchor}")
            # linked by its first use: the link's text is that use, the link follows it within the sentence, or it came
            # before (a section shared with another term: GDN and KDA)
            if first and (link < 0 or link - first.start() > FIRST_USE):
                missing.append(f"{name}: {term}")
    assert not missing, f"pages using a glossary term without linking it at its first use: {missing}"


def test_the_readmes_gpu_rows_never_hide_a_faster_compiled_decoder():
    """A GPU row's "over the fastest plain decoder" names a run that timed compiled plain decoding, or its label says
    the run compiled nothing; and the default call compiled on a GPU is shown against the fastest plain decoder of the
    same run, HF's compiled decoding among them."""
    rows = [r for r in hooks.SPEED_SUMMARY if "GPU" in r[0]]
    assert rows
    for what, name, *_ in rows:
        text = json.dumps(hooks.load(name))
        assert "(compiled)" in text or "nothing compiled" in what, what
    compiled = next(r for r in rows if r[0] == "Default call on a GPU, compiled")
    data = hooks.load(compiled[1])["quick"]["rows"]
    assert "tokens_per_s" in data["HF greedy (compiled)"]
    best_plain = max(v["tokens_per_s"] for k, v in data.items() if k.startswith("HF") or "plain" in k)
    method = compiled[2].split("/")[2]
    assert hooks.lookup(hooks.load(compiled[1]), compiled[4]) == pytest.approx(
        data[method]["tokens_per_s"] / best_plain
    )


def test_the_history_check_reads_rendered_pages_too():
    """The build checks each rendered page's text (what data files render into it included) for words about the
    project's history, not the markup: a note rendered from a data file is caught."""
    word = "sess" + "ion"  # (split: this file is checked too)
    assert hooks.rendered_history(f"<p>Measured in one {word} of the GPU.</p>")
    assert not hooks.rendered_history(f'<a class="{word}-x" href="#">a link</a><p>Measured on the GPU.</p>')
    assert not hooks.rendered_history(f"<script>var {word} = 1;</script><p>text</p>")
    for note in ("A device call limited in time ran it in parts.", "Rows past the call limit were not measured."):
        assert hooks.rendered_history(f"<p>{note}</p>"), note


def _data_dir(tmp_path, monkeypatch, **files: dict) -> None:
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    monkeypatch.setattr(hooks, "DATA", tmp_path)
    monkeypatch.setattr(hooks._registry(), "DATA", tmp_path)


def test_every_data_file_is_listed_with_its_command_and_cutoff():
    registry = hooks._registry()
    assert {p.stem for p in (DOCS / "data").glob("*.json")} == set(registry.FILES)
    for name, entry in registry.FILES.items():
        assert entry.needs in ("cpu", "cuda", "llama.cpp"), name
        assert entry.cutoff in registry.DATES, f"{name}: cut-off {entry.cutoff} has no date"
        day = registry.subprocess.run(["git", "-C", str(ROOT), "show", "-s", "--format=%as", entry.cutoff],
                                      capture_output=True, text=True).stdout.strip()  # fmt: skip
        assert day in ("", registry.DATES[entry.cutoff]), f"{entry.cutoff} is dated {day} in the history"


def test_the_data_check_fails_on_a_file_without_provenance_or_older_than_its_cutoff(tmp_path, monkeypatch):
    registry = hooks._registry()
    head = registry.subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                   text=True).stdout.strip()  # fmt: skip
    fresh = {"date": "2026-11-28", "machine": "a CPU", "torch": "2.13.0+cpu", "transformers": "5.23.0",
             "command": "python benchmarks/x.py", "revision": head}  # fmt: skip
    before = registry.subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", registry.LOOP + "~1"],
                                     capture_output=True, text=True).stdout.strip()  # fmt: skip
    _data_dir(tmp_path, monkeypatch, e2e=fresh)
    hooks.check_data()  # a fresh file passes
    _data_dir(tmp_path, monkeypatch, e2e={k: v for k, v in fresh.items() if k != "revision"})
    with pytest.raises(ValueError, match="e2e.json: records no revision"):
        hooks.check_data()
    _data_dir(tmp_path, monkeypatch, e2e={k: v for k, v in fresh.items() if k != "transformers"})
    with pytest.raises(ValueError, match="e2e.json: records no transformers"):
        hooks.check_data()
    _data_dir(tmp_path, monkeypatch, e2e={**fresh, "revision": before, "date": "2026-11-01"})
    with pytest.raises(ValueError, match=f"e2e.json: measured on code older than {registry.LOOP}"):
        hooks.check_data()
    (tmp_path / "e2e.json").unlink()
    _data_dir(tmp_path, monkeypatch, unlisted=fresh)
    with pytest.raises(ValueError, match="unlisted.json: not listed in benchmarks/all.py"):
        hooks.check_data()


def test_all_py_reruns_what_the_docs_build_rejects_also_without_the_history(tmp_path, monkeypatch):
    """benchmarks/all.py's stale files are the ones the data check rejects as older than their cut-off: by git
    ancestry, and by the cut-off's recorded date where git cannot tell (a checkout without the history)."""
    registry = hooks._registry()
    old = {"date": "2026-11-01", "machine": "a CPU", "torch": "2.13.0+cpu", "transformers": "5.23.0",
           "command": "python benchmarks/x.py", "revision": "0000000"}  # fmt: skip
    new = {**old, "date": registry.DATES[registry.LOOP]}
    monkeypatch.setattr(registry, "includes", lambda revision, cutoff, **_: None)  # (git cannot tell)
    for data, rejected in ((old, True), (new, False)):
        _data_dir(tmp_path, monkeypatch, e2e=data)
        assert registry.stale("e2e") is rejected
        if rejected:
            with pytest.raises(ValueError, match="e2e.json: measured on code older than"):
                hooks.check_data()
        else:
            hooks.check_data()


def test_a_gpu_file_older_than_its_cutoff_passes_only_saying_so_on_its_page(tmp_path, monkeypatch):
    registry = hooks._registry()
    assert registry.FILES["batched_gpu"].needs == "cuda"
    old = {"date": "2026-11-26", "machine": "NVIDIA H100", "torch": "2.11.0+cu130", "transformers": "5.23.0",
           "command": "ssmspec bench --device cuda", "revision": "3d8db7b"}  # fmt: skip
    _data_dir(tmp_path, monkeypatch, batched_gpu=old)
    hooks.check_data()
    line = hooks.provenance("batched_gpu", old)
    assert f"measured on code older than `{registry.LOOP}`" in line and "needs a CUDA GPU" in line
    fresh_line = hooks.provenance("e2e", {**old, "revision": registry.LOOP})
    assert "older" not in fresh_line


def test_a_rendered_table_cell_without_a_value_fails_the_build():
    """A table cell that shows a blank, a dash or None where a value belongs fails the build (a default that is None
    in code is a value); the tables the hooks render say what a missing value means ("not measured")."""
    page = ("<table><thead><tr><th>field</th><th>default</th><th>x HF</th></tr></thead><tbody>"
            "<tr><td>a</td><td><code>None</code></td><td>1.20x</td></tr>"
            "<tr><td>b</td><td>None</td><td>–</td></tr><tr><td>c</td><td></td><td>not measured</td></tr>"
            "</tbody></table>")  # fmt: skip
    assert hooks.rendered_blanks(page) == ["b: default", "b: x HF", "c: default"]
    assert hooks.fmt(None) == "not measured"
    table = hooks._bench("e2e")
    assert "| – |" not in table and "|  |" not in table
    hf_row = next(line for line in table.splitlines() if line.startswith("| HF greedy |"))
    assert "one token a step" in hf_row
