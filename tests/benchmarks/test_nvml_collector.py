"""`benchmarks.nvml_collector` against the fake 8 x H100 library: the collector and the daemon
benchmarks run in a child process that loads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.nvml_collector import run_with_library
from tests.fake_nvml.build import NoCompiler
from tests.fake_nvml.h100_node import fake_h100_node


def test_the_benchmark_runs_the_collector_on_eight_fake_h100s(tmp_path: Path) -> None:
    try:
        library_dir, env = fake_h100_node(tmp_path)
    except NoCompiler as exc:
        pytest.skip(f"fake libnvidia-ml.so.1 not built: {exc}")
    figures = run_with_library(library_dir, collections=3, env=env)
    assert figures["gpus"] == 8 and figures["collections"] == 3
    assert figures["us_per_gpu_sample"] > 0
    assert figures["us_per_collect"] == pytest.approx(figures["us_per_gpu_sample"] * 8, rel=0.05)


def test_the_daemon_benchmark_flushes_every_tick_of_eight_fake_h100s(tmp_path: Path) -> None:
    try:
        library_dir, env = fake_h100_node(tmp_path)
    except NoCompiler as exc:
        pytest.skip(f"fake libnvidia-ml.so.1 not built: {exc}")
    # 60 ticks of 10 s = 10 simulated minutes: two 5-minute flushes plus the final one
    figures = run_with_library(library_dir, env=env, daemon_ticks=60)
    assert figures["ticks"] == 60 and figures["interval_s"] == 10.0
    assert figures["telemetry_rows"] == (10 + 60) * 8  # warm-up ticks included, none lost
    assert figures["flushes"] >= 2
    assert figures["cpu_ms_per_tick"] > 0 and figures["peak_rss_mb"] > 0
