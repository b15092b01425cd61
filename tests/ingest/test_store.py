import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ingest.errors import StoreError
from ingest.store import MARKER, Store, filesystem_of
from tests.conftest import make_rows


@pytest.fixture
def store(tmp_path):
    return Store.create(str(tmp_path / "root"))


def visible_files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_write_splits_by_utc_date_and_reads_back(store, hours):
    table = make_rows("xid_events", hours(1, 25, 49), xid=[79, 48, 13])
    paths = store.write("xid_events", table)
    assert len(paths) == 3
    assert [d.isoformat() for d in store.dates("xid_events")] == ["2026-01-05", "2026-01-06", "2026-01-07"]
    back = store.read("xid_events")
    assert sorted(back["xid"].to_pylist()) == [13, 48, 79]


def test_append_adds_files_and_never_touches_existing_ones(store, hours):
    first = store.write("xid_events", make_rows("xid_events", hours(1), xid=79))
    before = {p: Path(p).read_bytes() for p in first}
    store.write("xid_events", make_rows("xid_events", hours(2), xid=48))
    assert all(Path(p).read_bytes() == data for p, data in before.items())
    assert store.read("xid_events").num_rows == 2


def test_range_read_returns_only_rows_in_range(store, hours):
    store.write("xid_events", make_rows("xid_events", hours(1, 23, 25, 47, 49), xid=[1, 2, 3, 4, 5]))
    t = hours(23, 48)
    got = store.read("xid_events", start=t[0], end=t[1])
    assert sorted(got["xid"].to_pylist()) == [2, 3, 4]  # start inclusive, end exclusive


def test_range_read_never_opens_partitions_outside_the_range(store, hours, tmp_path):
    store.write("xid_events", make_rows("xid_events", hours(1, 25), xid=[79, 48]))
    # Corrupt the first day's file: a read of the second day must not even open it.
    (first_day_file,) = (tmp_path / "root" / "xid_events" / "date=2026-01-05").glob("*.parquet")
    first_day_file.write_bytes(b"not parquet at all")
    t = hours(24, 48)
    assert store.read("xid_events", start=t[0], end=t[1])["xid"].to_pylist() == [48]
    with pytest.raises(StoreError, match=r"date=2026-01-05/part-[^ ]*\.parquet: corrupt file"):
        store.read("xid_events")


def test_column_pruning_returns_only_requested_columns(store, hours):
    store.write("xid_events", make_rows("xid_events", hours(1), xid=79))
    assert store.read("xid_events", columns=["xid", "node"]).column_names == ["xid", "node"]
    with pytest.raises(StoreError, match="unknown columns"):
        store.read("xid_events", columns=["xid", "nope"])


def test_interrupted_write_leaves_no_visible_or_temporary_file(store, hours, tmp_path, monkeypatch):
    store.write("xid_events", make_rows("xid_events", hours(1), xid=79))
    before = visible_files(tmp_path / "root")

    real_write = pq.ParquetWriter.write_table

    def write_a_row_then_die(writer, table, **kwargs):
        real_write(writer, table.slice(0, 1))  # part of the file reaches the disk
        raise KeyboardInterrupt

    monkeypatch.setattr(pq.ParquetWriter, "write_table", write_a_row_then_die)
    with pytest.raises(KeyboardInterrupt):
        store.write("xid_events", make_rows("xid_events", hours(2), xid=48))
    assert visible_files(tmp_path / "root") == before
    monkeypatch.undo()
    assert store.read("xid_events")["xid"].to_pylist() == [79]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_is_one_clear_error_and_keeps_what_was_stored(store, hours, tmp_path, monkeypatch):
    store.write("xid_events", make_rows("xid_events", hours(1), xid=79))
    before = {p: (tmp_path / "root" / p).read_bytes() for p in visible_files(tmp_path / "root")}
    real_open = store.fs.open

    def temporary_files_on_a_full_disk(path, mode="rb", **kwargs):
        # /dev/full answers every write with ENOSPC, as a full disk does.
        return open("/dev/full", "wb") if ".tmp-" in path else real_open(path, mode, **kwargs)

    monkeypatch.setattr(store.fs, "open", temporary_files_on_a_full_disk)
    with pytest.raises(
        StoreError,
        match=r"xid_events/date=2026-01-05: could not write a part file \(No space left on device\).*free space",
    ):
        store.write("xid_events", make_rows("xid_events", hours(2), xid=48))
    monkeypatch.undo()
    assert {p: (tmp_path / "root" / p).read_bytes() for p in visible_files(tmp_path / "root")} == before
    assert store.read("xid_events")["xid"].to_pylist() == [79]


def test_a_partition_with_a_foreign_schema_is_named_in_the_error(store, hours, tmp_path):
    store.write("xid_events", make_rows("xid_events", hours(1), xid=79))
    foreign = tmp_path / "root" / "xid_events" / "date=2026-01-05" / "part-foreign.parquet"
    pq.write_table(pa.table({"ts": [1], "temperature": [3.0]}), foreign)
    with pytest.raises(StoreError, match=r"part-foreign\.parquet has a foreign schema.*missing column 'xid'"):
        store.read("xid_events")


def test_the_schemas_of_many_files_are_checked_a_batch_at_a_time_and_a_foreign_one_is_named(
    store, hours, tmp_path, monkeypatch
):
    # A day of a large fleet is hundreds of thousands of files: their footers are not all held
    # at once, and a foreign file in a later batch is still found.
    import ingest.store as store_module

    monkeypatch.setattr(store_module, "_SCHEMA_BATCH", 2)
    for hour in (1, 2, 3, 4):
        store.write("xid_events", make_rows("xid_events", hours(hour), xid=79))
    folder = tmp_path / "root" / "xid_events" / "date=2026-01-05"
    pq.write_table(pa.table({"ts": [1]}), folder / "part-zz-foreign.parquet")  # listed last
    with pytest.raises(StoreError, match=r"part-zz-foreign\.parquet has a foreign schema"):
        store.scan("xid_events")
    (folder / "part-zz-foreign.parquet").unlink()
    assert store.collect(store.scan("xid_events"), "xid_events").height == 4


def test_rows_that_do_not_match_the_schema_are_refused_before_anything_is_written(store, hours, tmp_path):
    bad = make_rows("xid_events", hours(1), xid=79).drop_columns(["source"])
    with pytest.raises(StoreError, match=r"missing \['source'\]"):
        store.write("xid_events", bad)
    nulls = make_rows("xid_events", hours(1), xid=79).set_column(7, "xid", pa.nulls(1, pa.int32()))
    with pytest.raises(StoreError, match="xid_events.xid: 1 null values in a required column"):
        store.write("xid_events", nulls)
    assert not (tmp_path / "root" / "xid_events").exists()


def test_opening_a_folder_that_is_not_a_gpufail_root_fails_clearly(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(StoreError, match=r"photos.*is not a gpufail dataset: gpufail.json is missing"):
        Store.open(str(tmp_path / "photos"))
    with pytest.raises(StoreError, match="exists, is not empty and is not a gpufail dataset"):
        Store.create(str(tmp_path / "photos"))
    with pytest.raises(StoreError, match="does not exist"):
        Store.open(str(tmp_path / "absent"))


def test_a_root_of_another_schema_version_is_refused(tmp_path):
    Store.create(str(tmp_path / "root"))
    (tmp_path / "root" / MARKER).write_text(json.dumps({"format": "gpufail", "schema_version": 999}))
    with pytest.raises(StoreError, match="schema version 999; this gpufail reads version 1"):
        Store.open(str(tmp_path / "root"))


def test_state_files_round_trip_and_corruption_is_reported(store, tmp_path):
    assert store.read_state("cursor") is None
    store.write_state("cursor", {"offset": 42})
    assert store.read_state("cursor") == {"offset": 42}
    (tmp_path / "root" / "_state" / "cursor.json").write_text("{half")
    with pytest.raises(StoreError, match="cursor.json: corrupt state file"):
        store.read_state("cursor")


def test_memory_filesystem_url_works_like_a_folder(hours):
    # Any fsspec URL is a data root; memory:// stands in for s3:// in tests.
    root = f"memory://gpufail-test-{uuid.uuid4().hex}"  # the memory filesystem is process-wide
    store = Store.create(root)
    store.write("xid_events", make_rows("xid_events", hours(1, 30), xid=[79, 48]))
    t = hours(24, 48)
    assert store.read("xid_events", start=t[0], end=t[1])["xid"].to_pylist() == [48]
    assert Store.open(root).dates("xid_events")[0].isoformat() == "2026-01-05"


def test_datasets_owned_by_later_stages_get_the_same_atomic_dated_layout(store, hours):
    from datetime import date

    assert store.read_owned("predictions") is None
    store.write_owned("predictions", date(2026, 1, 5), pa.table({"gpu_uuid": ["a"], "risk": [0.9]}))
    store.write_owned("predictions", date(2026, 1, 6), pa.table({"gpu_uuid": ["b"], "risk": [0.1]}))
    assert store.read_owned("predictions")["gpu_uuid"].to_pylist() == ["a", "b"]
    assert store.read_owned("predictions", first_day=date(2026, 1, 6))["gpu_uuid"].to_pylist() == ["b"]


def test_an_owned_dataset_whose_schema_grew_keeps_the_new_column(store):
    from datetime import date

    # The day of an upgrade: an older file without `top_features`, then a newer one with it.
    day = date(2026, 1, 5)
    store.write_owned("predictions", day, pa.table({"gpu_uuid": ["a"], "risk": [0.9]}))
    store.write_owned(
        "predictions", day, pa.table({"gpu_uuid": ["b"], "risk": [0.1], "top_features": [["ecc_dbe_total_last"]]})
    )
    table = store.read_owned("predictions")
    rows = sorted(zip(table["gpu_uuid"].to_pylist(), table["top_features"].to_pylist(), strict=True))
    assert rows == [("a", None), ("b", ["ecc_dbe_total_last"])]


def test_owned_files_that_disagree_on_a_type_are_a_clear_error(store):
    from datetime import date

    store.write_owned("predictions", date(2026, 1, 5), pa.table({"gpu_uuid": ["a"], "risk": [0.9]}))
    store.write_owned("predictions", date(2026, 1, 6), pa.table({"gpu_uuid": ["b"], "risk": ["high"]}))
    with pytest.raises(StoreError, match=r"predictions: the files disagree on a column's type"):
        store.read_owned("predictions")


# -- the one read path: Store.scan -------------------------------------------------------------


def test_scan_gives_the_same_rows_on_a_local_store_and_on_another_filesystem(store, hours):
    import polars as pl

    rows = make_rows("xid_events", hours(1, 23, 25, 47, 49), xid=[1, 2, 3, 4, 5], node=["a", "b", "a", "b", "a"])
    remote = Store.create(f"memory://gpufail-scan-{uuid.uuid4().hex}")
    for each in (store, remote):
        each.write("xid_events", rows)
    t = hours(23, 49)
    frames = [
        each.scan("xid_events", t[0], t[1], columns=["ts", "xid"], where=pl.col("node") == "a").collect().sort("ts")
        for each in (store, remote)
    ]
    assert frames[0].equals(frames[1]) and frames[0]["xid"].to_list() == [3]
    assert frames[0].columns == ["ts", "xid"]


def test_scan_of_nothing_has_the_datasets_columns_or_the_ones_given(store):
    import polars as pl

    assert store.scan("xid_events").collect().columns == make_rows("xid_events", []).column_names
    assert store.scan("features", schema={"ts": pl.Datetime("us", "UTC")}).collect().schema == {
        "ts": pl.Datetime("us", "UTC")
    }
    with pytest.raises(StoreError, match="unknown columns"):
        store.scan("xid_events", columns=["xid", "nope"])


def test_scan_refuses_a_foreign_file_and_collect_names_a_file_that_does_not_decode(store, hours, tmp_path):
    store.write("xid_events", make_rows("xid_events", hours(1), xid=79))
    folder = tmp_path / "root" / "xid_events" / "date=2026-01-05"
    pq.write_table(pa.table({"ts": [1]}), folder / "part-foreign.parquet")
    with pytest.raises(StoreError, match=r"part-foreign.parquet has a foreign schema"):
        store.scan("xid_events")
    (folder / "part-foreign.parquet").unlink()
    # A file written before checksums were part of the name: only decoding finds the damage.
    (good,) = folder.glob("part-*.parquet")
    damaged = folder / "part-legacy.parquet"
    data = good.read_bytes()
    damaged.write_bytes(data[:4] + bytes(len(data) // 2 - 4) + data[len(data) // 2 :])
    with pytest.raises(StoreError) as refused:
        store.collect(store.scan("xid_events"), "xid_events")
    assert str(refused.value).startswith(f"{damaged}: not a readable Parquet file (")
    assert str(refused.value).endswith(
        "; restore it from a copy of the data root, or remove it and ingest its source again"
    )


def test_a_corrupt_file_is_named_with_what_to_do_about_its_dataset(store, tmp_path):
    from datetime import date

    day = date(2026, 1, 5)
    path = Path(store.write_owned("features", day, pa.table({"ts": [1], "gpu_uuid": ["a"]})))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError) as refused:
        store.files("features", verify=True)
    assert str(refused.value).startswith(f"{path}: corrupt file (CRC-32 ")
    assert str(refused.value).endswith(
        "its rows are not used. Rebuild its day with gpufail features --materialise --start 2026-01-05 --end 2026-01-06 "
        "--overwrite"
    )
    buckets = Path(store.write_owned("buckets", day, pa.table({"ts": [1], "gpu_uuid": ["a"]})))
    buckets.write_bytes(buckets.read_bytes()[:100])
    with pytest.raises(StoreError) as refused:
        store.files("buckets", verify=True)
    assert str(refused.value).endswith(
        "Rebuild its day with gpufail features --start 2026-01-05 --end 2026-01-06 --overwrite"
    )


@pytest.mark.parametrize(
    "root", ["ROOT", "ROOT/", "data", "./data", "./data/", ".", "../x/data", "a//b", "~/data", "~"]
)
def test_a_local_root_is_named_as_fsspec_names_it_without_fsspec(root, tmp_path, monkeypatch):
    # A local root's files are read directly (`gpufail at-risk` does without fsspec), under the
    # names they had through fsspec: paths that commands print and journals record.
    import fsspec

    monkeypatch.chdir(tmp_path)
    root = root.replace("ROOT", str(tmp_path / "root"))
    fs, path = filesystem_of(root)
    assert fs is None
    assert path == fsspec.core.url_to_fs(root)[1]


@pytest.mark.parametrize("root", ["file://ROOT", "file:ROOT", "memory://fleet", "simplecache::file://ROOT"])
def test_a_url_root_gets_its_fsspec_filesystem(root, tmp_path):
    import fsspec

    root = root.replace("ROOT", str(tmp_path / "root"))
    fs, path = filesystem_of(root)
    expected_fs, expected_path = fsspec.core.url_to_fs(root)
    assert fs is expected_fs and path == expected_path


def test_a_local_root_is_read_and_written_as_before(tmp_path, hours):
    root = Store.create(str(tmp_path / "root"))
    assert root.is_local and root._fs is not None  # created: written through fsspec
    root.write("xid_events", make_rows("xid_events", hours(1), xid=79))
    reader = Store.open(str(tmp_path / "root"))
    assert reader._fs is None  # opened and listed without it
    assert reader.files("xid_events") == root.files("xid_events") and reader.is_local
    assert reader.read_bytes(reader.path(MARKER)) == (tmp_path / "root" / MARKER).read_bytes()
    assert sorted(reader.names_in(reader.path())) == sorted(p.name for p in (tmp_path / "root").iterdir())
    assert reader._fs is None
    assert reader.fs.protocol == root.fs.protocol  # made when a writer asks for it
