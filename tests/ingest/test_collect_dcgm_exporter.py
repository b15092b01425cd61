"""The dcgm-exporter collector against a real HTTP server on 127.0.0.1 serving real scrapes."""

from __future__ import annotations

import http.server
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ingest.collect.base import Collector, CollectorError
from ingest.collect.dcgm_exporter_collector import DcgmExporterCollector
from ingest.dcgm_scrape import parse_scrape

SCRAPES = Path(__file__).parents[1] / "fixtures" / "dcgm_exporter"
NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
HTML = b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>Please log in</body></html>\n"


class FixedClock:
    def now(self) -> datetime:
        return NOW

    def monotonic(self) -> float:
        return 0.0

    def sleep(self, seconds: float) -> None:
        raise AssertionError("the collector must not sleep")


@pytest.fixture(scope="module")
def exporter():
    """/metrics/<fixture> serves a scrape; /html a login page; /slow answers after 2 s."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            name = self.path.rsplit("/", 1)[-1]
            if self.path == "/html":
                body, kind = HTML, "text/html"
            elif self.path == "/slow":
                time.sleep(2)  # the client has given up by now: answer nothing
                return
            elif (SCRAPES / name).is_file():
                body, kind = (SCRAPES / name).read_bytes(), "text/plain; version=0.0.4"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def make(url: str, timeout_s: float = 5.0) -> DcgmExporterCollector:
    return DcgmExporterCollector(url, cluster="c1", node="gpu-node-017", clock=FixedClock(), timeout_s=timeout_s)


@pytest.mark.parametrize("scrape", sorted(p.name for p in SCRAPES.glob("*.prom")))
def test_each_real_scrape_becomes_one_telemetry_row_per_gpu_stamped_by_the_clock(exporter, scrape):
    collector = make(f"{exporter}/metrics/{scrape}")
    assert isinstance(collector, Collector)
    table = collector.collect()["telemetry"]
    expected = parse_scrape((SCRAPES / scrape).read_text(), now=NOW, cluster="c1", node="gpu-node-017")
    assert table.num_rows == expected.num_rows >= 1
    assert table.equals(expected)
    assert set(table["node"].to_pylist()) == {"gpu-node-017"}
    assert set(table["ts"].to_pylist()) == {NOW}


def test_an_html_page_is_a_collector_error_and_the_next_call_retries(exporter):
    collector = make(f"{exporter}/html")
    with pytest.raises(CollectorError, match=r"/html returned HTML \('<!DOCTYPE html>'\)"):
        collector.collect()
    collector.url = f"{exporter}/metrics/ericsson_T4_590.48.01.prom"
    assert collector.collect()["telemetry"].num_rows == 1


def test_a_timeout_and_a_404_are_collector_errors_naming_the_url(exporter):
    with pytest.raises(CollectorError, match=r"/slow: cannot fetch \(.*timed out"):
        make(f"{exporter}/slow", timeout_s=0.3).collect()
    with pytest.raises(CollectorError, match=r"/missing: cannot fetch \(HTTP Error 404"):
        make(f"{exporter}/missing").collect()
