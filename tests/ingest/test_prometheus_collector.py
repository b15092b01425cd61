"""`gpufail collect --source prometheus` against a real Prometheus server scraping a local
endpoint that serves a real dcgm-exporter scrape (tests/fixtures/dcgm_exporter)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pyarrow as pa
import pytest

from ingest.collect.base import CollectorError
from ingest.collect.prometheus_collector import PrometheusCollector
from ingest.dcgm_scrape import parse_scrape
from ingest.prometheus_api import PrometheusClient
from ingest.prometheus_labels import LabelMap
from ingest.store import Store
from tests.cli import gpufail
from tests.ingest.prometheus_server import free_port, prometheus

# A real server and its history take seconds to start (module fixtures, one per worker).
pytestmark = pytest.mark.slow

SCRAPE = Path(__file__).parents[1] / "fixtures" / "dcgm_exporter" / "ericsson_T4_590.48.01.prom"


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    """host:port of a /metrics endpoint serving the real scrape."""
    body = SCRAPE.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, exporter):
    with prometheus(tmp_path_factory.mktemp("scraping") / "tsdb", [exporter], scrape_interval="1s") as running:
        yield running


def collector(url: str, **kwargs) -> PrometheusCollector:
    return PrometheusCollector(
        PrometheusClient(url), labels=LabelMap.of(None, "c1"), interval=timedelta(seconds=5), lag=timedelta(0), **kwargs
    )


def wait_for_rows(c: PrometheusCollector, timeout_s: float = 30) -> pa.Table:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        telemetry = c.collect().get("telemetry")
        if telemetry is not None and telemetry.num_rows:
            return telemetry
        time.sleep(1)
    raise AssertionError("no rows from the Prometheus collector")


def test_collected_rows_are_the_scrapes_readings_at_their_scrape_times(server):
    rows = wait_for_rows(collector(server.url))
    expected = parse_scrape(SCRAPE.read_text(), now=datetime.now(UTC), cluster="c1").drop(["ts"])
    assert rows.num_rows >= 1
    times = rows["ts"].to_pylist()
    assert len(set(times)) == len(times) and all(datetime.now(UTC) - t < timedelta(seconds=60) for t in times)
    for i in range(rows.num_rows):
        assert rows.slice(i, 1).drop(["ts"]).equals(expected)
    assert expected["temp_gpu_c"].to_pylist() == [74.0] and expected["sm_clock_mhz"].to_pylist() == [660.0]


def test_a_restored_collector_reads_on_from_the_committed_end(server):
    first = collector(server.url)
    seen = wait_for_rows(first)["ts"].to_pylist()
    cursor = first.state()["cursor_ms"]
    time.sleep(2.5)
    second = collector(server.url)
    second.restore(first.state())
    later = second.collect()["telemetry"]["ts"].to_pylist()
    assert later and min(later) > max(seen)
    assert all(t.timestamp() * 1000 > cursor for t in later)
    assert second.state()["cursor_ms"] > cursor


def test_a_server_that_is_down_is_one_collector_error():
    c = PrometheusCollector(
        PrometheusClient(f"http://127.0.0.1:{free_port()}", retries=0),
        labels=LabelMap.of(None, "c1"),
        interval=timedelta(seconds=5),
    )
    with pytest.raises(
        CollectorError, match=r"^prometheus collector: prometheus http://127.0.0.1:\d+/api/v1/query: .*refused"
    ):
        c.collect()


def test_collect_source_prometheus_writes_the_rows_to_the_store(tmp_path, server):
    # The daemon reads up to 10 s before now: wait until the server holds samples that old.
    client = PrometheusClient(server.url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now_ms = int(time.time() * 1000)
        held = client.samples('{__name__="DCGM_FI_DEV_GPU_TEMP"}', now_ms - 60_000, now_ms)
        if held and held[0].times_ms.min() < now_ms - 13_000:
            break
        time.sleep(1)
    conf = tmp_path / "gpufail.toml"
    conf.write_text(
        f'[ingest]\ncluster = "c1"\n[ingest.prometheus]\nurl = "{server.url}"\n[collect]\ninterval = "3s"\n'
    )
    done = gpufail(
        "--config",
        str(conf),
        "collect",
        "--source",
        "prometheus",
        "--once",
        "--listen",
        "",
        "--data",
        str(tmp_path / "root"),
    )
    assert done.returncode == 0, done.stderr
    telemetry = Store.open(str(tmp_path / "root")).read("telemetry")
    assert telemetry.num_rows >= 1, done.stdout
    assert set(telemetry["node"].to_pylist()) == {"cp-bm14r7"} and set(telemetry["temp_gpu_c"].to_pylist()) == {74.0}


def test_rows_committed_before_a_kill_are_not_read_again_after_the_restart(tmp_path, server):
    # The daemon commits telemetry first and the collectors' states after it: killed between
    # the two, it restarts from the older state with the newer rows already stored.
    store = Store.create(str(tmp_path / "root"))
    before = collector(server.url, store=store)
    wait_for_rows(before)
    old_state = before.state()
    time.sleep(2.5)
    stored = before.collect()["telemetry"]
    assert stored.num_rows
    store.write("telemetry", stored)
    time.sleep(1.5)
    after = collector(server.url, store=store)
    after.restore(old_state)
    again = after.collect()["telemetry"]
    assert again.num_rows >= 1  # the scrapes since
    assert not set(again["ts"].to_pylist()) & set(stored["ts"].to_pylist())
    assert min(again["ts"].to_pylist()) > max(stored["ts"].to_pylist())
