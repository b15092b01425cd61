"""`make bench`: measure the demo pipeline stage by stage, and the hot loops on their own.

Each pipeline stage runs as its own process (the same `gpufail` command a user runs), so its
wall time and peak memory are its own. On a shared machine the same run can vary up to 2x
minutes apart (docs/performance.md): compare figures from one run, and rerun before trusting a
small difference. Results go to `bench.md` (a table) and `bench.json`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

# Runs one gpufail command and reports its own peak resident memory on stderr's last line.
_CHILD = (
    "import resource, sys\n"
    "from gpufail.cli import main\n"
    "sys.argv = ['gpufail', *sys.argv[1:]]\n"
    "try:\n"
    "    main()\n"
    "finally:\n"
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child would report the
    # bench process's own size when that is larger.
    "    hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')]\n"
    "    kb = hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
    "    print(f'\\nGPUFAIL_BENCH_MAXRSS_KB={kb}', file=sys.stderr)\n"
)


@dataclass
class StageResult:
    stage: str
    command: str
    seconds: float
    peak_rss_mb: float
    output: str


def run_stage(stage: str, args: list[str], env: dict[str, str] | None = None) -> StageResult:
    """Run `gpufail *args` in a child process (with `env` added to this environment)."""
    started = time.perf_counter()
    child_env = None if env is None else {**os.environ, **env}
    result = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, env=child_env)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"bench stage {stage!r} failed: gpufail {' '.join(args)}\n{result.stderr[-2000:]}")
    peak_kb = next(
        int(line.split("=", 1)[1])
        for line in reversed(result.stderr.splitlines())
        if line.startswith("GPUFAIL_BENCH_MAXRSS_KB=")
    )
    return StageResult(
        stage, "gpufail " + " ".join(args), round(seconds, 2), round(peak_kb / 1024, 1), result.stdout.strip()
    )


def demo_pipeline(work: Path) -> list[StageResult]:
    data, out = str(work / "demo-data"), work / "out"
    stages = [
        ("simulate", ["simulate", "--out", data, "--preset", "demo", "--quiet"]),
        ("ingest kernel-log", ["ingest", "kernel-log", "--data", data]),
        ("features", ["features", "--data", data, "--quiet"]),
        ("features --materialise", ["features", "--materialise", "--data", data, "--quiet"]),
        ("train", ["train", "--data", data, "--model-out", str(out / "model")]),
        ("evaluate", ["evaluate", "--data", data, "--report", str(out / "report")]),
        ("score", ["score", "--data", data, "--model", str(out / "model")]),
        ("publish (dry run)", ["publish", "--data", data, "--dry-run"]),
    ]
    results = []
    for name, args in stages:
        results.append(run_stage(name, args))
        print(f"  {name}: {results[-1].seconds:.1f} s, {results[-1].peak_rss_mb:.0f} MB", file=sys.stderr)
    return results


# micro_benchmarks' key of one log format's parse + dedup figure: the prefix, then the format.
_KERNEL_LOG_FORMAT_KEY = "kernel_log_parse_lines_per_s."


def micro_benchmarks() -> dict[str, float]:
    """The hot loops alone, in this process: parse speed and in-memory feature building."""
    from benchmarks.explain import bench_explain
    from benchmarks.feature_build import bench_build, bench_compare
    from benchmarks.kernel_log_parse import bench_formats

    parse = bench_formats(1_000_000, repeat=2)  # CPU lines/s per log format
    build = bench_build(n_gpus=128, hours=130, repeat=2)
    versus = bench_compare(n_gpus=32, hours=130)
    explained = bench_explain(rows=1000, n_features=411, repeat=3)
    return {
        "kernel_log_parse_lines_per_s": round(min(parse.values())),  # the worst format
        **{f"{_KERNEL_LOG_FORMAT_KEY}{log_format}": round(v) for log_format, v in parse.items()},
        "feature_build_rows_per_s": round(build["rows_per_s"]),
        "feature_compare_telemetry_rows": round(versus["telemetry_rows"]),
        "feature_compare_gpufail_rows_per_s": round(versus["gpufail_rows_per_s"]),
        "feature_compare_pandas_rows_per_s": round(versus["pandas_rows_per_s"]),
        "explain_lightgbm_rows_per_s": round(explained["rows_per_s"]),
        **nvml_collector_micro(),
    }


def nvml_collector_micro() -> dict[str, float]:
    """The NVML collector against the fake libnvidia-ml.so.1 (8 x H100) in tests/fake_nvml; empty
    where no C compiler can build it."""
    from benchmarks.nvml_collector import bench_fake_h100_daemon, bench_fake_h100_node
    from tests.fake_nvml.build import NoCompiler

    try:
        figures = bench_fake_h100_node(collections=2000)
        daemon = bench_fake_h100_daemon(ticks=1440)
    except NoCompiler:
        return {}
    return {
        "nvml_collect_us_per_gpu_sample": figures["us_per_gpu_sample"],
        "nvml_collect_cpu_us_per_gpu_sample": figures["cpu_us_per_gpu_sample"],
        # the collect daemon with 8 GPUs at a 10-s interval, flushing every 5 min (4 h simulated)
        "collect_daemon_cpu_ms_per_tick": daemon["cpu_ms_per_tick"],
        "collect_daemon_core_percent_at_10s": daemon["core_percent"],
        "collect_daemon_peak_rss_mb": daemon["peak_rss_mb"],
    }


def write_results(out: Path, stages: list[StageResult], micro: dict[str, float], rows: dict[str, int]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {cores()} cores, Python {platform.python_version()}"
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# gpufail bench ({when}; {machine})",
        "",
        "Demo pipeline (`make demo`'s stages), each stage its own process:",
        "",
        "| stage | seconds | peak memory (MB) | throughput |",
        "| --- | ---: | ---: | --- |",
    ]
    for s in stages:
        lines.append(f"| {s.stage} | {s.seconds:.1f} | {s.peak_rss_mb:.0f} | {_throughput(s, rows)} |")
    total = sum(s.seconds for s in stages)
    lines += ["", f"Total: {total:.0f} s.", "", "Hot loops alone:", ""]
    from benchmarks.kernel_log_parse import describe

    per_format = {
        k.removeprefix(_KERNEL_LOG_FORMAT_KEY): v for k, v in micro.items() if k.startswith(_KERNEL_LOG_FORMAT_KEY)
    }
    if per_format:
        lines.append(f"- {describe(per_format)}")
    lines.append(
        f"- feature build in memory (128 GPUs x 130 h, 1-minute samples): {micro['feature_build_rows_per_s']:,.0f} telemetry rows/s"
    )
    if "feature_compare_pandas_rows_per_s" in micro:
        lines.append(
            f"- same {micro['feature_compare_telemetry_rows']:,} rows (32 GPUs x 130 h), same run: gpufail's build (every feature"
            f" and label) {micro['feature_compare_gpufail_rows_per_s']:,.0f} rows/s; a straightforward pandas groupby-rolling"
            f" over raw samples (window statistics only) {micro['feature_compare_pandas_rows_per_s']:,.0f} rows/s"
        )
    if "explain_lightgbm_rows_per_s" in micro:
        lines.append(
            f"- explain (TreeSHAP, top 5) of a LightGBM model on 411 synthetic features, 1,000 rows:"
            f" {micro['explain_lightgbm_rows_per_s']:,.0f} rows/s"
        )
    if "nvml_collect_us_per_gpu_sample" in micro:
        lines.append(
            f"- NVML collector, fake libnvidia-ml.so.1 with 8 x H100: {micro['nvml_collect_us_per_gpu_sample']:.0f} us"
            f" per GPU sample ({micro['nvml_collect_cpu_us_per_gpu_sample']:.0f} us CPU)"
        )
    if "collect_daemon_cpu_ms_per_tick" in micro:
        lines.append(
            f"- collect daemon, NVML collector on the same 8 fake GPUs, 10-s interval, a flush every 5 min"
            f" (4 h simulated): {micro['collect_daemon_cpu_ms_per_tick']:.2f} ms CPU per tick ="
            f" {micro['collect_daemon_core_percent_at_10s']:.3f}% of one core, peak RSS"
            f" {micro['collect_daemon_peak_rss_mb']:.0f} MB"
        )
    on_demand = {k.removeprefix(_ON_DEMAND_KEY): v for k, v in micro.items() if k.startswith(_ON_DEMAND_KEY)}
    if on_demand:
        from benchmarks.on_demand import markdown_lines

        lines += ["", "Features on demand against the table, on the demo's store:", "", *markdown_lines(on_demand)]
    lines += _api_lines(micro)
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    (out / "bench.json").write_text(
        json.dumps(
            {"when": when, "machine": machine, "stages": [asdict(s) for s in stages], "micro": micro, "rows": rows},
            indent=1,
        )
    )
    return out / "bench.md"


def _throughput(stage: StageResult, rows: dict[str, int]) -> str:
    if stage.stage == "simulate":
        return f"{rows['telemetry'] / stage.seconds:,.0f} telemetry rows/s"
    if stage.stage == "ingest kernel-log":
        return f"{rows['kernel_log_lines'] / stage.seconds:,.0f} log lines/s"
    if stage.stage in ("features", "features --materialise"):
        return f"{rows['telemetry'] / stage.seconds:,.0f} telemetry rows/s"
    return ""


def cores() -> int:
    return len(os.sched_getaffinity(0))


def run_bench(out: Path, work: Path) -> Path:
    print("bench: demo pipeline", file=sys.stderr)
    stages = demo_pipeline(work)
    summary = json.loads((work / "demo-data" / "simulation.json").read_text())
    rows = {"telemetry": summary["telemetry_rows"], "kernel_log_lines": summary["kernel_log_lines"]}
    print("bench: hot loops", file=sys.stderr)
    micro = micro_benchmarks()
    print("bench: features on demand", file=sys.stderr)
    from benchmarks.on_demand import bench_on_demand

    micro.update({f"{_ON_DEMAND_KEY}{k}": v for k, v in bench_on_demand(str(work / "demo-data")).items()})
    print("bench: REST endpoint", file=sys.stderr)
    micro.update(api_benchmark(work))
    return write_results(out, stages, micro, rows)


_API_KEY = "api_"
_ON_DEMAND_KEY = "on_demand_"


def api_benchmark(work: Path) -> dict[str, float]:
    """The REST endpoint under load (`benchmarks.api_load`: server and load generator in their own
    processes) on the demo's features and model, flattened as api_<request>_<figure>."""
    from benchmarks.api_load import run_api_bench

    figures = run_api_bench(str(work / "demo-data"), str(work / "out" / "model"), n_gpus=1000, seconds=10.0)
    flat: dict[str, float] = {}
    for name, value in figures.items():
        if isinstance(value, dict):
            flat.update({f"{_API_KEY}{name}__{k}": v for k, v in value.items() if v is not None})
        else:
            flat[f"{_API_KEY}{name}"] = value
    return flat


def _api_lines(micro: dict[str, float]) -> list[str]:
    from benchmarks.api_load import markdown_lines

    figures: dict[str, object] = {}
    for key, value in micro.items():
        if key.startswith(_API_KEY):
            name, _, figure = key.removeprefix(_API_KEY).partition("__")
            if figure:
                figures.setdefault(name, {})[figure] = value  # type: ignore[index]
            else:
                figures[name] = value
    return ["", *markdown_lines(figures)] if figures else []
