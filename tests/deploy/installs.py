"""What an install of gpufail with some extras holds, from the installed package metadata, and a
way to run Python as if only that were installed: a meta path finder that refuses every module
of the other distributions installed here (the development venv has them all)."""

from __future__ import annotations

import importlib.metadata as md
import json
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(extras: Iterable[str]) -> set[str]:
    """The canonical names of the distributions `pip install gpufail[extras]` installs."""
    found: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [("gpufail", frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key in found and not wanted:
            continue
        found.add(key)
        for text in md.requires(name) or []:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (*wanted, "")):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return found


def foreign_modules(extras: Iterable[str]) -> list[str]:
    """Top-level modules installed here that belong to no distribution of `gpufail[extras]`."""
    allowed = closure(extras)
    return sorted(
        module
        for module, dists in md.packages_distributions().items()
        if not {canonicalize_name(d) for d in dists} & allowed
    )


BLOCKER = """
import importlib.abc, json, os, sys
_BLOCKED = frozenset(json.loads(os.environ["TEST_BLOCKED_MODULES"]))
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not in this install)", name=name)
        return None
sys.meta_path.insert(0, _NotInstalled())
"""


def as_installed(extras: Iterable[str], folder: Path) -> dict[str, str]:
    """Environment variables under which every Python process started with them behaves as if
    only `gpufail[extras]` were installed: the blocker runs at interpreter start as a
    `sitecustomize` module written into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return {"PYTHONPATH": str(folder), "TEST_BLOCKED_MODULES": json.dumps(foreign_modules(extras))}
