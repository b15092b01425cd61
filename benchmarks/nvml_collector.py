"""What one NVML collection costs, per GPU sample.

`bench_nvml_collector` times `NvmlCollector.collect()` against whatever libnvidia-ml.so.1 this
process loads: the real one on a GPU node, or the fake from tests/fake_nvml (8 H100s from a
real capture: `bench_fake_h100_node`) through `run_with_library`, which runs the benchmark in a
child process whose dynamic loader finds that library first (LD_LIBRARY_PATH), so pynvml loads
it the normal way.

Against the fake, the figure is the collector's own cost (pynvml's ctypes calls, unit
conversion, Arrow tables), since the fake answers at once; on real hardware the driver's time
is added.

    python -m benchmarks.nvml_collector --collections 2000

`bench_daemon` measures the whole daemon in steady state (NVML collector, write buffer, a
Parquet flush every 5 minutes) on a simulated clock that advances only when the daemon sleeps:
CPU per tick and peak memory, hence the share of a core it takes at a given interval.

    python -m benchmarks.nvml_collector --daemon-ticks 1440
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from benchmarks import CHECKOUT
from ingest.collect.daemon import Daemon
from ingest.collect.nvml_collector import NvmlCollector
from ingest.store import Store
from tests.fakes import FakeClock


def bench_nvml_collector(collections: int = 2000, *, warmup: int = 20) -> dict[str, float]:
    """Call `collect()` `collections` times; microseconds per call and per GPU sample."""
    collector = NvmlCollector("bench", "bench-node")
    try:
        for _ in range(warmup):  # first call opens NVML, reads static attributes, registers events
            collector.collect()
        samples = 0
        started, cpu_started = time.perf_counter(), time.process_time()
        for _ in range(collections):
            samples += collector.collect()["telemetry"].num_rows
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        collector.close()
    if samples == 0:
        raise RuntimeError("nvml bench: the collector returned no telemetry rows (no GPU answered)")
    return {
        "gpus": samples / collections,
        "collections": collections,
        "us_per_collect": round(elapsed / collections * 1e6, 1),
        "us_per_gpu_sample": round(elapsed / samples * 1e6, 1),
        # CPU time of this process: on a shared machine, less inflated by others' work than wall time
        "cpu_us_per_gpu_sample": round(cpu / samples * 1e6, 1),
    }


def bench_daemon(ticks: int = 1440, *, interval_s: float = 10.0) -> dict[str, float]:
    """Run the daemon with the NVML collector for `ticks` intervals (1440 x 10 s = 4 h, 48
    flushes at the default 5-minute flush interval) into a temporary store; CPU per tick, the
    share of one core that makes at `interval_s`, and the process's peak RSS."""
    with tempfile.TemporaryDirectory(prefix="gpufail-daemon-bench-") as root:
        store = Store.create(root)
        clock = FakeClock()
        collector = NvmlCollector("bench", "bench-node", clock=clock)

        def daemon() -> Daemon:
            return Daemon(
                store,
                [collector],
                cluster="bench",
                node="bench-node",
                interval=timedelta(seconds=interval_s),
                flush_rows=50_000,
                flush_interval=timedelta(minutes=5),
                clock=clock,
            )

        daemon().run(max_ticks=10)  # warm-up: NVML init, handles, static attributes, first flush
        cpu_started = time.process_time()
        summary = daemon().run(max_ticks=ticks)
        cpu = time.process_time() - cpu_started
        rows = store.read("telemetry").num_rows
        collector.close()
    if rows == 0:
        raise RuntimeError("daemon bench: no telemetry was flushed (no GPU answered)")
    per_tick = cpu / ticks
    return {
        "ticks": ticks,
        "interval_s": interval_s,
        "telemetry_rows": rows,
        "flushes": summary.flushes,
        "cpu_ms_per_tick": round(per_tick * 1e3, 2),
        "core_percent": round(per_tick / interval_s * 100, 3),
        "peak_rss_mb": round(_peak_rss_kb() / 1024),
    }


def _peak_rss_kb() -> int:
    """This process's peak resident set, in KiB. VmHWM belongs to the process image, so it
    starts afresh at exec; getrusage's ru_maxrss does not (Linux carries it across exec), and in
    a child started by a large parent it reports the parent's size at the fork."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def run_with_library(
    library_dir: Path, collections: int = 2000, env: dict[str, str] | None = None, *, daemon_ticks: int = 0
) -> dict[str, float]:
    """`bench_nvml_collector` (or, with `daemon_ticks`, `bench_daemon`) in a child process that
    loads libnvidia-ml.so.1 from `library_dir`.

    `env` adds variables (the fake library reads its scenario from FAKE_NVML_CONFIG)."""
    child_env = {**os.environ, **(env or {})}
    child_env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(library_dir), os.environ.get("LD_LIBRARY_PATH")]))
    command = [sys.executable, "-m", "benchmarks.nvml_collector", "--collections", str(collections), "--json"]
    if daemon_ticks:
        command += ["--daemon-ticks", str(daemon_ticks)]
    result = subprocess.run(command, env=child_env, capture_output=True, text=True, cwd=CHECKOUT)
    if result.returncode != 0:
        raise RuntimeError(f"nvml bench failed: {' '.join(command)}\n{result.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures


def bench_fake_h100_node(collections: int = 2000) -> dict[str, float]:
    """`bench_nvml_collector` against the fake 8 x H100 node, built in a temporary folder.

    Raises `NoCompiler` where no C compiler exists."""
    from tests.fake_nvml.h100_node import fake_h100_node

    with tempfile.TemporaryDirectory(prefix="gpufail-fake-nvml-") as work:
        library_dir, env = fake_h100_node(Path(work))
        return run_with_library(library_dir, collections, env=env)


def bench_fake_h100_daemon(ticks: int = 1440) -> dict[str, float]:
    """`bench_daemon` against the fake 8 x H100 node (10-s interval).

    Raises `NoCompiler` where no C compiler exists."""
    from tests.fake_nvml.h100_node import fake_h100_node

    with tempfile.TemporaryDirectory(prefix="gpufail-fake-nvml-") as work:
        library_dir, env = fake_h100_node(Path(work))
        return run_with_library(library_dir, env=env, daemon_ticks=ticks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--collections", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    parser.add_argument("--daemon-ticks", type=int, default=0, help="benchmark the whole daemon for this many ticks")
    args = parser.parse_args(argv)
    if args.daemon_ticks:
        daemon = bench_daemon(args.daemon_ticks)
        print(
            json.dumps(daemon)
            if args.json
            else f"daemon: {daemon['cpu_ms_per_tick']} ms CPU per tick = {daemon['core_percent']}% of a core "
            f"at a {daemon['interval_s']:.0f}-s interval; peak RSS {daemon['peak_rss_mb']} MB"
        )
        return
    figures = bench_nvml_collector(args.collections)
    if args.json:
        print(json.dumps(figures))
    else:
        print(
            f"nvml collector: {figures['gpus']:.0f} GPUs, {figures['us_per_collect']:.0f} us per collect(), "
            f"{figures['us_per_gpu_sample']:.1f} us per GPU sample ({figures['cpu_us_per_gpu_sample']:.1f} us CPU; "
            f"{figures['collections']} calls)"
        )


if __name__ == "__main__":
    main()
