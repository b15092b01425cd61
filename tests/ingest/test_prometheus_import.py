"""`gpufail ingest prometheus` against a real Prometheus server (`tests.ingest.prometheus_server`):
history written by promtool as TSDB blocks, read back through the HTTP API."""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from ingest.prometheus_api import PrometheusClient, PrometheusUnavailable, parse_matrix
from ingest.prometheus_import import STATE_NAME, ImportOptions, import_prometheus
from ingest.prometheus_labels import LabelMap
from ingest.prometheus_rows import xid_table
from ingest.store import Store
from tests.cli import gpufail
from tests.ingest.prometheus_server import (
    Behaviour,
    free_port,
    openmetrics,
    prometheus,
    proxy,
    self_signed,
    write_blocks,
)

# A real server and its history take seconds to start (module fixtures, one per worker).
pytestmark = pytest.mark.slow

T0 = datetime(2026, 3, 1, tzinfo=UTC)
DAY2 = T0 + timedelta(days=1)
END = T0 + timedelta(days=2)
MINUTES = 2 * 1440
EQUAL_DAY = datetime(2026, 3, 5, tzinfo=UTC)
FIXTURES = Path(__file__).parents[1] / "fixtures" / "dcgm_exporter"
SCRAPES = ("ericsson_T4_590.48.01.prom", "vmware_vks_GRID-A100-8C_580.65.06.prom")
GAP = range(360, 390)  # n2 sends nothing 06:00-06:30 on the first day
RESET_AT = 1000  # n1 GPU 0's volatile DBE counter resets (a driver reload)


def gpu_labels(node: str, gpu: int) -> dict[str, str]:
    return {
        "Hostname": node,
        "gpu": str(gpu),
        "UUID": f"GPU-{node}-{gpu}",
        "pci_bus_id": f"00000000:{gpu + 1:02X}:00.0",
        "modelName": "NVIDIA H100 80GB HBM3",
        "DCGM_FI_DRIVER_VERSION": "550.54.15",
        "kubernetes_node": f"k8s-{node}",
    }


def xid_value(node: str, gpu: int, i: int) -> float:
    if (node, gpu) == ("n1", 0):
        return 0 if i < 600 else 79 if i < 1200 else 13
    if (node, gpu) == ("n2", 1):
        return 0 if i < 1440 + 300 else 31
    return 0


def temperature(node: str, gpu: int, i: int) -> float:
    if (node, gpu, i) == ("n1", 0, 100):
        return math.nan
    if (node, gpu, i) == ("n1", 0, 200):
        return 500  # above the valid range
    return 40 + (i % 20) + gpu


def history() -> list[tuple[str, dict[str, str], float, float]]:
    samples = []
    for node in ("n1", "n2", "n3"):
        for gpu in (0, 1):
            labels = gpu_labels(node, gpu)
            for i in range(MINUTES):
                if node == "n2" and i in GAP:
                    continue
                ts = T0.timestamp() + 60 * i
                dbe = (i - RESET_AT) // 100 if (node, gpu) == ("n1", 0) and i >= RESET_AT else i // 100
                samples += [
                    ("DCGM_FI_DEV_GPU_TEMP", labels, ts, temperature(node, gpu, i)),
                    ("DCGM_FI_DEV_POWER_USAGE", labels, ts, 300 + (i % 7) * 0.5),
                    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", labels, ts, dbe),
                    ("DCGM_FI_DEV_XID_ERRORS", labels, ts, xid_value(node, gpu, i)),
                    ("DCGM_FI_DEV_FB_FREE", labels, ts, 1000),  # no column of ours
                ]
                if (node, gpu) == ("n1", 0) and i >= 1440:
                    # A second Prometheus replica's copy of the same series, on day 2.
                    samples.append(("DCGM_FI_DEV_GPU_TEMP", {**labels, "replica": "b"}, ts, temperature(node, gpu, i)))
    no_uuid = {k: v for k, v in gpu_labels("n3", 0).items() if k != "UUID"}
    samples += [("DCGM_FI_DEV_GPU_TEMP", no_uuid, T0.timestamp() + 60 * i, 30) for i in range(10)]
    return samples + equality_samples()


def scrape_texts() -> dict[datetime, str]:
    """The real scrapes, with their readings changed a little at each of five times."""
    texts = {}
    for k in range(5):
        lines = []
        for name in SCRAPES:
            for line in (FIXTURES / name).read_text().splitlines():
                if line.startswith("DCGM_FI_"):
                    series, value = line.rsplit(" ", 1)
                    number = float(value)
                    lines.append(f"{series} {number + k if 0 < number < 1e15 else number!r}")
        texts[EQUAL_DAY + timedelta(minutes=k)] = "\n".join(lines) + "\n"
    return texts


def equality_samples() -> list[tuple[str, dict[str, str], float, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    samples = []
    for when, text in scrape_texts().items():
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.append((family.name, dict(s.labels), when.timestamp(), float(s.value)))
    return samples


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("prometheus") / "tsdb"
    write_blocks(openmetrics(history()), data)
    with prometheus(data) as running:
        yield running


def options(start: datetime = T0, end: datetime = END, **kwargs) -> ImportOptions:
    return ImportOptions(start=start, end=end, labels=LabelMap.of(None, "c1"), **kwargs)


def imported(tmp_path: Path, url: str, name: str = "root", **kwargs):
    store = Store.create(str(tmp_path / name))
    summary = import_prometheus(store, PrometheusClient(url, retry_pause_s=0.01), options(**kwargs))
    return store, summary


def sorted_rows(table: pa.Table) -> pa.Table:
    return table.sort_by([("node", "ascending"), ("gpu_index", "ascending"), ("ts", "ascending")])


def at(i: int) -> datetime:
    return T0 + timedelta(minutes=i)


# -- what is imported -----------------------------------------------------------------------


def test_samples_land_at_their_own_times_with_gaps_resets_and_missing_readings(tmp_path, server):
    store, summary = imported(tmp_path, server.url)
    telemetry = sorted_rows(store.read("telemetry"))
    per_gpu = pc.value_counts(pc.binary_join_element_wise(telemetry["node"], telemetry["gpu_uuid"], "/")).to_pylist()
    counts = {c["values"]: c["counts"] for c in per_gpu}
    assert counts == {
        "n1/GPU-n1-0": MINUTES,
        "n1/GPU-n1-1": MINUTES,
        "n2/GPU-n2-0": MINUTES - len(GAP),
        "n2/GPU-n2-1": MINUTES - len(GAP),
        "n3/GPU-n3-0": MINUTES,
        "n3/GPU-n3-1": MINUTES,
    }
    assert summary.rows == telemetry.num_rows and summary.windows == 2
    n1 = telemetry.filter(pc.field("gpu_uuid") == "GPU-n1-0")
    # Every sample at its own minute, in order, once (the replica's copies were dropped).
    assert n1["ts"].to_pylist() == [at(i) for i in range(MINUTES)]
    assert summary.duplicates == 1440
    temps = n1["temp_gpu_c"].to_pylist()
    assert temps[100] is None and temps[200] is None and temps[101] == 40 + 101 % 20
    assert summary.blank_values == 1 and summary.out_of_range == {"temp_gpu_c": 1}
    dbe = n1["ecc_dbe_volatile_total"].to_pylist()
    assert dbe[RESET_AT - 1] == 9 and dbe[RESET_AT] == 0  # the counter's reset is kept
    assert n1["power_w"].to_pylist()[:3] == [300.0, 300.5, 301.0]
    first = n1.slice(0, 1).to_pylist()[0]
    assert (first["cluster"], first["pci_bus_id"], first["gpu_model"], first["driver"]) == (
        "c1",
        "0000:01:00",
        "NVIDIA H100 80GB HBM3",
        "550.54.15",
    )
    n2 = telemetry.filter(pc.field("node") == "n2")["ts"].to_pylist()
    assert not [t for t in n2 if at(GAP.start) <= t < at(GAP.stop)]
    assert summary.unlabelled == {"no UUID label": 1}
    assert summary.ignored_series == {"DCGM_FI_DEV_FB_FREE": 6}
    assert "1 series left out (no UUID label: 1)" in summary.line()


def test_xid_changes_are_events_and_a_kernel_log_xid_is_not_counted_twice(tmp_path, server):
    store = Store.create(str(tmp_path / "root"))
    # The kernel log saw the XID 79 half a minute before the scrape did.
    logged = xid_table(
        [
            (
                int((at(600) - timedelta(seconds=30)).timestamp() * 1000),
                ("c1", "n1", 0, "GPU-n1-0"),
                ("0000:01:00", None, None),
                79,
            )
        ]
    )
    store.write(
        "xid_events", logged.set_column(logged.schema.get_field_index("source"), "source", pa.array(["file:n1.log"]))
    )
    summary = import_prometheus(store, PrometheusClient(server.url), options())
    events = store.read("xid_events").sort_by("ts")
    got = [(e["ts"], e["node"], e["gpu_index"], e["xid"], e["source"]) for e in events.to_pylist()]
    assert got == [
        (at(600) - timedelta(seconds=30), "n1", 0, 79, "file:n1.log"),
        (at(1200), "n1", 0, 13, "prometheus"),
        (at(1440 + 300), "n2", 1, 31, "prometheus"),
    ]
    assert (summary.xid_events, summary.xid_merged) == (2, 1)


def test_a_range_imported_in_pieces_gives_the_rows_of_one_import(tmp_path, server):
    whole, _ = imported(tmp_path, server.url, "whole")
    store = Store.create(str(tmp_path / "pieces"))
    client = PrometheusClient(server.url)
    for start, end in ((T0, at(700)), (at(700), DAY2 + timedelta(hours=3)), (DAY2 + timedelta(hours=3), END)):
        import_prometheus(store, client, options(start, end))
    assert sorted_rows(store.read("telemetry")).equals(sorted_rows(whole.read("telemetry")))
    # The XID value held before each piece is known: no piece takes it for a new XID.
    assert store.read("xid_events").sort_by("ts").equals(whole.read("xid_events").sort_by("ts"))


def test_a_rerun_writes_nothing_and_an_overlapping_range_only_what_is_new(tmp_path, server):
    store, first = imported(tmp_path, server.url, end=DAY2)
    files = sorted(store.files("telemetry"))
    again = import_prometheus(store, PrometheusClient(server.url), options(end=DAY2))
    assert again.already_imported and "imported before; nothing written" in again.line()
    assert sorted(store.files("telemetry")) == files
    more = import_prometheus(store, PrometheusClient(server.url), options(T0 + timedelta(hours=12), END))
    assert more.rows == 6 * 1440 and first.rows == 6 * 1440 - 2 * len(GAP)
    telemetry = store.read("telemetry")
    keys = pc.binary_join_element_wise(telemetry["gpu_uuid"], pc.cast(telemetry["ts"], pa.string()), "@")
    assert pc.count_distinct(keys).as_py() == telemetry.num_rows == 6 * MINUTES - 2 * len(GAP)


def test_the_same_samples_from_scrape_texts_and_from_prometheus_give_identical_rows(tmp_path, server):
    # A user metric from a DCGM profiling field the catalogue does not hold, both ways.
    conf = tmp_path / "gpufail.toml"
    conf.write_text(
        '[metrics.gr_engine_active]\nkind = "gauge"\nunit = "ratio"\nmax = 1\n'
        'dcgm_field = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"\n'
    )
    for when, text in scrape_texts().items():
        scrape = tmp_path / f"scrape-{when:%H%M}.prom"
        scrape.write_text(text)
        done = gpufail(
            "--config", str(conf), "ingest", "dcgm-exporter", "--data", str(tmp_path / "scraped"),
            "--time", when.isoformat(), str(scrape),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    done = gpufail(
        "--config", str(conf), "ingest", "prometheus", "--data", str(tmp_path / "pulled"), "--url", server.url,
        "--start", EQUAL_DAY.isoformat(), "--end", (EQUAL_DAY + timedelta(hours=1)).isoformat(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    scraped = sorted_rows(Store.open(str(tmp_path / "scraped")).read("telemetry"))
    pulled = sorted_rows(Store.open(str(tmp_path / "pulled")).read("telemetry"))
    assert scraped.num_rows == 5 * 2  # one T4 and one vGPU A100, five times
    assert pulled.equals(scraped)
    assert scraped["temp_mem_c"].null_count == scraped.num_rows  # the T4's 0 and the vGPU's absence
    # The T4's 0.156205 at the first time; +1 at later ones is above the metric's max of 1.
    assert scraped["gr_engine_active"].drop_null().to_pylist() == [0.156205]


def test_a_label_map_names_the_labels_of_other_exporters(tmp_path, server):
    store = Store.create(str(tmp_path / "root"))
    labels = LabelMap.of({"node": "kubernetes_node", "cluster": "region"}, "c9")
    options = ImportOptions(start=T0, end=T0 + timedelta(hours=1), labels=labels)
    summary = import_prometheus(store, PrometheusClient(server.url), options)
    telemetry = store.read("telemetry")
    assert set(telemetry["node"].to_pylist()) == {"k8s-n1", "k8s-n2", "k8s-n3"}
    assert set(telemetry["cluster"].to_pylist()) == {"c9"}  # no region label: the default
    assert summary.rows == 6 * 60


def test_the_label_map_takes_only_identity_columns(tmp_path):
    conf = tmp_path / "bad.toml"
    conf.write_text('[ingest.prometheus.labels]\nhost = "instance"\n')
    done = gpufail(
        "--config",
        str(conf),
        "ingest",
        "prometheus",
        "--data",
        str(tmp_path / "r"),
        "--start",
        "2026-01-01",
        "--end",
        "2026-01-02",
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert (
        "prometheus.labels" in done.stderr
        and "expected keys among node, gpu_uuid" in done.stderr
        and "host" in done.stderr
    )


# -- bad input ------------------------------------------------------------------------------


def config(tmp_path: Path, **keys: object) -> str:
    path = tmp_path / "gpufail.toml"
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in keys.items())
    path.write_text(f"[ingest.prometheus]\n{body}\n")
    return str(path)


def run_import(tmp_path: Path, url: str, *extra: str, conf: str | None = None, env=None, end: datetime = END):
    args = ["--config", conf] if conf else []
    return gpufail(
        *args, "ingest", "prometheus", "--data", str(tmp_path / "root"), "--url", url,
        "--start", T0.isoformat(), "--end", end.isoformat(), *extra, env=env,
    )  # fmt: skip


def test_a_server_that_is_down_is_one_line_and_leaves_nothing(tmp_path):
    done = run_import(tmp_path, f"http://127.0.0.1:{free_port()}", conf=config(tmp_path, retries=1))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "after 2 tries" in done.stderr and "Connection refused" in done.stderr
    assert not (tmp_path / "root").exists()


def test_5xx_answers_are_retried(tmp_path, server):
    behaviour = Behaviour(fail_first=2)
    with proxy(server.url, behaviour) as url:
        store = Store.create(str(tmp_path / "root"))
        summary = import_prometheus(store, PrometheusClient(url, retry_pause_s=0.01), options(end=DAY2))
    assert summary.retries == 2 and summary.rows == 6 * 1440 - 2 * len(GAP)
    assert "2 queries retried" in summary.line()


def test_a_slow_server_times_out_into_one_line(tmp_path, server):
    with proxy(server.url, Behaviour(delay_s=3)) as url:
        done = run_import(tmp_path, url, conf=config(tmp_path, retries=1, timeout="1s"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "timed out after 2 tries" in done.stderr


def test_a_server_lost_midway_commits_whole_windows_and_the_rerun_finishes_exactly(tmp_path, server):
    clean, _ = imported(tmp_path, server.url, "clean")
    store = Store.create(str(tmp_path / "root"))
    # The server goes away once the import reaches the second day.
    day2_s = DAY2.timestamp()
    lost = Behaviour(fail_if=lambda params: float(params.get("time", params.get("start", 0))) > day2_s)
    with proxy(server.url, lost) as url, pytest.raises(PrometheusUnavailable, match="HTTP 503"):
        import_prometheus(store, PrometheusClient(url, retries=1, retry_pause_s=0.01), options())
    state = store.read_state(STATE_NAME)
    assert state is not None and state["imported"]["c1 "] == [
        [int(T0.timestamp() * 1000), int(DAY2.timestamp() * 1000)]
    ]
    assert store.read("telemetry").num_rows == 6 * 1440 - 2 * len(GAP)  # the first day, whole
    import_prometheus(store, PrometheusClient(server.url), options())
    assert sorted_rows(store.read("telemetry")).equals(sorted_rows(clean.read("telemetry")))
    assert store.read("xid_events").sort_by("ts").equals(clean.read("xid_events").sort_by("ts"))


def test_warnings_of_partial_answers_are_counted(tmp_path, server):
    with proxy(server.url, Behaviour(warning="store eu-1 did not answer")) as url:
        _, summary = imported(tmp_path, url, end=DAY2)
    assert summary.warnings == summary.queries > 0
    assert (
        f"{summary.warnings} answers with warnings (partial data; first: store eu-1 did not answer)" in summary.line()
    )


def test_a_selector_matching_nothing_is_one_line(tmp_path, server):
    done = run_import(tmp_path, server.url, "--match", '{Hostname="nowhere"}')
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "no DCGM series on" in done.stderr and 'Hostname="nowhere"' in done.stderr
    assert not (tmp_path / "root").exists()


def test_a_bad_selector_is_the_servers_one_line(tmp_path, server):
    done = run_import(tmp_path, server.url, "--match", '{Hostname=~"("}')
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "HTTP 400: bad_data" in done.stderr and "expected a valid series selector" in done.stderr


def test_a_range_before_the_data_writes_nothing_and_says_so(tmp_path, server):
    done = gpufail(
        "ingest", "prometheus", "--data", str(tmp_path / "root"), "--url", server.url,
        "--start", "2025-01-01", "--end", "2025-01-03",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "no samples between 2025-01-01T00:00:00Z and 2025-01-03T00:00:00Z" in done.stdout
    assert "nothing written" in done.stdout
    assert not Store.open(str(tmp_path / "root")).exists("telemetry")


def test_a_selector_narrows_the_import(tmp_path, server):
    _, summary = imported(tmp_path, server.url, end=DAY2, match='DCGM_FI_DEV_GPU_TEMP{Hostname="n3"}')
    assert summary.rows == 2 * 1440 and summary.series == 3  # the third has no UUID
    assert summary.unlabelled == {"no UUID label": 1} and summary.xid_events == 0


# -- authentication -------------------------------------------------------------------------


def test_credentials_come_from_the_environment_and_are_never_printed(tmp_path, server):
    behaviour = Behaviour(token="s3cret-token")
    with proxy(server.url, behaviour) as url:
        refused = run_import(tmp_path, url, end=DAY2)
        assert refused.returncode == 2 and "HTTP 401" in refused.stderr
        assert "GPUFAIL_PROMETHEUS_TOKEN" in refused.stderr
        done = run_import(tmp_path, url, "--json", end=DAY2, env={"GPUFAIL_PROMETHEUS_TOKEN": "s3cret-token"})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["rows"] == 6 * 1440 - 2 * len(GAP)
        with_user = url.replace("http://", "http://admin:hunter2@")
        basic = run_import(tmp_path / "b", with_user, end=DAY2)
    for result in (refused, done, basic):
        assert "s3cret-token" not in result.stdout + result.stderr
    assert "hunter2" not in basic.stdout + basic.stderr and "HTTP 401" in basic.stderr


def test_a_matrix_answer_is_read_whatever_its_labels_and_spacing():
    body = (
        b'{"status":"success","data":{"resultType":"matrix","result":['
        b'{"metric":{"__name__":"a","Hostname":"n\\u00f6de \\"x\\" ]]"}, "values":[[1700000000.5,"NaN"], [1700000060,"+Inf"]]},'
        b'{"metric":{},"values":[[1,"-2.5e3"]]}]}}'
    )
    first, second = parse_matrix(body)
    assert first.labels == {"__name__": "a", "Hostname": 'nöde "x" ]]'}
    assert first.times_ms.tolist() == [1700000000500, 1700000060000]
    assert math.isnan(first.values[0]) and first.values[1] == math.inf
    assert second.labels == {} and second.values.tolist() == [-2500.0]


def test_an_import_killed_after_its_first_commit_is_finished_exactly_by_the_rerun(tmp_path, server):
    import signal
    import subprocess
    import time

    from tests.cli import GPUFAIL, gpufail_env

    clean, _ = imported(tmp_path, server.url, "clean")
    root = tmp_path / "root"
    state = root / "_state" / f"{STATE_NAME}.json"
    with proxy(server.url, Behaviour(delay_s=0.3)) as url:
        child = subprocess.Popen(
            [*GPUFAIL, "ingest", "prometheus", "--data", str(root), "--url", url,
             "--start", T0.isoformat(), "--end", END.isoformat()],
            env=gpufail_env({"GPUFAIL_INGEST__CLUSTER": "c1"}), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not state.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert state.exists() and child.returncode == -signal.SIGKILL  # killed midway, one day committed
    store = Store.open(str(root))
    assert 0 < store.read("telemetry").num_rows < clean.read("telemetry").num_rows
    import_prometheus(store, PrometheusClient(server.url), options())
    assert sorted_rows(store.read("telemetry")).equals(sorted_rows(clean.read("telemetry")))
    assert store.read("xid_events").sort_by("ts").equals(clean.read("xid_events").sort_by("ts"))


def test_https_with_the_servers_ca_file(tmp_path, server):
    cert, key = self_signed(tmp_path)
    with proxy(server.url, Behaviour(), tls=(cert, key)) as url:
        untrusted = run_import(tmp_path / "a", url, end=DAY2)
        trusted = run_import(tmp_path / "b", url, "--ca-file", str(cert), "--json", end=DAY2)
    assert untrusted.returncode == 2 and untrusted.stderr.count("\n") == 1
    assert "TLS failed" in untrusted.stderr and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    assert trusted.returncode == 0, trusted.stderr
    assert json.loads(trusted.stdout)["rows"] == 6 * 1440 - 2 * len(GAP)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--start", "2026-03-02", "--end", "2026-03-01"), "expected a range that starts before it ends"),
        (("--start", "2026-03-01", "--end", "2026-03-02", "--step", "soon"), "'--step'.*expected a duration"),
        (("--start", "yesterday", "--end", "2026-03-02"), "'--start'.*expected an ISO date"),
        (("--start", "2026-03-01", "--end", "2026-03-02", "--match", "{"), "--match '{': expected a series selector"),
    ],
)
def test_bad_arguments_are_one_line_and_create_nothing(tmp_path, args, message):
    done = gpufail("ingest", "prometheus", "--data", str(tmp_path / "root"), "--url", "http://127.0.0.1:9", *args)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert re.search(message, done.stderr), done.stderr
    assert not (tmp_path / "root").exists()
