"""The collect daemon's /metrics, /healthz and /readyz, against a running daemon: real HTTP on a
free loopback port, the NVML collector on the fake libnvidia-ml.so.1, a scripted kernel log and
a clock the test moves tick by tick."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ingest.collect.base import CollectorError, SystemClock
from ingest.collect.daemon import Daemon, StopFlag
from ingest.collect.kernel_log_collector import KernelLogCollector
from ingest.collect.log_sources import Cursor, LogChunk
from ingest.collect.nvml_collector import NvmlCollector
from ingest.collect.observe import DaemonMetrics, Health, ObservabilityServer, parse_listen
from ingest.errors import InputError, StoreError
from ingest.store import Store
from tests.fake_nvml.scenario import scenario_from_capture
from tests.ingest.test_nvml_collector import A100

T0 = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
INTERVAL = 10.0


class GateClock:
    """Fake time for a daemon in another thread: its sleep() waits until the test lets that
    much time pass (`advance`), so the test sees the daemon between ticks, never mid-tick."""

    def __init__(self) -> None:
        self.t = T0
        self.mono = 0.0
        self._cond = threading.Condition()
        self._allowed = 0.0
        self._sleeping = False
        self._closed = False

    def now(self) -> datetime:
        return self.t

    def monotonic(self) -> float:
        return self.mono

    def sleep(self, seconds: float) -> None:
        with self._cond:
            self._sleeping = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._closed or self._allowed >= seconds - 1e-9)
            self._allowed = max(0.0, self._allowed - seconds)
            self.mono += seconds
            self.t += timedelta(seconds=seconds)
            self._sleeping = False

    def wait_between_ticks(self) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._sleeping and self._allowed < 1e-9, timeout=60)

    def advance(self, seconds: float) -> None:
        with self._cond:
            self._allowed += seconds
            self._cond.notify_all()
        self.wait_between_ticks()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class ScriptedLog:
    """A kernel log whose next read returns `pending` lines, or fails while `broken`; the first
    read waits for `first_read` so the test can look at the daemon before its first tick ends."""

    name = "scripted"

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.broken = False
        self.first_read = threading.Event()

    def read(self, cursor: Cursor | None, max_lines: int) -> LogChunk:
        assert self.first_read.wait(timeout=60)
        if self.broken:
            raise CollectorError("kernel-log collector: cannot read /var/log/kern.log (Permission denied)")
        start = cursor["next"] if cursor else 0
        lines = self.lines[start : start + max_lines]
        return LogChunk(lines, {"next": start + len(lines)}, exhausted=start + len(lines) >= len(self.lines))

    def close(self) -> None:
        pass


def xid_line(i: int) -> str:
    at = T0 - timedelta(hours=1) + timedelta(minutes=10 * i)
    return f"{at.isoformat()} gpu-node-017 kernel: NVRM: Xid (PCI:0000:9b:00): 79, pid={i}, name=python3, GPU has fallen off the bus."


REJECTED = f"{T0.isoformat()} gpu-node-017 kernel: NVRM: Xid (PCI:0000:9b:00): seventy-nine"


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(url + "/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    found = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def get(url: str, path: str) -> tuple[int, dict]:
    response = httpx.get(url + path, timeout=10)
    return response.status_code, response.json()


@pytest.fixture
def running(tmp_path, use_scenario, monkeypatch) -> Iterator[dict]:
    scenario = scenario_from_capture(A100)
    scenario.init_error = 9  # the driver is not loaded yet
    use_scenario(scenario)
    clock = GateClock()
    store = Store.create(str(tmp_path / "data"))
    log = ScriptedLog()
    log.lines = [xid_line(0), xid_line(1), REJECTED]
    collectors = [
        NvmlCollector("c1", "gpu-node-017", clock=clock),
        KernelLogCollector(
            store, log, cluster="c1", node="gpu-node-017", dedup_window=timedelta(minutes=5), clock=clock
        ),
    ]
    stop = StopFlag()
    daemon = Daemon(
        store,
        collectors,
        cluster="c1",
        node="gpu-node-017",
        interval=timedelta(seconds=INTERVAL),
        flush_rows=10_000,
        flush_interval=timedelta(seconds=INTERVAL),
        clock=clock,
        stop=stop,
        listen="127.0.0.1:0",
    )
    failure: list[BaseException] = []

    def run() -> None:
        try:
            daemon.run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for _ in range(600):
        if daemon.server is not None:
            break
        threading.Event().wait(0.05)
    assert daemon.server is not None, failure
    yield {
        "url": daemon.server.url,
        "clock": clock,
        "log": log,
        "scenario": scenario,
        "use_scenario": use_scenario,
        "daemon": daemon,
        "monkeypatch": monkeypatch,
    }
    log.first_read.set()
    stop.set("test over")
    clock.close()
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_the_endpoints_answer_and_the_metrics_follow_collections_and_flushes(running) -> None:
    url, clock, log = running["url"], running["clock"], running["log"]
    status, body = get(url, "/readyz")
    assert (status, body) == (503, {"status": "starting", "ticks": 0})  # the first tick is still running
    status, body = get(url, "/healthz")
    assert status == 503 and "no source succeeded" in body["reasons"][0]

    log.first_read.set()
    clock.wait_between_ticks()
    assert get(url, "/readyz") == (200, {"status": "ready", "ticks": 1})
    status, body = get(url, "/healthz")
    assert status == 200 and body["status"] == "ok"
    assert body["sources"]["kernel-log"] == {"last_success": T0.isoformat(), "last_error": None}
    assert body["sources"]["nvml"]["last_success"] is None
    assert "driver is not loaded" in body["sources"]["nvml"]["last_error"]
    assert body["last_flush"] is None and body["rows_buffered"] == 2 + 2  # 2 XID incidents, 2 runs
    m = metrics(url)
    assert m[("gpufail_collector_collections_total", (("outcome", "ok"), ("source", "kernel-log")))] == 1
    assert m[("gpufail_collector_collections_total", (("outcome", "error"), ("source", "nvml")))] == 1
    assert m[("gpufail_collector_collections_total", (("outcome", "ok"), ("source", "nvml")))] == 0
    assert m[("gpufail_collector_collection_duration_seconds_count", (("source", "nvml"),))] == 1
    assert m[("gpufail_collector_last_success_timestamp_seconds", (("source", "kernel-log"),))] == T0.timestamp()
    assert ("gpufail_collector_last_success_timestamp_seconds", (("source", "nvml"),)) not in m
    assert m[("gpufail_collector_nvml_errors_total", (("call", "nvmlInit"),))] == 1
    assert m[("gpufail_collector_log_lines_total", (("outcome", "parsed"),))] == 2
    assert m[("gpufail_collector_log_lines_total", (("outcome", "rejected"),))] == 1
    assert m[("gpufail_collector_last_flush_timestamp_seconds", ())] == 0  # none yet
    assert m[("gpufail_collector_flush_failures_total", ())] == 0
    assert m[("gpufail_collector_rows_buffered", ())] == 4

    # Every source fails: healthy while one succeeded within 3 intervals, then 503.
    log.broken = True
    for _ in range(3):
        clock.advance(INTERVAL)
        assert get(url, "/healthz")[0] == 200
    clock.advance(INTERVAL)
    status, body = get(url, "/healthz")
    assert status == 503 and body["status"] == "unhealthy"
    assert body["reasons"][0].startswith("no source succeeded in the last 3 intervals (30 s)")
    assert "Permission denied" in body["reasons"][0] and "driver is not loaded" in body["reasons"][0]
    m = metrics(url)
    assert m[("gpufail_collector_collections_total", (("outcome", "error"), ("source", "kernel-log")))] == 4
    assert m[("gpufail_collector_collections_total", (("outcome", "error"), ("source", "nvml")))] == 5
    assert m[("gpufail_collector_nvml_errors_total", (("call", "nvmlInit"),))] == 5
    assert m[("gpufail_collector_last_flush_timestamp_seconds", ())] == clock.t.timestamp()  # every interval
    assert m[("gpufail_collector_rows_buffered", ())] == 0

    # The driver is loaded: NVML succeeds, telemetry is written.
    running["scenario"].init_error = None
    running["use_scenario"](running["scenario"])
    clock.advance(INTERVAL)
    assert get(url, "/healthz")[0] == 200
    m = metrics(url)
    assert m[("gpufail_collector_collections_total", (("outcome", "ok"), ("source", "nvml")))] == 1
    assert m[("gpufail_collector_last_success_timestamp_seconds", (("source", "nvml"),))] == clock.t.timestamp()

    # The store refuses: the flush fails, rows are held, /healthz says why.
    def refuse(store, dataset, day, table, **options):
        raise StoreError(f"{store.path(dataset)}: could not write a part file (Read-only file system)")

    real_write_part = Store.write_part
    running["monkeypatch"].setattr(Store, "write_part", refuse)
    clock.advance(INTERVAL)
    status, body = get(url, "/healthz")
    assert status == 503 and body["reasons"] == [
        "the last flush failed: "
        f"{running['daemon'].store.path('telemetry')}: could not write a part file (Read-only file system)"
    ]
    held = body["rows_buffered"]
    assert held == 1 + 2  # one A100 sample and two collector runs
    m = metrics(url)
    assert m[("gpufail_collector_flush_failures_total", ())] == 1
    assert m[("gpufail_collector_rows_buffered", ())] == held
    assert (
        m[("gpufail_collector_last_flush_timestamp_seconds", ())] == (clock.t - timedelta(seconds=INTERVAL)).timestamp()
    )

    running["monkeypatch"].setattr(Store, "write_part", real_write_part)
    log.broken = False
    log.lines += [xid_line(2)]
    clock.advance(INTERVAL)
    status, body = get(url, "/healthz")
    assert status == 200 and body["rows_buffered"] == 0 and body["last_flush"] == clock.t.isoformat()
    m = metrics(url)
    assert m[("gpufail_collector_last_flush_timestamp_seconds", ())] == clock.t.timestamp()
    assert m[("gpufail_collector_log_lines_total", (("outcome", "parsed"),))] == 3
    assert get(url, "/elsewhere")[0] == 404


def test_listen_addresses_are_checked_in_one_line() -> None:
    assert parse_listen("") is None
    assert parse_listen("127.0.0.1:9410") == ("127.0.0.1", 9410)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("9410", "localhost", ":9410", "host:port", "127.0.0.1:70000"):
        with pytest.raises(InputError, match=r"\[collect\] listen = .*expected host:port such as 127.0.0.1:9410"):
            parse_listen(bad)


def test_an_address_in_use_is_one_line_and_nothing_is_collected(tmp_path) -> None:
    store = Store.create(str(tmp_path / "d"))
    server = ObservabilityServer("127.0.0.1:0", DaemonMetrics([]), Health(SystemClock(), 1.0, []))
    try:
        taken = server.url.removeprefix("http://")
        log = ScriptedLog()
        log.first_read.set()
        kernel_log = KernelLogCollector(store, log, cluster="c", node="n", dedup_window=timedelta(minutes=5))
        daemon = Daemon(
            store, [kernel_log], cluster="c", node="n", interval=timedelta(seconds=1), flush_rows=1,
            flush_interval=timedelta(seconds=1), listen=taken,
        )  # fmt: skip
        with pytest.raises(InputError, match=rf"\[collect\] listen = '{taken}': cannot serve metrics there"):
            daemon.run(max_ticks=1)
        assert daemon.summary.ticks == 0 and kernel_log.lines_read == 0
    finally:
        server.close()
