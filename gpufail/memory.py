"""How much memory a command may plan to use, and the check `gpufail evaluate` makes with it.

`gpufail evaluate` holds the whole features dataset in memory (the walk-forward comparison
indexes every row of it). On a fleet-scale store that is far more than a machine has, and the
kernel's OOM killer would end the run minutes in with no word of why; the check refuses at
once, with the sizes."""

from __future__ import annotations

from pathlib import Path

from ingest.errors import InputError

EVALUATE_BYTES_PER_VALUE = 16
"""Memory per feature value while evaluate runs: a float32 (4 bytes) held about four times
over (the polars frame, its pandas copy, the fit and scoring copies). Calibrated on the demo,
whose 583k x 421 frame (0.98 GB) took evaluate to a 3.9 GB peak (`make bench`, docs/performance.md)."""

_UNLIMITED = 1 << 60  # cgroup v1 writes a number near 2**63 for "no limit"


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_limit(cgroup_file: Path, cgroup_root: Path) -> int | None:
    """The memory limit of this process's cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`),
    or None where none is set or none can be read."""
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            candidates.append(cgroup_root / path.lstrip("/") / "memory.max")
        elif "memory" in controllers.split(","):
            candidates.append(cgroup_root / "memory" / path.lstrip("/") / "memory.limit_in_bytes")
    for limit_file in candidates:
        try:
            text = limit_file.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _UNLIMITED:
            return int(text)
    return None


def available_bytes(
    meminfo: Path = Path("/proc/meminfo"),
    cgroup_file: Path = Path("/proc/self/cgroup"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> int | None:
    """Memory this process could still take: the kernel's MemAvailable, or the process's cgroup
    limit where that is lower (a container sees the host's MemAvailable). None where neither
    can be read (not Linux)."""
    known = [b for b in (_meminfo_available(meminfo), _cgroup_limit(cgroup_file, cgroup_root)) if b is not None]
    return min(known) if known else None


def check_evaluate_fits(where: str, rows: int, columns: int, budget: int | None) -> None:
    """Refuse (InputError) when evaluating `rows` x `columns` of features would need more than
    `budget` bytes; no budget, no check."""
    need = rows * columns * EVALUATE_BYTES_PER_VALUE
    if budget is None or need <= budget:
        return
    raise InputError(
        f"{where}: evaluate holds the whole features dataset in memory, {rows:,} rows x {columns} columns, "
        f"about {need / 1e9:,.1f} GB with its copies, and {budget / 1e9:,.1f} GB is available; evaluate a "
        "shorter history (build the features of fewer days into another data root) or on a larger machine, "
        "or raise [evaluate] max_memory_gb if you know the estimate is too cautious"
    )
