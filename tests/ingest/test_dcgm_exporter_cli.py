"""`gpufail ingest dcgm-exporter` against a real HTTP server on loopback serving a real scrape."""

from __future__ import annotations

import http.server
import socket
import threading
from pathlib import Path

import pytest

from ingest.store import Store
from tests.cli import gpufail

FIXTURE = Path(__file__).parents[1] / "fixtures" / "dcgm_exporter" / "ericsson_T4_590.48.01.prom"


@pytest.fixture
def exporter():
    body = FIXTURE.read_bytes()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body if self.path == "/metrics" else b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()


def test_scraping_a_live_exporter_writes_its_gpu_into_telemetry(tmp_path, exporter):
    result = gpufail("ingest", "dcgm-exporter", "--data", str(tmp_path / "root"), exporter)
    assert result.returncode == 0, result.stderr
    assert "1 GPU samples from 1 scrape(s)" in result.stdout
    table = Store.open(str(tmp_path / "root")).read("telemetry")
    assert table.num_rows == 1
    row = table.to_pylist()[0]
    assert row["gpu_uuid"].startswith("GPU-6d5c0ac5")
    assert row["pci_bus_id"] == "0000:37:00"
    assert row["temp_gpu_c"] == 74.0
    assert row["temp_mem_c"] is None  # a T4 has no HBM temperature sensor: it reports 0


def test_an_unreachable_exporter_is_named_and_nothing_is_written(tmp_path, exporter):
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
    result = gpufail("ingest", "dcgm-exporter", "--data", str(tmp_path / "root"), exporter, dead)
    assert result.returncode == 2
    assert f"dcgm-exporter scrape {dead}: cannot fetch" in result.stderr
    assert not (tmp_path / "root").exists()  # not even an empty data root


def test_a_missing_scrape_file_is_named(tmp_path):
    result = gpufail("ingest", "dcgm-exporter", "--data", str(tmp_path / "root"), str(tmp_path / "nope.prom"))
    assert result.returncode == 2
    assert "nope.prom: cannot read" in result.stderr
