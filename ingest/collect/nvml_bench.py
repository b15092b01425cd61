"""What one NVML collection costs, per GPU sample.

`bench_nvml_collector` times `NvmlCollector.collect()` against whatever libnvidia-ml.so.1 this
process loads: the real one on a GPU node, or the fake from tests/fake_nvml (8 H100s from a
real capture) through `run_with_library`, which runs the benchmark in a child process whose
dynamic loader finds that library first (LD_LIBRARY_PATH), so pynvml loads it the normal way.

Against the fake, the figure is the collector's own cost (pynvml's ctypes calls, unit
conversion, Arrow tables), since the fake answers at once; on real hardware the driver's time
is added.

    python -m ingest.collect.nvml_bench --collections 2000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ingest.collect.nvml import NvmlCollector


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


def run_with_library(library_dir: Path, collections: int = 2000, env: dict[str, str] | None = None) -> dict[str, float]:
    """`bench_nvml_collector` in a child process that loads libnvidia-ml.so.1 from `library_dir`.

    `env` adds variables (the fake library reads its scenario from FAKE_NVML_CONFIG)."""
    child_env = {**os.environ, **(env or {})}
    child_env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(library_dir), os.environ.get("LD_LIBRARY_PATH")]))
    command = [sys.executable, "-m", "ingest.collect.nvml_bench", "--collections", str(collections), "--json"]
    result = subprocess.run(command, env=child_env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvml bench failed: {' '.join(command)}\n{result.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--collections", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = parser.parse_args(argv)
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
