"""References from the code and the documentation lead to files that are in the repository.

A docstring that says "see docs/evaluation.md" or a README link is only useful if a reader of
this checkout can open it: design notes kept elsewhere, or a page renamed without its links, are
dead ends. Three kinds of reference are checked: markdown links with a relative target,
`docs/<page>.md` mentions, and bare mentions of an upper-case page (`README.md`-style), anywhere in
tracked Python, Markdown and TOML files.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_DOCS_MENTION = re.compile(r"(?<![\w/.-])(docs/[\w.-]+\.md)\b")
_UPPER_MENTION = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]+\.md)\b")


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def dead_links(markdown: str, where: Path) -> list[str]:
    """Relative link targets in `markdown` (a file at `where`) that name no file or folder."""
    dead = []
    for target in _LINK.findall(markdown):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        if not (where.parent / target).exists():
            dead.append(target)
    return dead


def dead_docs_mentions(text: str, names: frozenset[str]) -> list[str]:
    """`docs/<page>.md` mentions in `text` that name no page of this repository's docs/, and
    upper-case page mentions (such as a design note) that name no file in `names` (tracked file names)."""
    dead = [page for page in _DOCS_MENTION.findall(text) if not (ROOT / page).is_file()]
    return dead + [page for page in _UPPER_MENTION.findall(text) if page not in names]


def test_the_checks_find_dead_references(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("x")
    assert dead_links("[a](page.md) [b](missing.md#part) [c](https://example.org/x)", page) == ["missing.md"]
    nowhere, design = "docs/" + "nowhere.md", "DESIGN" + ".md"
    text = f"see docs/evaluation.md, {nowhere}, README.md and {design} 2b"
    assert dead_docs_mentions(text, frozenset({"README.md"})) == [nowhere, design]


@pytest.mark.parametrize("path", _tracked("*.md"), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve(path: Path) -> None:
    assert dead_links(path.read_text(encoding="utf-8"), path) == []


def test_docs_mentions_resolve() -> None:
    files = _tracked("*.py", "*.md", "*.toml")
    names = frozenset(path.name for path in _tracked())
    dead = {
        str(path.relative_to(ROOT)): found
        for path in files
        if (found := dead_docs_mentions(path.read_text(encoding="utf-8"), names))
    }
    assert dead == {}
