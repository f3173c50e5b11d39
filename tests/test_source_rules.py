"""Rules the source keeps, checked on its syntax tree: short functions (a reader finds a call's decisions in one
plan, not in a long function), and each refusal message written once (a refusal raised in two places cannot drift)."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import ssmspec

SOURCE = Path(ssmspec.__file__).parent
MAX_FUNCTION_LINES = 80
MAX_GENERATE_LINES = 40


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """Lines of code in a function's body: no docstring, blank lines or comment lines."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    if not body:
        return 0
    spanned = range(body[0].lineno, body[-1].end_lineno + 1)
    return sum(1 for n in spanned if lines[n - 1].strip() and not lines[n - 1].strip().startswith("#"))


def _functions(root: Path = SOURCE):
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{path.relative_to(root)}:{node.lineno} {node.name}", _code_lines(node, lines)


def test_no_function_is_over_80_lines_and_generate_under_40():
    long = {where: n for where, n in _functions() if n > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code: {long}"
    generate = [n for where, n in _functions() if where.startswith("speculate/generate.py") and "generate" in where]
    assert generate and max(generate) < MAX_GENERATE_LINES


def _messages(root: Path = SOURCE):
    """(message, where) of every string raised: literal text of f-strings, placeholders as {}."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            parts = {id(v) for sub in ast.walk(node.exc) if isinstance(sub, ast.JoinedStr) for v in sub.values}
            for sub in ast.walk(node.exc):
                if id(sub) in parts:  # (an f-string's literal pieces: the f-string is the message)
                    continue
                if isinstance(sub, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in sub.values)
                elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    text = sub.value
                else:
                    continue
                yield text, f"{path.relative_to(root)}:{sub.lineno}"


def _repeated(root: Path = SOURCE) -> dict[str, list[str]]:
    places = collections.defaultdict(set)
    for text, where in _messages(root):
        if len(text) >= 30:  # (short fragments such as "{} is " say nothing alone)
            places[text].add(where)
    return {text: sorted(where) for text, where in places.items() if len(where) > 1}


def test_each_refusal_message_is_written_once():
    repeated = _repeated()
    assert not repeated, f"refusals written in more than one place: {repeated}"


def test_the_rules_see_what_they_check(tmp_path):
    """The scans find a long function and a message raised twice where there are (they can fail); a docstring,
    comments and blank lines do not count."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    (tmp_path / "a.py").write_text(f'def long():\n    """Doc."""\n    # note\n\n{body}\n')
    (tmp_path / "b.py").write_text(
        "def one(a):\n    raise ValueError(f'a setting must be positive here, got {a}')\n\n\n"
        "def two(b):\n    raise ValueError(f'a setting must be positive here, got {b!r}')\n"
    )
    assert dict(_functions(tmp_path))["a.py:1 long"] == MAX_FUNCTION_LINES + 1
    assert _repeated(tmp_path) == {"a setting must be positive here, got {}": ["b.py:2", "b.py:6"]}


def test_the_package_version_is_the_projects():
    """`ssmspec.__version__` (kept in ssmspec/_version.py, which calibrations on disk are keyed by) is pyproject's."""
    import re

    pyproject = (SOURCE.parent / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == ssmspec.__version__


# the package's layers, lowest first: a module imports only from layers below its own (docs: How it works)
LAYERS = (
    ("errors", "_version", "static", "compiled", "models", "linear"),
    ("ops", "tree"),
    ("kernels", "verification"),
    ("compile", "hf"),
    ("speculate",),
    ("probe",),
    ("transform",),
    ("ssmspec",),  # the package's own __init__: its public names
    ("bench", "testing"),
    ("cli",),
    ("__main__",),
)


def _unit(module: str) -> str:
    """The layer unit of a module name: the top-level module or package under ssmspec, or "ssmspec" itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return "ssmspec"
    name = parts[1]
    return name if (SOURCE / name).is_dir() or (SOURCE / f"{name}.py").exists() else "ssmspec"


def _imports(root: Path = SOURCE):
    """(importing unit, imported unit, where) for every import of ssmspec inside ssmspec, functions' own included."""
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("ssmspec", *path.relative_to(root).with_suffix("").parts))
        source = _unit(module.removesuffix(".__init__"))
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ssmspec"):
                names = [node.module] if node.module != "ssmspec" else [f"ssmspec.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "ssmspec"]
            for name in names:
                if _unit(name) != source:
                    yield source, _unit(name), f"{path.relative_to(root)}:{node.lineno}"


def test_imports_point_down_the_layers():
    floor = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    units = {_unit(f"ssmspec.{p.stem}") for p in SOURCE.iterdir() if p.suffix == ".py" or p.is_dir()}
    units -= {"ssmspec", "__init__", "__pycache__"}
    assert units <= set(floor), f"modules without a layer: {sorted(units - set(floor))}"
    up = [(a, b, where) for a, b, where in _imports() if floor[b] >= floor[a]]
    assert not up, f"imports that do not point down: {up}"
