"""`gpufail ingest kernel-log` under log rotation: every scheme logrotate has (rename, compress,
`delaycompress`, `dateext`, `copytruncate`), copies of rotated files at another path or under
another name, for logs whose lines name their host and for logs named after their node.

Each scenario writes lines over several rotation cycles, with lines appended after a run and
before the rotation (so that a rotated file holds a tail not yet read), and ingests the whole
folder after every cycle, as the nightly does. Every line is its own incident (they lie hours
apart), so the store must end with exactly one row per line written: none lost, none doubled."""

from __future__ import annotations

import gzip
import os
import shutil
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ingest.kernel_log_import import ingest_kernel_logs
from ingest.store import Store

T0 = datetime(2026, 1, 5, tzinfo=UTC)
NODE = "gpu-node-007"
CYCLES = 4
LINES_PER_STEP = 3


def hosted_line(n: int) -> str:
    """RFC 3339 syslog: the line names its host."""
    moment = T0 + timedelta(hours=n)
    return f"{moment.isoformat()} {NODE} kernel: NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=python3, line {n}\n"


def hostless_line(n: int) -> str:
    """`dmesg --time-format=iso`: no host, the node comes from the file name."""
    moment = T0 + timedelta(hours=n)
    return f"{moment.isoformat()} NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=python3, line {n}\n"


class Log:
    """A log being written and rotated in `folder`, as logrotate would leave it."""

    def __init__(self, folder: Path, name: str, line: Callable[[int], str]) -> None:
        self.folder, self.name, self.line = folder, name, line
        self.written = 0
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).touch()

    @property
    def live(self) -> Path:
        return self.folder / self.name

    def append(self) -> None:
        with self.live.open("a") as fh:
            for _ in range(LINES_PER_STEP):
                fh.write(self.line(self.written))
                self.written += 1


def gzip_file(source: Path, target: Path) -> None:
    with source.open("rb") as src, gzip.open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
    source.unlink()


def shift(log: Log, keep: int = 9) -> None:
    """Rotated files move one place up: name.1 -> name.2.gz (compressed on the way), name.2.gz
    -> name.3.gz, ..."""
    for n in range(keep, 0, -1):
        target = log.folder / f"{log.name}.{n + 1}.gz"
        if (compressed := log.folder / f"{log.name}.{n}.gz").exists():
            compressed.rename(target)
        elif (plain := log.folder / f"{log.name}.{n}").exists():
            gzip_file(plain, target)


def rotate_rename(log: Log, cycle: int) -> None:
    """`create`, no compression of the newest: name -> name.1; name.1 -> name.2.gz."""
    shift(log)
    log.live.rename(log.folder / f"{log.name}.1")
    log.live.touch()


def rotate_compress(log: Log, cycle: int) -> None:
    """`compress` without `delaycompress`: name -> name.1.gz at once."""
    shift(log)
    gzip_file(log.live, log.folder / f"{log.name}.1.gz")
    log.live.touch()


def rotate_dateext(log: Log, cycle: int) -> None:
    """`dateext` with an hourly `dateformat` and `delaycompress`: name -> name-YYYYMMDDHH; the
    one before is gzipped."""
    for old in log.folder.glob(f"{log.name}-*"):
        if not old.name.endswith(".gz"):
            gzip_file(old, old.with_name(old.name + ".gz"))
    log.live.rename(log.folder / f"{log.name}-{(T0 + timedelta(hours=cycle)):%Y%m%d%H}")
    log.live.touch()


def rotate_copytruncate(log: Log, cycle: int) -> None:
    """`copytruncate` with `delaycompress`: name copied to name.1, then emptied in place."""
    shift(log)
    shutil.copy2(log.live, log.folder / f"{log.name}.1")
    with log.live.open("r+") as fh:
        fh.truncate(0)


SCHEMES = {
    "rename": rotate_rename,
    "compress": rotate_compress,
    "dateext": rotate_dateext,
    "copytruncate": rotate_copytruncate,
}

FORMATS = {"hosted": ("syslog", hosted_line), "hostless": (f"{NODE}.log", hostless_line)}


def ingest(store: Store, *folders: Path) -> None:
    paths = sorted(p for folder in folders if folder.exists() for p in folder.iterdir() if p.is_file())
    ingest_kernel_logs(store, paths, cluster="c", dedup_window=timedelta(minutes=5))


def assert_each_line_once(store: Store, log: Log) -> None:
    rows = store.read("xid_events").to_pylist() if store.exists("xid_events") else []
    got = sorted(r["message"] for r in rows)
    want = sorted(f"line {n}" for n in range(log.written))
    doubled = sorted({m for m in got if got.count(m) > 1})
    assert not doubled, f"read twice: {doubled[:5]}"
    assert got == want
    assert {r["node"] for r in rows} == {NODE}
    assert sum(r["repeat_count"] for r in rows) == log.written


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_rotation_scheme_ingests_every_line_once(tmp_path: Path, scheme: str, fmt: str) -> None:
    store = Store.create(str(tmp_path / "store"))
    name, line = FORMATS[fmt]
    log = Log(tmp_path / "logs", name, line)
    for cycle in range(CYCLES):
        log.append()
        ingest(store, log.folder)
        log.append()  # written after the run, before the rotation: only the rotated file has it
        SCHEMES[scheme](log, cycle)
        log.append()
        ingest(store, log.folder)
    assert_each_line_once(store, log)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rotated_file_copied_to_another_folder_is_not_read_again(tmp_path: Path, fmt: str) -> None:
    # An archive job copies the rotated files elsewhere; both folders are given to the importer.
    store = Store.create(str(tmp_path / "store"))
    name, line = FORMATS[fmt]
    log = Log(tmp_path / "logs", name, line)
    archive = tmp_path / "archive"
    for cycle in range(CYCLES):
        log.append()
        ingest(store, log.folder, *archive.glob("*"))
        rotate_rename(log, cycle)
        # A dated folder per cycle, each rotated file gzipped there.
        (archive / str(cycle)).mkdir(parents=True)
        for rotated in log.folder.glob(f"{name}.*"):
            target = archive / str(cycle) / rotated.name
            if rotated.name.endswith(".gz"):
                shutil.copy2(rotated, target)
            else:
                with rotated.open("rb") as src, gzip.open(target.with_name(target.name + ".gz"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
        log.append()
        ingest(store, log.folder, *archive.glob("*"))
    assert_each_line_once(store, log)


def test_a_copy_under_another_name_in_the_same_run_is_read_once(tmp_path: Path) -> None:
    # The lines name their host, so the content is the same incidents whatever the file's name.
    store = Store.create(str(tmp_path / "store"))
    log = Log(tmp_path / "logs", "syslog", hosted_line)
    log.append()
    log.append()
    shutil.copy2(log.live, log.folder / "kern-backup.txt")
    gzip_file(shutil.copy2(log.live, tmp_path / "saved"), log.folder / "old-syslog.gz")  # type: ignore[arg-type]
    ingest(store, log.folder)
    ingest(store, log.folder)
    assert_each_line_once(store, log)


def test_logs_of_two_nodes_with_the_same_text_are_both_read(tmp_path: Path) -> None:
    # Lines without a host take their node from the file name: the same text in two nodes'
    # files is two nodes' incidents, not a copy.
    store = Store.create(str(tmp_path / "store"))
    folder = tmp_path / "logs"
    folder.mkdir()
    text = "".join(hostless_line(n) for n in range(3))
    for node in ("gpu-node-001", "gpu-node-002"):
        (folder / f"{node}.log").write_text(text)
        os.utime(folder / f"{node}.log", (T0.timestamp(), T0.timestamp()))
    ingest(store, folder)
    (folder / "gpu-node-001.log").rename(folder / "gpu-node-001.log.1")
    ingest(store, folder)
    rows = store.read("xid_events").to_pylist()
    assert sorted((r["node"], r["message"]) for r in rows) == sorted(
        (node, f"line {n}") for node in ("gpu-node-001", "gpu-node-002") for n in range(3)
    )
