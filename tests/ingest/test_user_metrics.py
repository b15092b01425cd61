"""Your own metrics: declared in `[metrics.<name>]`, recorded in the data root, imported by
`gpufail ingest table` with their valid range checked, and turned into window features by kind."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from features.dataset import read_features
from ingest.errors import InputError, StoreError
from ingest.schema import metric_catalogue, telemetry_schema, use_user_metrics, user_metrics
from ingest.store import Store
from ingest.user_metrics import record_metrics, recorded_metrics, user_metric
from tests.cli import gpufail

START = datetime(2026, 5, 1, tzinfo=UTC)

CONFIG = """
[features]
grid = "1h"
windows = ["1h", "3h"]

[metrics.fan_rpm]
kind = "gauge"
unit = "rpm"
min = 0
max = 20000

[metrics.smart_5_raw]
kind = "counter"
unit = "sectors"
min = 0

[metrics.fault_bits]
kind = "bitmask"
unit = "bitmask"

[metrics.degraded]
kind = "flag"
unit = "bool"
min = 0
max = 1
"""

MAPPING = """
[telemetry]
gpu = "serial"
node = "host"
time = "at"
[telemetry.metrics]
temp_gpu_c = "temp"
util_mem_pct = "mem_util"
fan_rpm = "fan"
smart_5_raw = "smart5"
fault_bits = "faults"
degraded = "degraded"
"""

# One GPU, a sample every 30 minutes from 00:30 to 04:00. The fan reading at 03:30 (99999 rpm)
# is above its declared maximum and the memory utilisation at 01:00 is 4.29e9 percent (a
# sentinel): both are counted and stored as missing readings.
FAN = [1000, 1200, 1400, 1600, 1800, 2000, 99999, 2400]
SMART = [0, 0, 1, 1, 2, 2, 3, 3]
MEM_UTIL = ["10", "4294967295", "10", "10", "10", "10", "10", "10"]
FAULTS = [0, 0, 1, 0, 4, 0, 0, 0]
DEGRADED = [0, 0, 0, 0, 0, 1, 0, 0]


def write_export(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(exist_ok=True)
    lines = ["serial,host,at,temp,mem_util,fan,smart5,faults,degraded"]
    for i, (fan, smart, util, faults, degraded) in enumerate(zip(FAN, SMART, MEM_UTIL, FAULTS, DEGRADED, strict=True)):
        at = START + timedelta(minutes=30 * (i + 1))
        lines.append(f"GPU-1,n1,{at:%Y-%m-%d %H:%M:%S},50,{util},{fan},{smart},{faults},{degraded}")
    data = folder / "telemetry.csv"
    data.write_text("\n".join(lines) + "\n")
    mapping = folder / "mapping.toml"
    mapping.write_text(MAPPING)
    return data, mapping


def config(folder: Path, text: str = CONFIG) -> dict[str, str]:
    path = folder / "gpufail.toml"
    path.write_text(text)
    return {"GPUFAIL_CONFIG": str(path)}


def ingest(data: Path, mapping: Path, root: str, env: dict[str, str]):
    return gpufail("ingest", "table", str(data), "--map", str(mapping), "--data", root, env=env)


def test_a_user_metric_goes_from_a_table_import_to_window_features(tmp_path: Path) -> None:
    data, mapping = write_export(tmp_path / "export")
    root = str(tmp_path / "root")
    imported = ingest(data, mapping, root, config(tmp_path))
    assert imported.returncode == 0, imported.stderr
    assert "2 readings outside their metric's valid range left missing" in imported.stdout
    assert "fan_rpm 1, e.g. 99999 at " in imported.stdout and "valid [0, 20000]" in imported.stdout
    assert "util_mem_pct 1, e.g. 4294967295 at " in imported.stdout and "valid [0, 100]" in imported.stdout

    # A later command on the root knows the metrics without the configuration that declared them.
    use_user_metrics(())
    without_metrics = config(tmp_path, CONFIG[: CONFIG.index("[metrics.fan_rpm]")])
    built = gpufail("features", "--data", root, "--quiet", env=without_metrics)
    assert built.returncode == 0, built.stderr
    assert [m.column for m in user_metrics()] == ["fan_rpm", "smart_5_raw", "fault_bits", "degraded"]

    stored = Store.open(root).read("telemetry").to_pydict()
    assert stored["fan_rpm"] == [1000, 1200, 1400, 1600, 1800, 2000, None, 2400]
    assert stored["util_mem_pct"][1] is None and stored["smart_5_raw"] == SMART

    features = read_features(Store.open(root)).sort("ts")
    at = {row["ts"]: row for row in features.iter_rows(named=True)}
    three = at[START + timedelta(hours=3)]
    # (00:00, 03:00]: 1000 .. 2000; bucket means 1100, 1500, 1900 one hour apart.
    assert three["fan_rpm_mean_3h"] == pytest.approx(1500)
    assert (three["fan_rpm_min_3h"], three["fan_rpm_max_3h"]) == (1000, 2000)
    assert three["fan_rpm_slope_3h"] == pytest.approx(400)
    assert three["fan_rpm_mean_1h"] == pytest.approx(1900)
    assert three["smart_5_raw_increase_3h"] == 2
    assert three["fault_bits_any_frac_3h"] == pytest.approx(2 / 6)  # 1 and 4 among six samples
    assert (three["degraded_max_1h"], three["degraded_max_3h"]) == (1, 1)
    four = at[START + timedelta(hours=4)]
    # (01:00, 04:00]: the out-of-range 99999 is a missing reading, not a value.
    assert four["fan_rpm_mean_3h"] == pytest.approx((1400 + 1600 + 1800 + 2000 + 2400) / 5)
    assert four["fan_rpm_max_3h"] == 2400
    assert four["fan_rpm_mean_1h"] == pytest.approx(2400)
    assert four["smart_5_raw_increase_3h"] == 3 and four["smart_5_raw_increase_1h"] == 1
    assert four["fault_bits_any_frac_1h"] == 0 and four["fault_bits_any_frac_3h"] == pytest.approx(2 / 6)
    assert (four["degraded_max_1h"], four["degraded_max_3h"]) == (0, 1)


def test_a_mapping_naming_an_undeclared_metric_says_how_to_declare_it(tmp_path: Path) -> None:
    data, mapping = write_export(tmp_path / "export")
    result = ingest(data, mapping, str(tmp_path / "root"), config(tmp_path, "[features]\ngrid = '1h'\n"))
    assert result.returncode != 0
    assert "unknown telemetry columns ['degraded', 'fan_rpm', 'fault_bits', 'smart_5_raw']" in result.stderr
    assert "[metrics.<name>]" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "root").exists()  # the failed first import left nothing behind


def test_a_redefinition_with_another_kind_or_unit_is_refused_in_one_line(tmp_path: Path) -> None:
    data, mapping = write_export(tmp_path / "export")
    root = str(tmp_path / "root")
    assert ingest(data, mapping, root, config(tmp_path)).returncode == 0
    before = Store.open(root).read("telemetry").num_rows
    redefined = CONFIG.replace('kind = "gauge"\nunit = "rpm"', 'kind = "gauge"\nunit = "percent"')
    result = ingest(data, mapping, root, config(tmp_path, redefined))
    assert result.returncode != 0
    assert (
        result.stderr.strip().splitlines() == [result.stderr.strip()]
        and "[metrics.fan_rpm]: the data root" in result.stderr
    )
    assert "records it as a gauge in 'rpm', the configuration says a gauge in 'percent'" in result.stderr
    store = Store.open(root)
    assert store.read("telemetry").num_rows == before
    assert [(m.column, m.unit) for m in recorded_metrics(store)][:2] == [("fan_rpm", "rpm"), ("smart_5_raw", "sectors")]

    store = Store.open(root)
    with pytest.raises(InputError, match=r"\[metrics.smart_5_raw\]: .* records it as a counter .* says a gauge"):
        record_metrics(store, (user_metric("smart_5_raw", "gauge", "sectors"),))


def test_a_range_or_description_may_change_and_the_newest_is_recorded(tmp_path: Path) -> None:
    store = Store.create(str(tmp_path / "root"))
    record_metrics(store, (user_metric("fan_rpm", "gauge", "rpm", valid_max=100),))
    record_metrics(store, (user_metric("fan_rpm", "gauge", "rpm", valid_max=20000),))
    assert [m.valid_max for m in recorded_metrics(Store.open(str(tmp_path / "root")))] == [20000]


def test_two_imports_recording_metrics_at_once_take_turns(tmp_path: Path, monkeypatch) -> None:
    # The record is read, merged and written under its lock, so a second import waits for the
    # first instead of overwriting the metric it just recorded. Here the lock is held elsewhere
    # and the wait is cut to nothing: the update is refused, in one line, and the record unchanged.
    import ingest.user_metrics as module
    from ingest.journal import lock_path
    from ingest.locking import exclusive_lock

    store = Store.create(str(tmp_path / "root"))
    record_metrics(store, (user_metric("fan_rpm", "gauge", "rpm"),))
    monkeypatch.setattr(module, "RECORD_LOCK_WAIT_S", 0.0)
    held = exclusive_lock(lock_path(store, "metrics"), "another import")
    refusal = r"another metric record of .* holds the lock .*metrics\.lock"
    with held, pytest.raises(StoreError, match=refusal) as refused:
        record_metrics(store, (user_metric("smart_5_raw", "counter", "sectors"),))
    assert "\n" not in str(refused.value)
    assert [m.column for m in recorded_metrics(store)] == ["fan_rpm"]
    record_metrics(store, (user_metric("smart_5_raw", "counter", "sectors"),))
    assert [m.column for m in recorded_metrics(store)] == ["fan_rpm", "smart_5_raw"]


def test_nothing_new_to_record_takes_no_lock_and_a_lock_that_cannot_be_made_is_one_line(
    tmp_path: Path, monkeypatch
) -> None:
    # A read-only data root must keep working for what it records (the collector's start records
    # the configured metrics every time); only a change needs the lock, and a lock file that
    # cannot be created is a one-line store error naming it, not a traceback.
    import ingest.user_metrics as module

    store = Store.create(str(tmp_path / "root"))
    record_metrics(store, (user_metric("fan_rpm", "gauge", "rpm"),))
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(module, "lock_path", lambda store, name: blocker / f"{name}.lock")
    assert [m.column for m in record_metrics(store, ())] == ["fan_rpm"]
    assert [m.column for m in record_metrics(store, (user_metric("fan_rpm", "gauge", "rpm"),))] == ["fan_rpm"]
    with pytest.raises(StoreError, match=r"not-a-folder: could not create the lock file") as refused:
        record_metrics(store, (user_metric("smart_5_raw", "counter", "sectors"),))
    assert "\n" not in str(refused.value)
    assert [m.column for m in recorded_metrics(store)] == ["fan_rpm"]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            '[metrics.fan_rpm]\nkind = "gaugeish"\nunit = "rpm"\n',
            "[metrics] fan_rpm.kind: Input should be 'gauge', 'counter', 'flag' or 'bitmask', got 'gaugeish'",
        ),
        ('[metrics.fan_rpm]\nkind = "gauge"\n', "[metrics] fan_rpm.unit: Field required"),
        (
            '[metrics.fan_rpm]\nkind = "gauge"\nunit = "rpm"\nmin = 10\nmax = 1\n',
            "[metrics] fan_rpm: min 10 is above max 1",
        ),
        (
            '[metrics.temp_gpu_c]\nkind = "gauge"\nunit = "C"\n',
            "[metrics]: expected a name that is not gpufail's own column (ingest/metrics.csv), got 'temp_gpu_c'",
        ),
        (
            '[metrics."Fan RPM"]\nkind = "gauge"\nunit = "rpm"\n',
            "[metrics]: expected a metric name of lower-case letters, digits and _ (a column name), got 'Fan RPM'",
        ),
        ('[metrics.fan_rpm]\nkind = "gauge"\nunit = "rpm"\ncolour = "red"\n', "[metrics] fan_rpm.colour: unknown key"),
        (
            '[metrics.sm_active]\nkind = "gauge"\nunit = "ratio"\ndcgm_field = "SM_ACTIVE"\n',
            "[metrics] sm_active.dcgm_field: String should match pattern",
        ),
    ],
)
def test_a_bad_catalogue_entry_is_refused_in_one_line_naming_the_key(tmp_path: Path, table: str, message: str) -> None:
    result = gpufail("config", "show", env=config(tmp_path, table))
    assert result.returncode != 0
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_telemetry_written_before_a_metric_was_declared_reads_it_as_missing(tmp_path: Path) -> None:
    data, mapping = write_export(tmp_path / "export")
    root = str(tmp_path / "root")
    plain_mapping = tmp_path / "plain.toml"
    plain_mapping.write_text(MAPPING[: MAPPING.index("fan_rpm")])
    assert ingest(data, plain_mapping, root, config(tmp_path, "")).returncode == 0
    later = tmp_path / "later.csv"
    later.write_text(
        "serial,host,at,temp,mem_util,fan,smart5,faults,degraded\nGPU-1,n1,2026-05-01 05:00:00,50,10,3000,4,0,0\n"
    )
    assert ingest(later, mapping, root, config(tmp_path)).returncode == 0

    use_user_metrics(())
    store = Store.open(root)  # puts the recorded metrics in use
    table = store.read("telemetry").sort_by("ts")
    assert table.schema == telemetry_schema() and table.num_rows == 9
    assert table["fan_rpm"].to_pylist() == [None] * 8 + [3000]
    scanned = store.collect(store.scan("telemetry"), "telemetry").sort("ts")
    assert scanned["smart_5_raw"].to_list() == [None] * 8 + [4]


def test_a_corrupt_metric_record_is_named(tmp_path: Path) -> None:
    root = tmp_path / "root"
    Store.create(str(root))
    (root / "_state").mkdir()
    (root / "_state" / "metrics.json").write_text(json.dumps({"metrics": [{"name": "x", "kind": "weird", "unit": ""}]}))
    with pytest.raises(StoreError, match=r"_state/metrics.json: unreadable metric entry .*unknown kind 'weird'"):
        Store.open(str(root))
    (root / "_state" / "metrics.json").write_text(json.dumps({"metrics": "fan"}))
    with pytest.raises(StoreError, match=r"_state/metrics.json: corrupt metric record; expected a 'metrics' list"):
        Store.open(str(root))


def test_user_metrics_extend_the_catalogue_after_the_builtin_ones_and_never_replace_them() -> None:
    builtin = metric_catalogue()
    use_user_metrics((user_metric("fan_rpm", "gauge", "rpm"),))
    assert metric_catalogue() == (*builtin, user_metric("fan_rpm", "gauge", "rpm"))
    assert telemetry_schema().field("fan_rpm").type == pa.float64()
    with pytest.raises(InputError, match=r"\[metrics\] power_w: gpufail's own column"):
        use_user_metrics((user_metric("power_w", "gauge", "W"),))


def test_a_user_bitmask_gets_an_any_bit_fraction(tmp_path: Path) -> None:
    from features.windows import bitmask_groups

    assert bitmask_groups("my_fault_bits") == {"any": -1}
    assert "any" not in bitmask_groups("clock_event_reasons")


DCGM_SCRAPE = Path(__file__).parents[1] / "fixtures" / "dcgm_exporter" / "ericsson_T4_590.48.01.prom"
DCGM_CONFIG = """
[metrics.tensor_active]
kind = "gauge"
unit = "ratio"
min = 0
max = 1
dcgm_field = "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"

[metrics.fb_free_mib]
kind = "gauge"
unit = "MiB"
max = 1000
dcgm_field = "DCGM_FI_DEV_FB_FREE"

[metrics.nvlink_bandwidth]
kind = "counter"
unit = "bytes"
dcgm_field = "DCGM_FI_PROF_NVLINK_TX_BYTES"
"""


def test_dcgm_exporter_stores_extra_fields_in_user_metrics_and_checks_their_range(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    result = gpufail("ingest", "dcgm-exporter", "--data", root, str(DCGM_SCRAPE), env=config(tmp_path, DCGM_CONFIG))
    assert result.returncode == 0, result.stderr
    assert "1 readings outside their metric's valid range left missing (fb_free_mib 1)" in result.stdout
    use_user_metrics(())
    row = Store.open(root).read("telemetry").to_pylist()[0]
    assert row["tensor_active"] == pytest.approx(0.005822)
    assert row["fb_free_mib"] is None  # 9791 MiB is above the declared 1000
    assert row["nvlink_bandwidth"] is None  # a T4 has no NVLink: the scrape has no such series
    assert row["temp_gpu_c"] == 74.0  # gpufail's own fields are unchanged


def test_the_dcgm_exporter_collector_counts_out_of_range_readings(tmp_path: Path) -> None:
    from ingest.collect.dcgm_exporter_collector import DcgmExporterCollector

    use_user_metrics((user_metric("fb_free_mib", "gauge", "MiB", valid_max=1000, dcgm_field="DCGM_FI_DEV_FB_FREE"),))
    collector = DcgmExporterCollector(
        "http://exporter/metrics", cluster="c", node="n1", fetch=lambda _url, _timeout: DCGM_SCRAPE.read_text()
    )
    collected = collector.collect()
    assert collected["telemetry"]["fb_free_mib"].to_pylist() == [None]
    assert collector.out_of_range == {"fb_free_mib": 1}


def test_the_feature_dictionary_describes_user_metric_features_with_their_unit() -> None:
    from features.dictionary import describe

    use_user_metrics(
        (
            user_metric("smart_5_raw", "counter", "sectors", description="Reallocated sectors"),
            user_metric("fault_bits", "bitmask", "bitmask"),
        )
    )
    doc = describe("smart_5_raw_increase_24h")
    assert (doc.unit, doc.window) == ("sectors", "24h") and "reallocated sectors" in doc.meaning
    assert describe("smart_5_raw_rate_6h").unit == "sectors/h"
    assert "any bit set" in describe("fault_bits_any_frac_1h").meaning


def test_gpufail_own_metrics_have_ranges_too_and_a_sentinel_is_not_stored(tmp_path: Path) -> None:
    from ingest.table_import import import_table
    from ingest.table_mapping import load_mapping

    mapping = tmp_path / "map.toml"
    mapping.write_text(MAPPING[: MAPPING.index("fan_rpm")])
    data = tmp_path / "data.csv"
    data.write_text(
        "serial,host,at,temp,mem_util\n"
        "GPU-1,n1,2026-05-01 00:10:00,-300,4294967295\n"
        "GPU-1,n1,2026-05-01 00:20:00,55,100\n"
    )
    store = Store.create(str(tmp_path / "root"))
    summary = import_table(store, data, load_mapping(mapping), mapping_path=mapping, cluster="c", now=START)
    assert summary.out_of_range == {"temp_gpu_c": 1, "util_mem_pct": 1}
    rows = store.read("telemetry").sort_by("ts").to_pydict()
    assert rows["util_mem_pct"] == [None, 100] and rows["temp_gpu_c"] == [None, 55]
    assert "valid [-40, 150]" in summary.line() and "valid [0, 100]" in summary.line()


def test_a_store_sent_to_another_process_brings_the_roots_metrics(tmp_path: Path) -> None:
    """Dask workers of the feature build get the store pickled; they must read its user columns."""
    import pickle

    store = Store.create(str(tmp_path / "root"))
    record_metrics(store, (user_metric("fan_rpm", "gauge", "rpm"),))
    sent = pickle.dumps(store)
    use_user_metrics(())
    received = pickle.loads(sent)
    assert [m.column for m in user_metrics()] == ["fan_rpm"] and received.root == store.root
