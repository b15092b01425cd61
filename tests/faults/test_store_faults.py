"""The store under faults: flipped bits in Parquet files, a read-only file system, no space, no
permission. A corrupt file is named and its rows are never used; every OSError is one line
naming the path; nothing already stored is changed."""

from __future__ import annotations

import errno
import io
import os
import random
import shutil
from datetime import date
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest.errors import StoreError
from ingest.schema import xid_events_schema
from ingest.simulator.run import simulate
from ingest.store import Store
from tests.cli import gpufail
from tests.conftest import make_rows
from tests.faults.mounts import fill_leaving, remount, tmpfs

SEED = 20260105
FLIPS = 12
MESSAGE_COLUMN = xid_events_schema().get_field_index("message")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny simulated data root: 4 nodes, 3 days of hourly telemetry, their kernel logs."""
    root = tmp_path_factory.mktemp("fleet") / "root"
    simulate(root, "demo", seed=5, progress=False, nodes=4, days=3, sample_interval_s=3600, flood_lines=(5, 20))
    return root


def copy_root(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def flip_bit(path: Path, offset: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def telemetry_file(root: Path) -> Path:
    return sorted((root / "telemetry").rglob("*.parquet"))[1]


def assert_one_line_error(err: str, *names: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("gpufail: error: "), err
    for name in names:
        assert name in lines[0], err


def test_a_flipped_bit_anywhere_in_a_file_is_named_and_its_rows_never_used(fleet: Path, tmp_path: Path) -> None:
    size = telemetry_file(fleet).stat().st_size
    rng = random.Random(SEED)
    # The magic bytes, the data pages, the footer and its length: everywhere.
    offsets = [0, size - 1, size - 6, *rng.sample(range(4, size - 8), FLIPS - 3)]
    for trial, offset in enumerate(offsets):
        root = copy_root(fleet, tmp_path / f"trial-{trial}")
        bad = telemetry_file(root)
        flip_bit(bad, offset, rng.randrange(8))
        store = Store.open(str(root))
        with pytest.raises(StoreError, match=f"{bad}: corrupt file"):
            store.read("telemetry")  # through pyarrow
        with pytest.raises(StoreError, match=f"{bad}: corrupt file"):
            store.dataset("telemetry")  # the files polars reads on a local store
        shutil.rmtree(root)


def test_files_checked_at_once_name_the_first_corrupt_one_in_order(fleet: Path, tmp_path: Path) -> None:
    root = copy_root(fleet, tmp_path / "root")
    files = sorted((root / "telemetry").rglob("*.parquet"))
    assert len(files) >= 3
    for bad in (files[1], files[2]):
        flip_bit(bad, bad.stat().st_size // 2, 5)
    with pytest.raises(StoreError, match=f"{files[1]}: corrupt file"):
        Store.open(str(root)).files("telemetry", verify=True)


def test_features_and_ingest_name_a_corrupt_telemetry_file_in_one_line(fleet: Path, tmp_path: Path) -> None:
    root = copy_root(fleet, tmp_path / "root")
    bad = telemetry_file(root)
    flip_bit(bad, bad.stat().st_size // 2, 3)
    for command in (["features", "--quiet"], ["ingest", "kernel-log"]):
        ran = gpufail(*command, "--data", str(root))
        status, err = ran.returncode, ran.stderr
        assert status == 2, err
        assert_one_line_error(err, str(bad), "corrupt file")
    assert not (root / "features").exists() and not (root / "xid_events").exists()


def test_page_checksums_name_a_corrupt_file_on_a_store_read_through_pyarrow(hours: object) -> None:
    # Remote stores (memory:// stands in for s3://) are not read twice to hash whole files:
    # pyarrow checks each page's checksum as it reads.
    store = Store.create(f"memory://faults-{os.getpid()}-{random.randrange(1 << 30)}")
    times = hours(*range(24))  # type: ignore[operator]
    messages = [random.Random(row).randbytes(100).hex() for row in range(24)]
    (path,) = store.write("xid_events", make_rows("xid_events", times, xid=list(range(24)), message=messages))
    data = bytearray(store.fs.cat_file(path))
    chunk = pq.ParquetFile(io.BytesIO(bytes(data))).metadata.row_group(0).column(MESSAGE_COLUMN)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    data[start + chunk.total_compressed_size // 2] ^= 0x10  # among the column's values
    store.fs.pipe_file(path, bytes(data))
    with pytest.raises(StoreError, match=f"{path}: not a readable Parquet file.*CRC"):
        store.read("xid_events")


def test_an_owned_dataset_file_that_is_corrupt_is_named(tmp_path: Path) -> None:
    store = Store.create(str(tmp_path / "root"))
    path = Path(store.write_owned("predictions", date(2026, 1, 5), pa.table({"gpu_uuid": ["a"], "risk": [0.9]})))
    flip_bit(path, path.stat().st_size // 2, 0)
    with pytest.raises(StoreError, match=f"{path}: corrupt file"):
        store.read_owned("predictions")


def test_every_write_to_a_read_only_store_is_one_line_naming_the_path(
    fleet: Path, tmp_path: Path, hours: object
) -> None:
    with tmpfs(tmp_path / "disk", 64 << 20) as disk:
        root = copy_root(fleet, disk / "root")
        before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
        remount(disk, "ro")
        store = Store.open(str(root))
        rows = make_rows("xid_events", hours(1), xid=79)  # type: ignore[operator]
        writes = {
            "write": lambda: store.write("xid_events", rows),
            "write_owned": lambda: store.write_owned("predictions", date(2026, 1, 5), pa.table({"risk": [0.5]})),
            "write_state": lambda: store.write_state("cursor", {"offset": 1}),
            "journal": lambda: store.journal("cursor", ["xid_events"]).__enter__(),
            "create": lambda: Store.create(str(disk / "new-root")),
        }
        for name, write in writes.items():
            with pytest.raises(StoreError, match="Read-only file system") as caught:
                write()
            message = str(caught.value)
            assert "\n" not in message and str(disk) in message, (name, message)
        ran = gpufail("features", "--quiet", "--data", str(root))
        status, err = ran.returncode, ran.stderr
        assert status == 2
        assert_one_line_error(err, str(root), "Read-only file system")
        assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
        remount(disk, "rw")


def test_no_space_for_a_state_file_keeps_the_old_one_and_leaves_nothing_behind(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", 1 << 20) as disk:
        store = Store.create(str(disk / "root"))
        store.write_state("cursor", {"offset": 1})
        filler = fill_leaving(disk, 0)
        with pytest.raises(StoreError, match=r"_state/cursor\.json: could not write \(No space left on device\)"):
            store.write_state("cursor", {"offset": 2, "padding": "x" * 100_000})
        filler.unlink()
        assert store.read_state("cursor") == {"offset": 1}
        assert sorted(p.name for p in (disk / "root" / "_state").iterdir()) == ["cursor.json"]


def test_permission_denied_is_one_line_naming_the_path(
    tmp_path: Path, hours: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root ignores file modes, so the refusal is injected where the OS would answer it.
    store = Store.create(str(tmp_path / "root"))
    folder = str(tmp_path / "root" / "xid_events")

    def refuse(path: str, *args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", path)

    store.write("xid_events", make_rows("xid_events", hours(1), xid=79))  # type: ignore[operator]
    monkeypatch.setattr(store.fs, "makedirs", refuse)
    with pytest.raises(StoreError, match=f"{folder}/date=2026-01-06: .*Permission denied.*read and write access"):
        store.write("xid_events", make_rows("xid_events", hours(25), xid=79))  # type: ignore[operator]
    listing = os.listdir  # a local root is listed directly, without fsspec
    monkeypatch.setattr(os, "listdir", lambda path: refuse(path) if "xid_events" in str(path) else listing(path))
    with pytest.raises(StoreError, match=f"{folder}: could not list the dataset \\(Permission denied\\)"):
        store.dates("xid_events")


def test_a_corrupt_features_file_is_named_before_training_or_scoring_reads_it(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from features.dataset import read_features

    store = Store.create(str(tmp_path / "root"))
    rows = pa.table({"ts": pa.array([datetime(2026, 1, 5, tzinfo=UTC)], pa.timestamp("us", "UTC")), "gpu_uuid": ["a"]})
    path = Path(
        store.write_owned("features", date(2026, 1, 5), rows.append_column("temp_gpu_c_max_1h", pa.array([71.0])))
    )
    assert read_features(store).height == 1
    flip_bit(path, path.stat().st_size // 2, 0)
    with pytest.raises(StoreError, match=f"{path}: corrupt file"):
        read_features(store)
