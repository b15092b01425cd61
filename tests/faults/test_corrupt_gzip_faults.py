"""A corrupt or cut `.gz` among good kernel-log files: each way a gzip file breaks (cut short,
cut in its header, bytes flipped in its stream, a wrong checksum, the magic alone) is skipped
and counted, every good file is ingested as in a run without the bad one, the importer's exit
status and the `gpufail_kernel_log_unreadable_files` metric say so, the nightly goes on past
its ingest step, and once the file is repaired its lines are ingested exactly once."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpufail.cli.options import SKIPPED_INPUT_EXIT
from gpufail.nightly import STEPS, NightlyOptions, _Job, run_nightly
from ingest.kernel_log_import import STATE_NAME, ingest_kernel_logs
from ingest.store import Store
from models.train import TrainOptions
from serving.api_metrics import _StoreCollector
from tests.cli import gpufail

T0 = datetime(2026, 1, 5, tzinfo=UTC)
GOOD_NODES = ("gpu-node-001", "gpu-node-002", "gpu-node-003")
BAD_NODE = "gpu-node-009"


def log_text(node: str, lines: int = 4000) -> str:
    """A node's syslog: an Xid line an hour, noise between (so that a gzip of it is well over
    the 64 KiB the resume check reads)."""
    out = []
    for n in range(lines):
        moment = T0 + timedelta(minutes=n)
        if n % 60 == 0:
            out.append(f"{moment.isoformat()} {node} kernel: NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=p, hour {n}\n")
        else:
            out.append(f"{moment.isoformat()} {node} kernel: eth0: link {n:08x} {zlib.crc32(str(n).encode()):08x}\n")
    return "".join(out)


def cut_short(data: bytes) -> bytes:
    return data[: len(data) // 2]


def cut_in_header(data: bytes) -> bytes:
    return data[:6]


def flipped(data: bytes) -> bytes:
    broken = bytearray(data)
    for i in range(int(len(data) * 0.7), int(len(data) * 0.7) + 64):
        broken[i] ^= 0x5A
    return bytes(broken)


def flipped_early(data: bytes) -> bytes:
    broken = bytearray(data)
    for i in range(20, 84):
        broken[i] ^= 0x5A
    return bytes(broken)


def wrong_checksum(data: bytes) -> bytes:
    broken = bytearray(data)
    broken[-8] ^= 0xFF  # the CRC-32 of the trailer
    return bytes(broken)


def magic_alone(data: bytes) -> bytes:
    return data[:2]


BREAKS: dict[str, Callable[[bytes], bytes]] = {
    "cut short": cut_short,
    "cut in its header": cut_in_header,
    "bytes flipped in its stream": flipped,
    "bytes flipped near its start": flipped_early,
    "a wrong checksum": wrong_checksum,
    "the magic alone": magic_alone,
}


def write_logs(folder: Path, broken: Callable[[bytes], bytes] | None) -> Path:
    """Good logs (plain and gzip) and the bad node's gzip, broken by `broken` (good if None)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{GOOD_NODES[0]}.log").write_text(log_text(GOOD_NODES[0]))
    for node in GOOD_NODES[1:]:
        (folder / f"{node}.log.1.gz").write_bytes(gzip.compress(log_text(node).encode()))
    data = gzip.compress(log_text(BAD_NODE).encode())
    bad = folder / f"{BAD_NODE}.log.2.gz"
    bad.write_bytes(data if broken is None else broken(data))
    return bad


def rows(store: Store) -> list[tuple[Any, ...]]:
    table = store.read("xid_events", columns=["ts", "node", "xid", "message", "repeat_count"])
    return sorted(tuple(r.values()) for r in table.to_pylist())


def ingest(store: Store, folder: Path, workers: int = 1) -> Any:
    paths = sorted(folder.iterdir())
    return ingest_kernel_logs(store, paths, cluster="c", dedup_window=timedelta(minutes=5), workers=workers)


def unreadable_metric(store: Store) -> float:
    (family,) = _StoreCollector(None)._kernel_logs(store)  # type: ignore[arg-type]
    (sample,) = family.samples
    return float(sample.value)


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    """The rows of the good files alone, and of every file good."""
    base = tmp_path_factory.mktemp("clean")
    good_only = Store.create(str(base / "good"))
    bad = write_logs(base / "logs", None)
    data = bad.read_bytes()
    bad.unlink()
    ingest(good_only, base / "logs")
    bad.write_bytes(data)
    everything = Store.create(str(base / "all"))
    ingest(everything, base / "logs")
    return rows(good_only), rows(everything)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("how", BREAKS)
def test_a_broken_gzip_is_skipped_and_counted_and_read_once_repaired(
    tmp_path: Path, expected: tuple[list[Any], list[Any]], how: str, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ingest.kernel_log_import.PARALLEL_MIN_BYTES", 0)  # workers parse even small runs
    good_rows, all_rows = expected
    store = Store.create(str(tmp_path / "store"))
    bad = write_logs(tmp_path / "logs", BREAKS[how])
    summary = ingest(store, tmp_path / "logs", workers)
    assert [line.split(": ", 1)[0] for line in summary.unreadable_files] == [str(bad)]
    assert f"1 unreadable files skipped, expected plain or gzip text (first: {bad}: " in str(summary)
    assert rows(store) == good_rows
    assert unreadable_metric(store) == 1
    # Every night until it is repaired: skipped again, nothing doubled.
    again = ingest(store, tmp_path / "logs", workers)
    assert len(again.unreadable_files) == 1 and again.incidents == 0
    assert rows(store) == good_rows
    bad.write_bytes(gzip.compress(log_text(BAD_NODE).encode()))
    repaired = ingest(store, tmp_path / "logs", workers)
    assert repaired.unreadable_files == []
    assert rows(store) == all_rows
    assert unreadable_metric(store) == 0
    assert store.read_state(STATE_NAME)["unreadable_count"] == 0


@pytest.mark.parametrize("how", ["cut short", "cut in its header"])
def test_the_command_processes_the_rest_and_exits_with_the_skipped_status(
    tmp_path: Path, expected: tuple[list[Any], list[Any]], how: str
) -> None:
    root = tmp_path / "root"
    Store.create(str(root))
    bad = write_logs(root / "raw" / "kernel-log", BREAKS[how])
    ran = gpufail("ingest", "kernel-log", "--data", str(root))
    assert ran.returncode == SKIPPED_INPUT_EXIT, ran.stderr
    assert "Traceback" not in ran.stderr
    (warning,) = ran.stderr.strip().splitlines()
    assert warning.startswith("gpufail: warning: 1 kernel-log files could not be read and were skipped")
    assert str(bad) in warning
    assert rows(Store.open(str(root))) == expected[0]
    bad.write_bytes(gzip.compress(log_text(BAD_NODE).encode()))
    ran = gpufail("ingest", "kernel-log", "--data", str(root))
    assert ran.returncode == 0, ran.stderr
    assert rows(Store.open(str(root))) == expected[1]


def test_the_nightly_goes_on_past_a_broken_gzip_and_says_so(
    tmp_path: Path, expected: tuple[list[Any], list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The steps after ingest have their own tests: here they only record that they ran.
    ran: list[str] = []
    for step in STEPS[1:]:
        monkeypatch.setattr(_Job, f"_{step}", lambda self, step=step: ran.append(step) or {})
    root = tmp_path / "root"
    store = Store.create(str(root))
    store.write("telemetry", _one_telemetry_row())
    bad = write_logs(root / "raw" / "kernel-log", cut_short)
    options = NightlyOptions(
        work_dir=tmp_path / "work",
        tracking_uri="http://127.0.0.1:9",
        model_name="unused",
        experiment="unused",
        train=TrainOptions(kind="lightgbm", train_window=timedelta(days=10), horizon=timedelta(hours=24)),
        top_k=5,
        holdout_days=1.0,
        promotion_margin=0.0,
        recall_tolerance=0.0,
        precision_floor=0.0,
        cluster="c",
    )
    summary = run_nightly(str(root), options, publish=lambda *a: {}, report=lambda _: None)
    assert ran == list(STEPS[1:])
    assert [f.split(": ", 1)[0] for f in summary.unreadable_kernel_logs()] == [str(bad)]
    assert f"1 unreadable kernel-log files skipped (first: {bad}: " in summary.line()
    assert rows(store) == expected[0]


def _one_telemetry_row() -> Any:
    from tests.conftest import make_rows

    return make_rows("telemetry", [T0], node=GOOD_NODES[0])
