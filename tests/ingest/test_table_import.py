"""`gpufail ingest table`: mapping validation, each column kind, bad rows, events, Parquet."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import pytest

from ingest.errors import InputError
from ingest.store import Store
from ingest.table_import import TableImportSummary, import_table
from ingest.table_mapping import TableMapping, load_mapping

EXAMPLE = Path(__file__).parents[2] / "examples" / "table_import"
NOW = datetime(2026, 11, 21, tzinfo=UTC)

MAPPING = """
[telemetry]
gpu = "gpu"
node = "host"
time = "t"
[telemetry.metrics]
temp_gpu_c = "temp"
power_w = { column = "mw", scale = 0.001 }
ecc_dbe_volatile_total = "dbe"
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text.lstrip("\n"))
    return path


def run_import(tmp_path: Path, data: str, mapping: str = MAPPING) -> tuple[Store, TableImportSummary]:
    mapping_path = write(tmp_path / "map.toml", mapping)
    data_path = write(tmp_path / "data.csv", data)
    store = Store.create(str(tmp_path / "root"))
    summary = import_table(
        store, data_path, load_mapping(mapping_path), mapping_path=mapping_path, cluster="c", now=NOW
    )
    return store, summary


def test_the_example_mapping_imports_its_telemetry_failure_and_repair(tmp_path: Path) -> None:
    store = Store.create(str(tmp_path / "root"))
    summary = import_table(
        store,
        EXAMPLE / "telemetry.csv",
        load_mapping(EXAMPLE / "mapping.toml"),
        mapping_path=EXAMPLE / "mapping.toml",
        cluster="c",
        now=NOW,
    )
    assert (summary.telemetry_rows, summary.failures, summary.repairs) == (6, 1, 1)
    rows = store.read("telemetry").to_pylist()
    first = rows[0]
    assert (first["node"], first["gpu_index"], first["gpu_uuid"]) == ("node-1", 0, "1650000000101")
    assert first["power_w"] == pytest.approx(251.0)  # 251000 mW
    assert first["fb_used_mib"] == pytest.approx(20480.0)  # 21474836480 bytes
    assert rows[-1]["temp_gpu_c"] is None  # an empty cell is a missing reading
    [failure] = store.read("failure_events").to_pylist()
    assert (failure["gpu_index"], failure["reason"], failure["source"]) == (1, "double-bit ECC", "record")
    [repair] = store.read("repairs").to_pylist()
    assert (repair["action"], repair["new_gpu_uuid"]) == ("replace", "1650000000199")


def test_naive_times_take_the_zone_and_offsets_win(tmp_path: Path) -> None:
    mapping = MAPPING.replace('time = "t"', 'time = "t"\ntime_zone = "Europe/Warsaw"')
    store, _ = run_import(
        tmp_path,
        "host,gpu,t,temp,mw,dbe\nn,g1,2026-05-01T12:00:00,1,,\nn,g2,2026-05-01T12:00:00+00:00,1,,\n"
        "n,g3,2026-05-01 12:00:00Z,1,,\nn,g4,2026-05-01T12:00:00.5-0200,1,,\n",
        mapping,
    )
    assert sorted(r["ts"] for r in store.read("telemetry").to_pylist()) == [
        datetime(2026, 5, 1, 10, tzinfo=UTC),
        datetime(2026, 5, 1, 12, tzinfo=UTC),
        datetime(2026, 5, 1, 12, tzinfo=UTC),
        datetime(2026, 5, 1, 14, 0, 0, 500000, tzinfo=UTC),
    ]


def test_epoch_times_a_single_node_file_and_an_event_file_inheriting_the_time_unit(tmp_path: Path) -> None:
    write(tmp_path / "fail.csv", "gpu,at\ng1,1777640400000\n")
    mapping = MAPPING.replace('node = "host"', 'node_value = "n7"').replace(
        'time = "t"', 'time = "t"\ntime_unit = "ms"'
    )
    mapping += '[failures]\nfile = "fail.csv"\ntime = "at"\n'
    store, _ = run_import(tmp_path, "gpu,t,temp,mw,dbe\ng1,1777636800000,50,300000,2\n", mapping)
    [row] = store.read("telemetry").to_pylist()
    assert (row["node"], row["ts"], row["ecc_dbe_volatile_total"]) == ("n7", datetime(2026, 5, 1, 12, tzinfo=UTC), 2)
    assert store.read("failure_events")["ts"].to_pylist() == [datetime(2026, 5, 1, 13, tzinfo=UTC)]


def test_bad_rows_are_skipped_and_counted_with_their_place_and_the_good_ones_kept(tmp_path: Path) -> None:
    data = """
host,gpu,t,temp,mw,dbe
n,g1,2026-05-01T10:00:00,40,300000,0
n,g1,not a time,40,300000,0
n,,2026-05-01T10:10:00,40,300000,0
n,g1,1970-01-01T00:00:01,40,300000,0
n,g1,2026-05-01T10:00:00,99,300000,0
n,g1,2026-05-01T10:20:00,hot,300000,0
,g1,2026-05-01T10:30:00,40,300000,0
n,g1,2026-05-01T10:40:00,41,300000,1
"""
    store, summary = run_import(tmp_path, data)
    rows = store.read("telemetry").to_pylist()
    assert [(r["ts"].minute, r["temp_gpu_c"]) for r in rows] == [(0, 40.0), (20, None), (40, 41.0)]
    assert summary.skipped == {
        "rows whose time does not parse": 1,
        "rows without a GPU id": 1,
        "rows with an implausible time (clock not set?)": 1,
        "rows repeating a GPU's time (clock jump or duplicate)": 1,
        "rows without a node": 1,
    }
    assert summary.bad_cells == 1
    line = summary.line()
    assert "data.csv row 2, column 't': 'not a time'" in line
    assert summary.examples["metric cells that are not numbers"].endswith("row 6, column 'temp'")


def test_gpus_without_an_index_column_are_numbered_per_node_in_file_order(tmp_path: Path) -> None:
    data = "host,gpu,t,temp,mw,dbe\na,z,2026-05-01T10:00:00,1,,\na,y,2026-05-01T10:00:00,1,,\nb,x,2026-05-01T10:00:00,1,,\n"
    store, _ = run_import(tmp_path, data)
    assert {(r["node"], r["gpu_uuid"]): r["gpu_index"] for r in store.read("telemetry").to_pylist()} == {
        ("a", "z"): 0,
        ("a", "y"): 1,
        ("b", "x"): 0,
    }


def test_failures_flagged_in_the_telemetry_file_itself(tmp_path: Path) -> None:
    mapping = MAPPING.replace("[telemetry.metrics]", 'pci_bus_id = "bus"\n[telemetry.metrics]') + (
        '[failures]\nflag = "event"\nvalues = ["GPU_FAIL"]\nxid = "code"\n'
    )
    data = (
        "host,gpu,t,temp,mw,dbe,event,code,bus\n"
        "n,g1,2026-05-01T10:00:00,40,,,,,00000000:3B:00.0\n"
        "n,g1,2026-05-01T10:05:00,40,,,gpu_fail,79,00000000:3B:00.0\n"
    )
    store, _ = run_import(tmp_path, data, mapping)
    [failure] = store.read("failure_events").to_pylist()
    assert (failure["ts"].minute, failure["xid"], failure["reason"]) == (5, 79, None)
    assert store.read("telemetry")["pci_bus_id"].to_pylist() == ["0000:3b:00"] * 2


def test_events_of_gpus_never_seen_and_unknown_repair_actions_are_skipped_and_counted(tmp_path: Path) -> None:
    write(
        tmp_path / "rep.csv",
        "gpu,t,kind\ng1,2026-05-02T00:00:00,reboot\ng1,2026-05-03T00:00:00,prayer\ng9,2026-05-03T00:00:00,reboot\n",
    )
    mapping = MAPPING + '[repairs]\nfile = "rep.csv"\naction = "kind"\nactions = { reboot = "reset" }\n'
    store, summary = run_import(tmp_path, "host,gpu,t,temp,mw,dbe\nn,g1,2026-05-01T10:00:00,40,,\n", mapping)
    assert [r["action"] for r in store.read("repairs").to_pylist()] == ["reset"]
    assert summary.skipped["repairs of GPUs with no telemetry"] == 1
    assert summary.skipped["repairs with an action the mapping does not name (add it to [repairs] actions)"] == 1


def test_parquet_with_native_times(tmp_path: Path) -> None:
    frame = pl.DataFrame(
        {
            "host": ["n", "n"],
            "gpu": ["g1", "g1"],
            "t": [datetime(2026, 5, 1, 10, tzinfo=UTC), datetime(2026, 5, 1, 11, tzinfo=UTC)],
            "temp": [40.5, 41.5],
            "mw": [1000, 2000],
            "dbe": [0, 1],
        }
    )
    frame.write_parquet(tmp_path / "data.parquet")
    mapping_path = write(tmp_path / "map.toml", MAPPING)
    store = Store.create(str(tmp_path / "root"))
    import_table(
        store, tmp_path / "data.parquet", load_mapping(mapping_path), mapping_path=mapping_path, cluster="c", now=NOW
    )
    assert store.read("telemetry")["power_w"].to_pylist() == [1.0, 2.0]


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ("[telemetry]\ngpu = 'g'\n", r"\[telemetry.time\] Field required"),
        (
            MAPPING.replace("temp_gpu_c", "temperature"),
            r"\[telemetry.metrics\] unknown telemetry columns \['temperature'\]",
        ),
        (MAPPING.replace('node = "host"', ""), "exactly one of node"),
        (MAPPING + "[failures]\nmode = 'x'\n", r"\[failures\] events in the telemetry file need flag"),
        (
            MAPPING.replace('time = "t"', 'time = "t"\ntime_zone = "Mars/Base"'),
            r"\[telemetry.time_zone\] unknown time zone",
        ),
        (MAPPING.replace('gpu = "gpu"', "gpu = 'gpu'\ncolour = 'red'"), r"\[telemetry.colour\] Extra inputs"),
        (MAPPING + "[extra]\n", r"\[extra\] Extra inputs are not permitted"),
        ("[telemetry\n", "not TOML"),
    ],
)
def test_a_bad_mapping_names_the_file_and_the_key(tmp_path: Path, mapping: str, message: str) -> None:
    path = write(tmp_path / "map.toml", mapping)
    with pytest.raises(InputError, match=message) as info:
        load_mapping(path)
    assert str(path) in str(info.value)


def test_a_mapped_column_missing_from_the_data_names_file_key_and_column(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"data.csv: no column 'mw' \(mapping \[telemetry\] metrics.power_w\)"):
        run_import(tmp_path, "host,gpu,t,temp,dbe\nn,g1,2026-05-01T10:00:00,40,0\n")
    assert not Store.open(str(tmp_path / "root")).exists("telemetry")


def test_a_missing_event_file_or_an_unknown_file_type_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"nowhere.csv: cannot read"):
        run_import(
            tmp_path,
            "host,gpu,t,temp,mw,dbe\nn,g1,2026-05-01T10:00:00,40,,\n",
            MAPPING + '[repairs]\nfile = "nowhere.csv"\n',
        )
    assert not Store.open(str(tmp_path / "root")).exists("telemetry")  # nothing written
    mapping = load_mapping(write(tmp_path / "m.toml", MAPPING))
    with pytest.raises(InputError, match=r"unknown type; expected .csv"):
        import_table(
            Store.create(str(tmp_path / "r2")),
            tmp_path / "data.xlsx",
            mapping,
            mapping_path=tmp_path / "m.toml",
            cluster="c",
        )


def test_mapping_model_defaults() -> None:
    spec = TableMapping.model_validate(
        {"telemetry": {"gpu": "g", "node_value": "n", "time": "t", "metrics": {"power_w": "p"}}}
    )
    assert spec.telemetry.metric_columns()["power_w"].scale == 1.0
    assert spec.failures is None and spec.repairs is None
