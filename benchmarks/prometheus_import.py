"""`gpufail ingest prometheus` from a real Prometheus server (a measurement, not a test).

    .venv/bin/python -m benchmarks.prometheus_import                       # 200 GPUs, 7 and 14 days
    .venv/bin/python -m benchmarks.prometheus_import --gpus 200 --days 7 --work /tmp/prom-bench

History of `--gpus` GPUs (8 a node) with 10 dcgm-exporter metrics at 60 s is written as TSDB
blocks by `promtool tsdb create-blocks-from openmetrics` (one OpenMetrics file per 2-hour block:
promtool reads its whole input once per block), for twice `--days`; a `prometheus` serves it
on a loopback port. Then, each import in a process of its own (its peak memory from `wait4`):

1. `--days` days into a new data root: samples per second, peak memory;
2. the same range again: what it writes, its time against the first's;
3. twice the days into another new data root: its peak memory against the first's.

The server runs on the same cores as the import: its answers are part of the time measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

START = datetime(2026, 1, 5, tzinfo=UTC)
STEP_S = 60
BLOCK_S = 2 * 3600
# name, value at minute i of GPU g (a level, a counter, XIDs that change rarely)
METRICS = (
    ("DCGM_FI_DEV_GPU_TEMP", lambda g, i: 40 + (g + i) % 30),
    ("DCGM_FI_DEV_MEMORY_TEMP", lambda g, i: 45 + (g + i) % 25),
    ("DCGM_FI_DEV_POWER_USAGE", lambda g, i: 250 + (g * 7 + i) % 400 + 0.25),
    ("DCGM_FI_DEV_SM_CLOCK", lambda g, i: 1980 - (i % 5) * 15),
    ("DCGM_FI_DEV_MEM_CLOCK", lambda g, i: 2619),
    ("DCGM_FI_DEV_GPU_UTIL", lambda g, i: (g + i) % 101),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", lambda g, i: (g * 3 + i) % 101),
    ("DCGM_FI_DEV_FB_USED", lambda g, i: 40_000 + (g + i) % 30_000),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", lambda g, i: (i // 600) if g % 10 == 0 else 0),
    ("DCGM_FI_DEV_XID_ERRORS", lambda g, i: 79 if g % 50 == 0 and i >= 5000 else 0),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prometheus_import", description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=200)
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--work", default=None, help="keep the TSDB here and reuse it when present")
    args = parser.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpufail-prom-bench-"))
    try:
        print(json.dumps(run(work, args.gpus, args.days), indent=2))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def run(work: Path, gpus: int, days: int) -> dict[str, object]:
    from tests.ingest.prometheus_server import prometheus

    tsdb = work / "tsdb"
    marker = work / f"history-{gpus}-{days * 2}.done"
    if not marker.exists():
        shutil.rmtree(tsdb, ignore_errors=True)
        started = time.monotonic()
        write_history(tsdb, gpus, days * 2)
        marker.write_text(f"{time.monotonic() - started:.0f}s\n")
    results: dict[str, object] = {"gpus": gpus, "days": days, "history_s": marker.read_text().strip()}
    for old in ("root", "root2"):
        shutil.rmtree(work / old, ignore_errors=True)
    with prometheus(tsdb) as server:
        end = START + timedelta(days=days)
        first = import_once(server.url, work / "root", START, end)
        again = import_once(server.url, work / "root", START, end)
        longer = import_once(server.url, work / "root2", START, START + timedelta(days=days * 2))
    samples = gpus * len(METRICS) * days * 1440
    results.update(
        first=first,
        rerun=again,
        twice_the_days=longer,
        samples=samples,
        samples_per_s=round(first["summary"]["samples"] / first["seconds"]),
        rerun_share=round(again["seconds"] / first["seconds"], 4),
    )
    return results


def import_once(url: str, root: Path, start: datetime, end: datetime) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "gpufail.cli", "ingest", "prometheus", "--json", "--data", str(root),
        "--url", url, "--start", start.isoformat(), "--end", end.isoformat(),
    ]  # fmt: skip
    files_before = _files(root)
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.monotonic() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode != 0:
        raise SystemExit(f"import failed: {stderr}")
    return {
        "seconds": round(seconds, 2),
        "peak_mb": _peak_mb(usage),
        "new_files": len(_files(root) - files_before),
        "summary": json.loads(stdout),
    }


def _peak_mb(usage: resource.struct_rusage) -> float:
    return round(usage.ru_maxrss / 1024, 1)


def _files(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("*.parquet")} if root.exists() else set()


def write_history(tsdb: Path, gpus: int, days: int) -> None:
    """TSDB blocks of `gpus` GPUs over `days` days, one promtool run per 2-hour block."""
    tsdb.mkdir(parents=True, exist_ok=True)
    labels = [_labels(g) for g in range(gpus)]
    source = tsdb.parent / "block.om"
    minutes_per_block = BLOCK_S // STEP_S
    for block in range(days * 86_400 // BLOCK_S):
        first = block * minutes_per_block
        base = int(START.timestamp())
        with open(source, "w") as out:
            for name, value in METRICS:
                out.write(f"# TYPE {name} gauge\n")
                for g, label in enumerate(labels):
                    prefix = f"{name}{{{label}}} "
                    out.write(
                        "".join(
                            f"{prefix}{value(g, i)} {base + i * STEP_S}\n"
                            for i in range(first, first + minutes_per_block)
                        )
                    )
            out.write("# EOF\n")
        subprocess.run(
            ["promtool", "tsdb", "create-blocks-from", "openmetrics", "--quiet", str(source), str(tsdb)],
            check=True,
            capture_output=True,
        )
    source.unlink()


def _labels(g: int) -> str:
    node, index = divmod(g, 8)
    return (
        f'gpu="{index}",UUID="GPU-{g:08x}-0000-4000-8000-{g:012x}",pci_bus_id="00000000:{index + 0x18:02X}:00.0",'
        f'device="nvidia{index}",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-{node:03d}",'
        'DCGM_FI_DRIVER_VERSION="550.54.15"'
    )


if __name__ == "__main__":
    main()
