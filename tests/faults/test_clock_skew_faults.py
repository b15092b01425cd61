"""One fast clock must not stop the fleet: samples of one GPU (or one node) 36 h ahead of the
rest arrive through each input path (the table import of a backfill, nvidia-smi output, a
dcgm-exporter scrape, the NVML collector on a node whose clock ran ahead). The fleet's data end
and the newest grid time scored come from the bulk of its GPUs, so every GPU is scored at
the bulk's newest grid time, and no GPU of the fast one's node is labelled lost. Kernel-log
lines dated far outside the data (1970, 2099) are counted and kept out, in the importer and in
the collector."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from features.aggregates import build_aggregates
from features.build import build_features
from features.dataset import read_newest_grid_time, write_features
from features.on_demand import newest_on_demand, stored_fleet_facts
from features.spec import FeatureSpec
from features.windows import grid_floor
from ingest.collect.kernel_log_collector import KernelLogCollector
from ingest.collect.log_sources import FileSource
from ingest.collect.nvml_collector import NvmlCollector
from ingest.dcgm_scrape import parse_scrape
from ingest.kernel_log_import import ingest_kernel_logs
from ingest.nvidia_smi import parse_nvidia_smi
from ingest.store import Store
from ingest.table_import import import_table
from ingest.table_mapping import load_mapping
from tests.conftest import make_rows
from tests.fake_nvml.scenario import scenario_from_capture

START = datetime(2026, 1, 5, tzinfo=UTC)
END = START + timedelta(days=2) - timedelta(hours=1)  # the bulk's last sample
AHEAD = timedelta(hours=36)
NODES = [f"n{i}" for i in range(6)]  # 48 GPUs of the bulk
FAST_NODE = "n1"  # the fast GPUs report as this node
NOW = datetime(2026, 11, 21, tzinfo=UTC)
H100 = Path(__file__).parents[1] / "fixtures" / "nvml" / "qx-h100.xml"


def bulk_fleet(root: Path) -> Store:
    """Hourly samples of 6 nodes x 8 GPUs over two days, all clocks right."""
    store = Store.create(str(root))
    times, node, index, uuid = [], [], [], []
    hour = START
    while hour <= END:
        for n in NODES:
            for g in range(8):
                times.append(hour)
                node.append(n)
                index.append(g)
                uuid.append(f"GPU-{n}-{g}")
        hour += timedelta(hours=1)
    store.write(
        "telemetry",
        make_rows(
            "telemetry",
            times,
            cluster="c",
            node=node,
            gpu_index=index,
            gpu_uuid=uuid,
            pci_bus_id=[f"0000:{0x10 + i:02x}:00" for i in index],
            temp_gpu_c=[50.0] * len(times),
            power_w=[300.0] * len(times),
        ),
    )
    return store


def fast_times() -> list[datetime]:
    """The fast GPU's samples: the bulk's hours, 36 h ahead (but behind the wall clock)."""
    return [START + AHEAD + timedelta(hours=h) for h in range(48)]


def by_table_import(store: Store, tmp: Path) -> None:
    mapping = tmp / "map.toml"
    mapping.write_text(
        '[telemetry]\ngpu = "gpu"\nnode = "host"\ntime = "t"\n[telemetry.metrics]\ntemp_gpu_c = "temp"\n'
    )
    data = tmp / "fast.csv"
    data.write_text("host,gpu,t,temp\n" + "".join(f"{FAST_NODE},GPU-fast,{t.isoformat()},50\n" for t in fast_times()))
    import_table(store, data, load_mapping(mapping), mapping_path=mapping, cluster="c", now=NOW)


def by_nvidia_smi(store: Store, tmp: Path) -> None:
    text = "timestamp, index, uuid, pci.bus_id, temperature.gpu\n" + "".join(
        f"{t:%Y/%m/%d %H:%M:%S}.000, 0, GPU-fast, 00000000:99:00.0, 50\n" for t in fast_times()
    )
    store.write("telemetry", parse_nvidia_smi(text, source="f", cluster="c", node=FAST_NODE, now=NOW))


def by_dcgm_exporter(store: Store, tmp: Path) -> None:
    labels = 'gpu="0",UUID="GPU-fast",pci_bus_id="00000000:99:00.0",modelName="NVIDIA H100"'
    for t in fast_times():
        store.write(
            "telemetry", parse_scrape(f"DCGM_FI_DEV_GPU_TEMP{{{labels}}} 50\n", now=t, cluster="c", node=FAST_NODE)
        )


class AheadClock:
    """The clock of a node 36 h ahead of the bulk's last sample: each now() an hour later."""

    def __init__(self) -> None:
        self.times = iter(END + AHEAD + timedelta(hours=h) for h in range(48))

    def now(self) -> datetime:
        return next(self.times)

    def monotonic(self) -> float:
        return 0.0

    def sleep(self, seconds: float) -> None:
        pass


PATHS: dict[str, Callable[[Store, Path], None]] = {
    "table import": by_table_import,
    "nvidia-smi": by_nvidia_smi,
    "dcgm-exporter": by_dcgm_exporter,
}


def assert_the_bulk_sets_the_end(store: Store, fast: set[str]) -> None:
    build_aggregates(store)
    facts = stored_fleet_facts(store, FeatureSpec())
    assert facts is not None and set(facts.presence["gpu_uuid"]) >= fast
    lost = facts.episodes.filter(pl.col("source") == "lost")
    assert lost.height == 0, f"labelled lost: {sorted(lost['gpu_uuid'])}"
    assert facts.data_end == END
    rows = newest_on_demand(store)
    assert set(rows["ts"]) == {grid_floor(END, timedelta(hours=1))}
    assert {f"GPU-{n}-{g}" for n in NODES for g in range(8)} <= set(rows["gpu_uuid"])


@pytest.mark.parametrize("path", PATHS)
def test_one_gpu_ahead_through_an_importer(tmp_path: Path, path: str) -> None:
    store = bulk_fleet(tmp_path / "root")
    PATHS[path](store, tmp_path)
    assert_the_bulk_sets_the_end(store, {"GPU-fast"})


def test_a_node_ahead_through_the_nvml_collector(tmp_path: Path, use_scenario) -> None:
    store = bulk_fleet(tmp_path / "root")
    use_scenario(scenario_from_capture(H100))
    collector = NvmlCollector("c", FAST_NODE, clock=AheadClock())
    try:
        tables = [collector.collect()["telemetry"] for _ in range(6)]
    finally:
        collector.close()
    table = pa.concat_tables(tables)
    store.write("telemetry", table)
    assert_the_bulk_sets_the_end(store, set(table["gpu_uuid"].to_pylist()))


def test_kernel_log_xids_ahead_of_the_fleet_make_no_failure(tmp_path: Path) -> None:
    # A node's kernel log 36 h ahead (behind the wall clock, so the importer keeps it): its XID
    # must not label the hours before a failure that has not happened.
    store = bulk_fleet(tmp_path / "root")
    log = tmp_path / "syslog"
    log.write_text(
        "".join(
            f"{t.isoformat()} {FAST_NODE} kernel: NVRM: Xid (PCI:0000:{bus}:00): 79, pid=1, name=p, fell off\n"
            for t, bus in ((END - timedelta(hours=5), "10"), (END + AHEAD, "11"))
        )
    )
    ingest_kernel_logs(store, [log], cluster="c", dedup_window=timedelta(minutes=5), now=NOW)
    build_aggregates(store)
    facts = stored_fleet_facts(store, FeatureSpec())
    assert facts is not None
    xid = facts.episodes.filter(pl.col("source") == "xid")
    assert xid["gpu_uuid"].to_list() == [f"GPU-{FAST_NODE}-0"]
    assert facts.data_end == END


def xid_line(moment: datetime, n: int) -> str:
    return f"{moment.isoformat()} {FAST_NODE} kernel: NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=p, line {n}\n"


OUTLANDISH = [datetime(1970, 1, 1, 0, 0, 5, tzinfo=UTC), datetime(2099, 12, 31, tzinfo=UTC), NOW + timedelta(days=3)]


def test_kernel_log_lines_dated_far_outside_are_counted_and_kept_out(tmp_path: Path) -> None:
    good = [START + timedelta(hours=h) for h in range(3)]
    log = tmp_path / "syslog"
    log.write_text("".join(xid_line(t, n) for n, t in enumerate([good[0], *OUTLANDISH, *good[1:]])))
    store = Store.create(str(tmp_path / "root"))
    summary = ingest_kernel_logs(store, [log], cluster="c", dedup_window=timedelta(minutes=5), now=NOW)
    assert summary.implausible == len(OUTLANDISH)
    assert f"{len(OUTLANDISH)} XID lines dated before 2010 or ahead of this machine's clock left out" in str(summary)
    assert sorted(store.read("xid_events")["ts"].to_pylist()) == good


class FixedClock:
    def now(self) -> datetime:
        return NOW

    def monotonic(self) -> float:
        return 0.0

    def sleep(self, seconds: float) -> None:
        pass


def test_the_kernel_log_collector_counts_and_keeps_out_lines_dated_far_outside(tmp_path: Path) -> None:
    good = [NOW - timedelta(hours=h) for h in (3, 2, 1)]
    log = tmp_path / "kern.log"
    log.write_text("".join(xid_line(t, n) for n, t in enumerate([good[0], *OUTLANDISH, *good[1:]])))
    store = Store.create(str(tmp_path / "root"))
    collector = KernelLogCollector(
        store,
        FileSource([str(log)]),
        cluster="c",
        node=FAST_NODE,
        dedup_window=timedelta(minutes=5),
        clock=FixedClock(),
    )
    out = collector.collect()["xid_events"]
    out = pa.concat_tables([out, collector.drain()["xid_events"]])
    assert sorted(out["ts"].to_pylist()) == good
    assert collector.counts()["left_out"] == {"implausible_time": len(OUTLANDISH)}


def test_the_newest_materialised_grid_time_is_the_bulks(tmp_path: Path) -> None:
    # Feature rows written by `features --materialise` (or an older build) where one GPU's rows
    # run 36 h ahead of the rest: scoring reads the bulk's newest grid time, every GPU in it.
    store = bulk_fleet(tmp_path / "root")
    telemetry = pl.from_arrow(store.read("telemetry"))
    rows = build_features(telemetry, store.read("xid_events") if store.exists("xid_events") else _no_xids())
    one = rows.filter(pl.col("gpu_uuid") == "GPU-n1-0")
    fast = one.with_columns(pl.lit("GPU-fast").alias("gpu_uuid"), pl.col("ts") + AHEAD)
    write_features(store, pl.concat([rows, fast]))
    newest = read_newest_grid_time(store)
    assert set(newest["ts"]) == {rows["ts"].max()}
    assert {f"GPU-{n}-{g}" for n in NODES for g in range(8)} <= set(newest["gpu_uuid"])


def _no_xids() -> pa.Table:
    from ingest.schema import schema_for

    return schema_for("xid_events").empty_table()
