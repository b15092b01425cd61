"""The collector daemon: independent failures, collector_runs, the flush policy, commits of
resumable collectors' states, a store that refuses writes, stopping, the registry, a SIGKILL at
any moment, and `gpufail collect` end to end. Metrics and probes: test_collect_observe.py."""

from __future__ import annotations

import http.server
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from ingest.collect.base import CollectorError
from ingest.collect.daemon import (
    REGISTRY,
    CollectOptions,
    Daemon,
    StopFlag,
    build_collectors,
    parse_sources,
    run_collect,
)
from ingest.errors import InputError, StoreError
from ingest.store import Store
from tests.conftest import make_rows
from tests.fake_nvml.build import NoCompiler, build_fake_nvml
from tests.fake_nvml.scenario import scenario_from_capture
from tests.fakes import FakeClock

T0 = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
GPUFAIL = [sys.executable, "-c", "from gpufail.cli import main; main()"]
SCRAPE = Path(__file__).parents[1] / "fixtures" / "dcgm_exporter" / "ericsson_T4_590.48.01.prom"


class EightGpus:
    """A telemetry collector: 8 GPU rows per call, taking 0.5 s of the fake clock."""

    name = "fake-gpus"

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.calls = 0
        self.closed = False

    def collect(self):
        self.calls += 1
        self.clock.mono += 0.5
        return {"telemetry": make_rows("telemetry", [self.clock.now()] * 8, node="n1", gpu_index=list(range(8)))}

    def close(self) -> None:
        self.closed = True


class Broken:
    def __init__(self, name: str, error: Exception) -> None:
        self.name = name
        self.error = error
        self.closed = False

    def collect(self):
        raise self.error

    def close(self) -> None:
        self.closed = True


class Numbered:
    """A resumable source of `total` XID rows numbered by pid, `per_call` per collect(); its
    state is the next number, as a kernel-log cursor is a position."""

    name = "numbered"

    def __init__(self, total: int, per_call: int) -> None:
        self.total, self.per_call = total, per_call
        self.next = 0
        self.calls = 0
        self.restored: list[dict | None] = []

    def collect(self):
        self.calls += 1
        end = min(self.next + self.per_call, self.total)
        pids = list(range(self.next, end))
        self.next = end
        return {"xid_events": make_rows("xid_events", [T0] * len(pids), node="n1", pci_bus_id="0000:9b:00", pid=pids)}

    @property
    def backlog(self) -> bool:
        return self.next < self.total

    def state(self) -> dict:
        return {"next": self.next}

    def restore(self, state) -> None:
        self.restored.append(state)
        self.next = state["next"] if state else 0

    def close(self) -> None:
        pass


def daemon(store: Store, collectors, clock: FakeClock, **kw) -> Daemon:
    options: dict[str, Any] = {
        "interval": timedelta(seconds=10),
        "flush_rows": 1000,
        "flush_interval": timedelta(minutes=5),
    }
    options.update(kw)
    return Daemon(store, collectors, cluster="c1", node="n1", clock=clock, **options)


def test_a_failing_collector_is_recorded_and_the_others_go_on(tmp_path):
    store, clock = Store.create(str(tmp_path / "d")), FakeClock(T0)
    good = EightGpus(clock)
    down = Broken("dcgm-exporter", CollectorError("dcgm-exporter collector: http://x/metrics: cannot fetch"))
    buggy = Broken("buggy", ZeroDivisionError("division by zero"))
    summary = daemon(store, [down, good, buggy], clock).run(max_ticks=3)
    assert good.calls == 3 and good.closed and down.closed and buggy.closed
    assert store.read("telemetry").num_rows == 24
    runs = store.read("collector_runs").to_pylist()
    assert len(runs) == 9
    by_name = {r["collector"]: r for r in runs}
    assert (
        by_name["fake-gpus"]["ok"] and by_name["fake-gpus"]["rows"] == 8 and by_name["fake-gpus"]["duration_s"] == 0.5
    )
    assert not by_name["dcgm-exporter"]["ok"] and "cannot fetch" in by_name["dcgm-exporter"]["error"]
    assert by_name["buggy"]["error"] == "buggy: unexpected ZeroDivisionError: division by zero"
    assert {r["node"] for r in runs} == {"n1"} and {r["cluster"] for r in runs} == {"c1"}
    assert summary.by_collector["dcgm-exporter"].failed == 3
    assert "dcgm-exporter 0 ok, 3 failed" in summary.line()


def test_ticks_keep_the_interval_and_flushes_follow_the_time_policy_in_separate_files(tmp_path):
    store, clock = Store.create(str(tmp_path / "d")), FakeClock(T0)
    lines: list[str] = []
    d = daemon(store, [EightGpus(clock)], clock, flush_interval=timedelta(minutes=1), report=lines.append)
    summary = d.run(max_ticks=13)  # 12 intervals of 10 s
    assert clock.mono == pytest.approx(120 + 0.5)  # the 0.5 s of collecting is inside the interval
    assert summary.flushes == 2  # after 60 s, and at the end
    files = store.files("telemetry")
    assert len(files) == 2 and store.read("telemetry").num_rows == 13 * 8
    assert all(line.startswith("collect: flushed") for line in lines)


def test_a_resumable_collectors_state_commits_with_the_rows_it_covers(tmp_path):
    store, clock = Store.create(str(tmp_path / "d")), FakeClock(T0)
    source = Numbered(total=2_000, per_call=30)
    seen: list[tuple[int, int]] = []

    def check(line: str) -> None:
        if line.startswith("collect: flushed"):
            committed = store.read_state("collect-n1")["collectors"]["numbered"]["next"]
            seen.append((committed, store.read("xid_events").num_rows))

    summary = daemon(store, [source], clock, flush_rows=100, report=check).run(max_ticks=1)
    assert source.restored == [None]  # nothing committed before
    # The backlog is read in one tick, flushed between pieces: never more than a flush behind.
    assert source.calls == 67 and summary.flushes == len(seen) > 15
    assert all(committed == visible for committed, visible in seen)  # state == rows, at every commit
    assert sorted(store.read("xid_events")["pid"].to_pylist()) == list(range(2_000))

    again = Numbered(total=2_500, per_call=30)
    daemon(store, [again], clock, flush_rows=100).run(max_ticks=1)
    assert again.restored == [{"next": 2_000}]
    assert sorted(store.read("xid_events")["pid"].to_pylist()) == list(range(2_500))


def test_a_source_not_run_keeps_its_committed_position(tmp_path):
    store, clock = Store.create(str(tmp_path / "d")), FakeClock(T0)
    daemon(store, [Numbered(total=10, per_call=10)], clock).run(max_ticks=1)
    daemon(store, [EightGpus(clock)], clock).run(max_ticks=1)
    assert store.read_state("collect-n1")["collectors"] == {"numbered": {"next": 10}}


def test_a_stop_request_drains_flushes_and_returns(tmp_path):
    store, clock = Store.create(str(tmp_path / "d")), FakeClock(T0)
    stop = StopFlag()

    class StopsAfterTwo(EightGpus):
        def collect(self):
            if self.calls == 1:
                stop.set("SIGTERM")
            return super().collect()

    summary = daemon(store, [StopsAfterTwo(clock)], clock, stop=stop).run()
    assert summary.ticks == 2 and summary.stop_reason == "SIGTERM"
    assert store.read("telemetry").num_rows == 16


def test_a_store_that_refuses_keeps_the_rows_for_the_next_flush(tmp_path):
    store, clock = Store.create(str(tmp_path / "d")), FakeClock(T0)
    real_write = store.write_part
    failures = iter([True, False, False, False])

    def flaky(dataset, day, table, **options):
        if next(failures, False):
            raise StoreError("disk full")
        return real_write(dataset, day, table, **options)

    store.write_part = flaky  # type: ignore[method-assign]
    lines: list[str] = []
    summary = daemon(store, [EightGpus(clock)], clock, flush_rows=5, report=lines.append).run(max_ticks=2)
    assert summary.flush_errors == 1 and "flush failed" in lines[0]
    assert store.read("telemetry").num_rows == 16  # nothing lost, nothing doubled
    assert store.read("collector_runs").num_rows == 2


def test_a_final_flush_that_fails_is_an_error(tmp_path):
    store, clock = Store.create(str(tmp_path / "d")), FakeClock(T0)

    def refuse(dataset, day, table, **options):
        raise StoreError("bucket unreachable")

    store.write_part = refuse  # type: ignore[method-assign]
    with pytest.raises(
        StoreError, match=r"last flush .* failed \(bucket unreachable\); telemetry 8, collector_runs 1 \(9 rows\)"
    ):
        daemon(store, [EightGpus(clock)], clock).run(max_ticks=1)


class Refusing:
    """Every part file the store writes, staged or not, fails like a full disk until `fixed`."""

    def __init__(self, monkeypatch) -> None:
        self.fixed = False
        self.refused = 0
        real = Store.write_part

        def write_part(store, dataset, day, table, **options):
            if not self.fixed:
                self.refused += 1
                raise StoreError(f"{store.path(dataset)}: could not write a part file (No space left on device)")
            return real(store, dataset, day, table, **options)

        monkeypatch.setattr(Store, "write_part", write_part)


def test_while_the_store_refuses_rows_are_held_reading_pauses_and_nothing_is_lost(tmp_path, monkeypatch):
    store, clock = Store.create(str(tmp_path / "d")), FakeClock(T0)
    source = Numbered(total=5_000, per_call=40)
    lines: list[str] = []
    refusing = Refusing(monkeypatch)
    d = daemon(store, [source], clock, flush_rows=100, report=lines.append)
    with pytest.raises(
        StoreError, match=r"last flush .* failed .*No space left.*; xid_events 1,000, collector_runs 23 "
    ):
        d.run(max_ticks=40)
    # A refused flush ends the tick's reading; once 10 x flush_rows are held, ticks read nothing.
    assert source.calls == 3 + 22 and source.next == 1_000
    assert sum("reading paused until a flush succeeds" in line for line in lines) == 1
    assert "holding xid_events 1,000, collector_runs 23 (1,023 rows" in next(line for line in lines if "paused" in line)
    assert d.summary.flush_errors > 40 and refusing.refused > 40
    assert store.read_state("collect-n1") is None  # the position was never committed
    assert not store.exists("xid_events")

    refusing.fixed = True  # space freed: the next start reads again from the committed position
    again = Numbered(total=5_000, per_call=40)
    daemon(store, [again], clock, flush_rows=100).run(max_ticks=1)
    assert again.restored == [None]
    assert sorted(store.read("xid_events")["pid"].to_pylist()) == list(range(5_000))


def test_reading_resumes_when_the_store_takes_writes_again(tmp_path, monkeypatch):
    store, clock = Store.create(str(tmp_path / "d")), FakeClock(T0)
    lines: list[str] = []
    refusing = Refusing(monkeypatch)

    def report(line: str) -> None:
        lines.append(line)
        if "reading paused" in line:
            refusing.fixed = True  # space is freed while the daemon holds its rows

    source = Numbered(total=3_000, per_call=40)
    summary = daemon(store, [source], clock, flush_rows=100, report=report).run(max_ticks=60)
    paused = next(i for i, line in enumerate(lines) if "reading paused" in line)
    assert "reading resumed" in lines[paused + 1]
    assert summary.flush_errors > 20 and source.next == 3_000
    assert sorted(store.read("xid_events")["pid"].to_pylist()) == list(range(3_000))
    assert store.read_state("collect-n1")["collectors"]["numbered"] == {"next": 3_000}


def test_sources_are_checked_against_the_registry():
    assert set(REGISTRY) == {"nvml", "kernel-log", "dcgm-exporter", "prometheus"}
    assert parse_sources("kernel-log, dcgm-exporter,kernel-log") == ("kernel-log", "dcgm-exporter")
    with pytest.raises(InputError, match="sources smi: unknown; expected .*nvml, kernel-log, dcgm-exporter"):
        parse_sources("kernel-log,smi")
    with pytest.raises(InputError, match=r"\(none\)"):
        parse_sources("")


def options(**kw) -> CollectOptions:
    values = {
        "cluster": "c1",
        "node": "n1",
        "sources": ("kernel-log",),
        "interval": timedelta(seconds=30),
        "flush_rows": 1000,
        "flush_interval": timedelta(minutes=5),
        "dcgm_exporter_url": "",
        "kernel_log_source": "files",
        "kernel_log_paths": (),
    }
    values.update(kw)
    return CollectOptions(**values)  # type: ignore[arg-type]


def test_collectors_that_cannot_be_built_are_named(tmp_path):
    store = Store.create(str(tmp_path / "d"))
    with pytest.raises(InputError, match="kernel_log_paths is empty"):
        build_collectors(store, options(), FakeClock(T0))
    with pytest.raises(InputError, match="dcgm_exporter_url is empty"):
        build_collectors(store, options(sources=("dcgm-exporter",)), FakeClock(T0))

    def missing(store, opts, clock):
        raise ImportError("No module named 'pynvml'")

    with pytest.raises(InputError, match="collector 'nvml': cannot be loaded .*pynvml"):
        build_collectors(store, options(sources=("nvml",)), FakeClock(T0), {"nvml": missing})


def test_run_collect_once_with_a_registered_fake(tmp_path):
    store, clock = Store.create(str(tmp_path / "d")), FakeClock(T0)
    fakes: list[EightGpus] = []

    def factory(store, opts, clk):
        fakes.append(EightGpus(clk))
        return fakes[-1]

    summary = run_collect(store, options(sources=("fake",)), once=True, clock=clock, registry={"fake": factory})
    assert summary.ticks == 1 and fakes[0].calls == 1 and clock.slept == 0
    assert store.read("telemetry").num_rows == 8


# -- real processes ------------------------------------------------------------------------


def syslog_line(i: int) -> str:
    at = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=10 * i)
    bus = f"0000:{0x18 + i % 8:02x}:00"
    return f"{at.isoformat()} gpu-node-017 kernel: NVRM: Xid (PCI:{bus}): 79, pid={i}, name=python3, GPU has fallen off the bus.\n"


def collect_env(log: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFAIL_")}
    env.update(
        GPUFAIL_COLLECT__KERNEL_LOG_SOURCE="files",
        GPUFAIL_COLLECT__KERNEL_LOG_PATHS=json.dumps([str(log)]),
        GPUFAIL_COLLECT__NODE="gpu-node-017",
        GPUFAIL_COLLECT__LISTEN="",  # tests run side by side: no fixed port
    )
    env.update(extra)
    return env


def every_file_reads(root: Path) -> int:
    """Rows in all visible Parquet files of xid_events, each file opened on its own."""
    return sum(pq.read_table(f).num_rows for f in root.glob("xid_events/date=*/part-*.parquet"))


def test_sigkill_at_any_moment_loses_nothing_flushed_and_a_restart_does_not_replay(tmp_path):
    lines = 3000
    log = tmp_path / "kern.log"
    log.write_text("".join(syslog_line(i) for i in range(lines)))
    root = tmp_path / "data"
    env = collect_env(log, GPUFAIL_COLLECT__MAX_LINES_PER_RUN="100", GPUFAIL_COLLECT__FLUSH_ROWS="50")
    cmd = [*GPUFAIL, "collect", "--out", str(root), "--source", "kernel-log", "--interval", "0.01s"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state = root / "_state" / "collect-gpu-node-017.json"
    deadline = time.monotonic() + 60
    while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(random.uniform(0.0, 0.3))  # then any moment: mid-read, mid-write, mid-checkpoint
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert state.exists(), proc.stderr.read().decode() if proc.stderr else ""
    flushed = every_file_reads(root)  # a killed write leaves at most a hidden .tmp file
    assert 0 < flushed <= lines

    done = subprocess.run([*cmd, "--max-runs", "60"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    store = Store.open(str(root))
    events = store.read("xid_events")
    assert every_file_reads(root) == events.num_rows == lines  # nothing lost, nothing twice
    assert len(set(events["pid"].to_pylist())) == lines


def test_a_read_far_larger_than_flush_rows_keeps_every_line(tmp_path):
    # 30,000 lines at flush_rows = 1000: once dropped whole as "store unwritable", with exit 0.
    lines = 30_000
    log = tmp_path / "kern.log"
    log.write_text("".join(syslog_line(i) for i in range(lines)))
    root = tmp_path / "data"
    env = collect_env(log, GPUFAIL_COLLECT__FLUSH_ROWS="1000")
    cmd = [*GPUFAIL, "collect", "--once", "--source", "kernel-log", "--out", str(root)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "dropped" not in result.stdout and "kernel-log 1 ok, 30000 rows" in result.stdout
    assert result.stdout.count("collect: flushed") >= 25  # in pieces of about flush_rows, as it read
    events = Store.open(str(root)).read("xid_events")
    assert events.num_rows == lines and sorted(events["pid"].to_pylist()) == list(range(lines))


def test_collect_once_fails_naming_each_source_when_every_source_failed(tmp_path):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    env = collect_env(tmp_path, GPUFAIL_COLLECT__DCGM_EXPORTER_URL=f"http://127.0.0.1:{port}/metrics")  # a folder
    sources = "kernel-log,dcgm-exporter"
    try:
        library_dir, extra = fake_nvml_without_driver(tmp_path / "nvml")
        env.update(extra, LD_LIBRARY_PATH=str(library_dir))
        sources += ",nvml"
    except NoCompiler:
        pass
    cmd = [*GPUFAIL, "collect", "--once", "--source", sources, "--out", str(tmp_path / "data")]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = result.stderr.strip().splitlines()
    names = sources.split(",")
    assert [line.split(" failed: ")[0] for line in errors[:-1]] == [f"collect: {n}" for n in names]
    assert f"cannot read {tmp_path}" in errors[0]
    assert f"127.0.0.1:{port}" in errors[1]
    if "nvml" in names:
        assert "driver is not loaded" in errors[2]
    assert errors[-1] == f"gpufail: error: collect: every source failed ({', '.join(names)}); nothing was collected"

    # One source that works is enough for exit 0.
    log = tmp_path / "kern.log"
    log.write_text(syslog_line(0))
    env["GPUFAIL_COLLECT__KERNEL_LOG_PATHS"] = json.dumps([str(log)])
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr


def fake_nvml_without_driver(work: Path) -> tuple[Path, dict[str, str]]:
    scenario = scenario_from_capture(Path(__file__).parents[1] / "fixtures" / "nvml" / "qx-a100.xml")
    scenario.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    library = build_fake_nvml(work)
    return library.parent, {"FAKE_NVML_CONFIG": str(scenario.write(work / "scenario.txt"))}


def test_a_read_only_store_keeps_the_cursor_and_exits_non_zero_then_a_rerun_writes_every_row(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs root and unshare(1) to mount the store read-only in a private mount namespace")
    lines = 500
    log = tmp_path / "kern.log"
    log.write_text("".join(syslog_line(i) for i in range(lines)))
    root = tmp_path / "data"
    Store.create(str(root))
    env = collect_env(log, GPUFAIL_COLLECT__FLUSH_ROWS="100")
    collect = shlex.join([*GPUFAIL, "collect", "--once", "--source", "kernel-log", "--out", str(root)])
    script = f"mount --bind {shlex.quote(str(root))} {shlex.quote(str(root))} && mount -o remount,bind,ro {shlex.quote(str(root))} && {collect}"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not allowed here: {probe.stderr.decode().strip()}")
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("gpufail: error: collect: the last flush to")
    assert f"failed ({root}/_state: could not create the lock file (Read-only file system)" in error[0]
    assert "; xid_events 200, collector_runs 1 (201 rows) were not written" in error[0]
    assert result.stdout.count("flush failed") == 2  # the first refusal ended the reading; then the last
    assert not (root / "_state").exists() and not list(root.glob("*/date=*/*.parquet"))  # nothing moved on

    done = subprocess.run(shlex.split(collect), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    events = Store.open(str(root)).read("xid_events")
    assert sorted(events["pid"].to_pylist()) == list(range(lines))


@pytest.fixture
def exporter():
    body = SCRAPE.read_bytes()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_gpufail_collect_once_from_the_kernel_log_and_dcgm_exporter(tmp_path, exporter):
    log = tmp_path / "kern.log"
    log.write_text("".join(syslog_line(i) for i in range(3)) + "an unrelated line\n")
    root = tmp_path / "data"
    env = collect_env(log, GPUFAIL_COLLECT__DCGM_EXPORTER_URL=exporter)
    cmd = [*GPUFAIL, "collect", "--once", "--source", "kernel-log,dcgm-exporter", "--out", str(root)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "collect: stopped (done) on gpu-node-017" in result.stdout
    assert "kernel-log 1 ok, 3 rows; dcgm-exporter 1 ok, 1 rows" in result.stdout
    store = Store.open(str(root))
    assert store.read("xid_events").num_rows == 3
    assert store.read("telemetry")["node"].to_pylist() == ["gpu-node-017"]
    runs = store.read("collector_runs").to_pylist()
    assert sorted((r["collector"], r["ok"]) for r in runs) == [("dcgm-exporter", True), ("kernel-log", True)]
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and store.read("xid_events").num_rows == 3  # the cursor: no replay


def test_gpufail_collect_refuses_bad_arguments_in_one_line(tmp_path):
    result = subprocess.run(
        [*GPUFAIL, "collect", "--once", "--source", "smi", "--out", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("gpufail: error: collector sources smi: unknown")
    assert len(result.stderr.strip().splitlines()) == 1


def test_sigterm_flushes_and_exits_zero(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("".join(syslog_line(i) for i in range(5)))
    root = tmp_path / "data"
    cmd = [*GPUFAIL, "collect", "--source", "kernel-log", "--interval", "1h", "--out", str(root)]
    # The first tick reads the five lines into the buffer, which is far from its flush size; the
    # daemon then waits an hour for the next tick. Only SIGTERM can write them.
    env = collect_env(
        log, GPUFAIL_COLLECT__FLUSH_ROWS="1000", GPUFAIL_COLLECT__LISTEN="127.0.0.1:0", PYTHONUNBUFFERED="1"
    )
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert " on http://" in first, first
    url = first.rsplit(" on ", 1)[1].strip()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _status(f"{url}/readyz") != 200:  # ready: the first tick is done
        time.sleep(0.05)
    assert not list(root.glob("xid_events/*/*.parquet")), "nothing should be flushed before SIGTERM"
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=60)
    out = first + rest
    assert proc.returncode == 0, err
    assert "stopped (SIGTERM)" in out
    assert Store.open(str(root)).read("xid_events").num_rows == 5


def _status(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0
