"""The layer rule (docs/architecture.md): gpufail -> serving -> models -> features -> ingest. A
package imports only packages to its right, nothing imports gpufail, and no package of the
product imports the benchmarks or the tests, which sit above every layer.

An import counts wherever it is written: an import statement, a string of Python code a module
hands to another interpreter (`python -c CODE`, a child process's source), a module run as
`-m NAME`, or a name given to `importlib.import_module` / `__import__`. lint-imports (`make
lint`) sees only the statements."""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
LAYERS = ["gpufail", "serving", "models", "features", "ingest"]
ABOVE_THE_LAYERS = ["benchmarks", "tests"]
CHECKED = set(LAYERS) | set(ABOVE_THE_LAYERS)


def imported_modules(source: str) -> set[str]:
    """Every module `source` imports, in statements or in the code strings and module names it
    hands on (module notes)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found |= _code_string_imports(node.value)
        elif isinstance(node, ast.List | ast.Tuple):
            found |= _run_as_module(node.elts)
        elif isinstance(node, ast.Call) and _calls_an_importer(node) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.add(first.value)
    return found


def _code_string_imports(text: str) -> set[str]:
    """The imports of a string that is Python code with an import in it (most strings do not
    parse, and those that do without an import, a name or a number, import nothing)."""
    if "import" not in text:
        return set()
    try:
        return imported_modules(text)
    except (SyntaxError, ValueError):
        return set()


def _run_as_module(items: list[ast.expr]) -> set[str]:
    """NAME in an argument list [..., "-m", "NAME", ...]."""
    strings = [item.value if isinstance(item, ast.Constant) else None for item in items]
    return {name for flag, name in pairwise(strings) if flag == "-m" and isinstance(name, str)}


def _calls_an_importer(call: ast.Call) -> bool:
    function = call.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    return name in ("import_module", "__import__")


def imported_top_level_packages(path: Path) -> set[str]:
    return {module.split(".")[0] for module in imported_modules(path.read_text(encoding="utf-8"))}


def violations(root: Path) -> list[str]:
    found = []
    for rank, package in enumerate(LAYERS):
        allowed = set(LAYERS[rank:])
        for path in sorted((root / package).rglob("*.py")):
            for imported in sorted(imported_top_level_packages(path) & CHECKED - allowed):
                found.append(f"{path.relative_to(root)} imports {imported}")
    return found


def test_each_package_imports_only_packages_to_its_right():
    assert violations(ROOT) == []


@pytest.mark.parametrize(
    ("source", "packages"),
    [
        ("from serving.score import x\nimport gpufail.cli\n", {"serving", "gpufail"}),
        # A child's source handed to `python -c`, one string or line by line.
        ('CHILD = "import sys\\nfrom gpufail.cli import main\\nmain()\\n"', {"sys", "gpufail"}),
        ('lines = ["import os", "from benchmarks.api_load import main"]', {"os", "benchmarks"}),
        ('subprocess.run([sys.executable, "-c", "import tests.fakes; print(1)"])', {"tests"}),
        ('subprocess.run([sys.executable, "-m", "gpufail.cli", "serve"])', {"gpufail"}),
        ('importlib.import_module("serving.api")', {"serving"}),
        ('__import__("models.train")', {"models"}),
        # Prose that mentions importing is not code; a relative import stays in its package.
        ('"""Import the rows, then score them."""\nfrom . import sibling', set()),
        ('MESSAGE = "run `gpufail import` first"', set()),
    ],
)
def test_the_checker_sees_an_import_wherever_it_is_written(tmp_path, source, packages):
    path = tmp_path / "module.py"
    path.write_text(source)
    assert imported_top_level_packages(path) == packages


def test_a_code_string_that_imports_upward_is_a_violation(tmp_path):
    for package in LAYERS:
        (tmp_path / package).mkdir()
    (tmp_path / "serving" / "bench.py").write_text(
        'import subprocess, sys\nSERVE = "from gpufail.cli import main; main()"\n'
        'subprocess.run([sys.executable, "-c", SERVE])\n'
    )
    (tmp_path / "ingest" / "probe.py").write_text('ARGS = ["python", "-m", "benchmarks.kernel_log_parse"]\n')
    (tmp_path / "models" / "fine.py").write_text('CODE = "import features.build, ingest.store"\n')
    assert violations(tmp_path) == ["serving/bench.py imports gpufail", "ingest/probe.py imports benchmarks"]
