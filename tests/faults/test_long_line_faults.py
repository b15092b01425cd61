"""Kernel-log lines far longer than any real one (a crash's run of NUL bytes; a 256 KB `.gz`
holds a 256 MB line): the importer and the live collector cut each line to
`MAX_LINE_BYTES` while reading it, never holding it whole, count the lines cut, and read every
line after it as usual. Memory is measured with `tracemalloc` (Python's own allocations, where
a whole line would be)."""

from __future__ import annotations

import gzip
import tracemalloc
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ingest.collect.log_sources import FileSource
from ingest.kernel_log_import import ingest_kernel_logs
from ingest.kernel_log_parser import MAX_MESSAGE_CHARS
from ingest.line_stream import MAX_LINE_BYTES
from ingest.store import Store

T0 = datetime(2026, 1, 5, tzinfo=UTC)
NODE = "gpu-node-007"
MB = 1 << 20
# Well above the 20 KB of a cut line and the 1 MiB read chunks, well below any long line here.
PEAK_LIMIT = 24 * MB

T = TypeVar("T")


def xid(n: int, message: str = "short") -> bytes:
    moment = T0 + timedelta(hours=n)
    return f"{moment.isoformat()} {NODE} kernel: NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=p, {message}".encode()


def nul_run(length: int) -> Iterator[bytes]:
    """A line of `length` NUL bytes, in pieces."""
    while length > 0:
        piece = min(length, 4 * MB)
        yield b"\0" * piece
        length -= piece


def long_xid(length: int) -> Iterator[bytes]:
    """An Xid line whose message runs to `length` bytes."""
    yield xid(1, "")
    while length > 0:
        piece = min(length, 4 * MB)
        yield b"A" * piece
        length -= piece


# name -> (pieces of the long line, its length)
LONG_LINES: dict[str, tuple[Callable[[int], Iterator[bytes]], int]] = {
    "just over the cap": (nul_run, MAX_LINE_BYTES + 1),
    "5 MB of NUL": (nul_run, 5 * MB),
    "256 MB of NUL": (nul_run, 256 * MB),
    "an Xid line of 64 MB": (long_xid, 64 * MB),
}


def write_log(path: Path, long_line: Iterator[bytes], *, compressed: bool, end_with_newline: bool = True) -> None:
    """Two Xid lines, the long line, two more Xid lines (the last maybe without a newline)."""
    opener: Callable[..., Any] = gzip.open if compressed else open
    with opener(path, "wb") as fh:
        fh.write(xid(0) + b"\n" + xid(2) + b"\n")
        for piece in long_line:
            fh.write(piece)
        fh.write(b"\n" + xid(3) + b"\n" + xid(4) + (b"\n" if end_with_newline else b""))


def peak_of(work: Callable[[], T]) -> tuple[T, int]:
    tracemalloc.start()
    try:
        result = work()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("compressed", [True, False], ids=["gzip", "plain"])
@pytest.mark.parametrize("name", LONG_LINES)
def test_the_importer_cuts_a_long_line_while_reading_and_counts_it(tmp_path: Path, name: str, compressed: bool) -> None:
    pieces, length = LONG_LINES[name]
    if not compressed and length > 8 * MB:
        pytest.skip("a plain file of this size costs disk and time without testing more")
    path = tmp_path / f"{NODE}.log{'.gz' if compressed else ''}"
    write_log(path, pieces(length), compressed=compressed, end_with_newline=False)
    store = Store.create(str(tmp_path / "store"))

    def ingest() -> Any:
        return ingest_kernel_logs(store, [path], cluster="c", dedup_window=timedelta(minutes=5))

    summary, peak = peak_of(ingest)
    assert summary.long_lines == 1
    assert f"1 lines longer than {MAX_LINE_BYTES:,} bytes cut to that length" in str(summary)
    assert summary.lines == 5
    assert peak < PEAK_LIMIT, f"{peak / MB:.0f} MB held while reading a {length / MB:.0f} MB line"
    rows = sorted(store.read("xid_events").to_pylist(), key=lambda r: r["ts"])
    short = [r for r in rows if r["message"] == "short"]
    assert [r["ts"] for r in short] == [T0 + timedelta(hours=h) for h in (0, 2, 3, 4)]
    if pieces is long_xid:
        (cut,) = [r for r in rows if r["message"] != "short"]
        assert cut["message"].startswith("A" * 100) and len(cut["message"]) < MAX_MESSAGE_CHARS + 100
    # Read once: nothing new the second time.
    assert ingest().incidents == 0


@pytest.mark.parametrize("name", ["just over the cap", "5 MB of NUL", "an Xid line of 64 MB"])
def test_the_collector_cuts_a_long_line_while_reading_and_counts_it(tmp_path: Path, name: str) -> None:
    pieces, length = LONG_LINES[name]
    path = tmp_path / "kern.log"
    write_log(path, pieces(length), compressed=False)
    source = FileSource([str(path)])
    chunk, peak = peak_of(lambda: source.read(None, 100))
    assert chunk.cut == 1
    assert len(chunk.lines) == 5 and max(len(line) for line in chunk.lines) <= MAX_LINE_BYTES
    assert [line for line in chunk.lines if "short" in line] == [xid(h).decode() for h in (0, 2, 3, 4)]
    assert peak < PEAK_LIMIT, f"{peak / MB:.0f} MB held while reading a {length / MB:.0f} MB line"
    # In pieces of one line a read, the cut line is counted once.
    cuts, cursor, lines = 0, None, []
    for _ in range(10):
        part = source.read(cursor, 1)
        cuts, cursor, lines = cuts + part.cut, part.cursor, lines + part.lines
    assert cuts == 1 and lines == chunk.lines


def test_the_collector_leaves_a_long_line_still_being_written_unread_and_unheld(tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    with path.open("wb") as fh:
        fh.write(xid(0) + b"\n")
        for piece in nul_run(48 * MB):  # no newline yet
            fh.write(piece)
    source = FileSource([str(path)])
    chunk, peak = peak_of(lambda: source.read(None, 100))
    assert chunk.lines == [xid(0).decode()] and chunk.cut == 0
    assert peak < PEAK_LIMIT
    with path.open("ab") as fh:
        fh.write(b"\n" + xid(1) + b"\n")
    later = source.read(chunk.cursor, 100)
    assert later.cut == 1 and later.lines[1:] == [xid(1).decode()]
