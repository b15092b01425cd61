"""Benchmark of `gpufail at-risk --data DATA`: the operator's first look, a new process each time.

    python -m benchmarks.at_risk --data DATA [--runs 7] [--limit 20] [--json FILE]

DATA is a data root with a predictions snapshot (`make demo`, then `gpufail score`). Runs the
command `--runs` times, each in a new process as an operator does, and reports the median and
the least wall time and CPU time (user + system) of a run, and the heavy libraries the command
imported (it should import none: `HEAVY`). The target is under 0.5 s of wall time (issue 48).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TARGET_S = 0.5
HEAVY = (
    "pandas",
    "polars",
    "sklearn",
    "lightgbm",
    "numba",
    "starlette",
    "fastapi",
    "jinja2",
    "httpx",
    "mlflow",
    "fsspec",
    "pyarrow.compute",
    "pyarrow.dataset",
)
"""Libraries `at-risk --data` of a local root has no use for: importing one is a regression."""

_IMPORTED = """
import sys
from gpufail.cli import main
try:
    main(sys.argv[1:])
finally:
    heavy = [m for m in {heavy!r} if m in sys.modules]
    print("heavy-imports:" + ",".join(heavy), file=sys.stderr)
"""


def _command(data: str, limit: int) -> list[str]:
    return [str(Path(sys.executable).parent / "gpufail"), "at-risk", "--data", data, "--limit", str(limit)]


ABORT_AT_EXIT = "terminate called without an active exception"
"""What pyarrow's native threads print when the interpreter's exit tears them down mid-way, now
and then (apache/arrow#34314): the run had done its work and printed its answer, then aborted."""


def time_runs(data: str, *, runs: int, limit: int) -> dict[str, Any]:
    """Wall and CPU seconds of `runs` runs of `gpufail at-risk --data data`. A run that aborted
    at its exit (`ABORT_AT_EXIT`) is timed and counted; any other failure ends the benchmark."""
    walls, cpus, aborted = [], [], 0
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        done = subprocess.run(_command(data, limit), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        walls.append(time.perf_counter() - began)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if done.returncode == -signal.SIGABRT and ABORT_AT_EXIT in done.stderr:
            aborted += 1
        elif done.returncode != 0:
            raise SystemExit(f"gpufail at-risk exited {done.returncode}: {done.stderr.strip()}")
    return {
        "runs": runs,
        "aborted_at_exit": aborted,
        "wall_s_median": round(statistics.median(walls), 3),
        "wall_s_min": round(min(walls), 3),
        "cpu_s_median": round(statistics.median(cpus), 3),
        "cpu_s_min": round(min(cpus), 3),
        "target_s": TARGET_S,
    }


def heavy_imports(data: str, limit: int) -> list[str]:
    """The `HEAVY` libraries one run of the command imports."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTED.format(heavy=HEAVY), *_command(data, limit)[1:]],
        check=True,
        capture_output=True,
        text=True,
    )
    line = next(x for x in done.stderr.splitlines() if x.startswith("heavy-imports:"))
    return [m for m in line.removeprefix("heavy-imports:").split(",") if m]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="A data root with a predictions snapshot.")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--json", default=None, help="Also write the figures here.")
    args = parser.parse_args(argv)
    figures = time_runs(args.data, runs=args.runs, limit=args.limit)
    figures["heavy_imports"] = heavy_imports(args.data, args.limit)
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)
    print(
        f"gpufail at-risk --data: median {figures['wall_s_median']:.2f} s wall (least {figures['wall_s_min']:.2f}), "
        f"{figures['cpu_s_median']:.2f} s CPU over {args.runs} runs (target < {TARGET_S} s), "
        f"{figures['aborted_at_exit']} aborted at exit; "
        f"heavy imports: {', '.join(figures['heavy_imports']) or 'none'}; load average {figures['load_average_1m']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
