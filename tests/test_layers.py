"""The layer rule of ARCHITECTURE.md: gpufail -> serving -> models -> features -> ingest.
A package may import only packages to its right, and nothing imports gpufail."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
LAYERS = ["gpufail", "serving", "models", "features", "ingest"]


def imported_top_level_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_each_package_imports_only_packages_to_its_right():
    violations = []
    for rank, package in enumerate(LAYERS):
        allowed = set(LAYERS[rank:])
        for path in (ROOT / package).rglob("*.py"):
            for imported in imported_top_level_packages(path) & set(LAYERS):
                if imported not in allowed:
                    violations.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert violations == []


def test_the_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from serving.score import x\nimport gpufail.cli\n")
    assert imported_top_level_packages(bad) == {"serving", "gpufail"}
