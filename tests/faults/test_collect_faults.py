"""Fault injection for `gpufail collect`: kill -9 at random points, restart, and the store ends
with exactly the rows of an uninterrupted run (issue 25: "0 lost and 0 duplicated rows").

The kernel log is the source that is read again after a restart, so it carries the check:
floods folded into incidents, distinct XIDs, lines the parser rejects, read in pieces of
`flush_rows` lines. After every kill the visible store must hold no partial file and no row
twice; after the last run it must equal the clean run, row for row."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ingest.store import Store
from tests.cli import GPUFAIL, gpufail_env

SEED = 25
KILLS = 12
LINES = 8_000
NODE = "gpu-node-017"

pytestmark = pytest.mark.slow


def kernel_log(rng: random.Random) -> str:
    """A day of a busy node's kern.log: XID lines on 16 GPUs, every few seconds, with floods."""
    start = datetime(2026, 3, 1, tzinfo=UTC)
    out = []
    at = start
    while len(out) < LINES:
        at += timedelta(seconds=rng.randint(1, 40))
        bus = f"0000:{0x18 + rng.randrange(16):02x}:00"
        xid = rng.choice([79, 94, 48, 63, 13, 31])
        if rng.random() < 0.02:  # a flood: one GPU repeating one XID many times a second
            out += [
                f"{(at + timedelta(milliseconds=90 * k)).isoformat()} {NODE} kernel: NVRM: Xid (PCI:{bus}): 94, "
                f"pid={k}, name=python3, Contained ECC error"
                for k in range(rng.randint(50, 400))
            ]
            at += timedelta(seconds=40)
        elif rng.random() < 0.01:
            out.append(f"{at.isoformat()} {NODE} kernel: NVRM: Xid (PCI:{bus}): not-a-code, pid=1")
        elif rng.random() < 0.05:
            out.append(f"{at.isoformat()} {NODE} kernel: usb 1-1: new high-speed USB device number 3")
        else:
            out.append(f"{at.isoformat()} {NODE} kernel: NVRM: Xid (PCI:{bus}): {xid}, pid={len(out)}, name=train")
    return "\n".join(out[:LINES]) + "\n"


def collect_command(root: Path) -> list[str]:
    return [*GPUFAIL, "collect", "--once", "--source", "kernel-log", "--out", str(root)]


def environment(log: Path) -> dict[str, str]:
    env = gpufail_env()
    env.update(
        GPUFAIL_COLLECT__KERNEL_LOG_SOURCE="files",
        GPUFAIL_COLLECT__KERNEL_LOG_PATHS=json.dumps([str(log)]),
        GPUFAIL_COLLECT__NODE=NODE,
        GPUFAIL_COLLECT__FLUSH_ROWS="50",
        GPUFAIL_COLLECT__LISTEN="",
        # The test kills after the n-th "flushed" line: the child must print each as it happens.
        PYTHONUNBUFFERED="1",
    )
    return env


def visible_rows(root: Path) -> list[tuple]:
    """Every xid_events row in the visible part files, each file read on its own (a partial
    file fails here; a killed write may leave only a hidden `.tmp-` file, which readers skip)."""
    rows = []
    for path in sorted(root.glob("xid_events/date=*/part-*.parquet")):
        table = pq.read_table(path, partitioning=None)
        rows += [tuple(sorted(r.items())) for r in table.to_pylist()]
    return rows


def run_to_end(root: Path, env: dict[str, str]) -> str:
    done = subprocess.run(collect_command(root), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def run_and_kill(root: Path, env: dict[str, str], rng: random.Random, flushes_left: int) -> int:
    """Start `gpufail collect --once` and SIGKILL it: during start-up and recovery, or a random
    moment after a random one of its flushes (reading, staging, committing or renaming). Returns
    the flushes it reported."""
    proc = subprocess.Popen(collect_command(root), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    seen = 0
    if rng.random() < 1 / 6:
        time.sleep(rng.uniform(0.0, 1.5))
    else:
        target = rng.randint(1, max(1, flushes_left // 3))
        while seen < target:
            line = proc.stdout.readline()
            if not line:
                break  # finished before that flush
            seen += line.startswith("collect: flushed")
        time.sleep(rng.uniform(0.0, 0.05))
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGKILL), err
    return seen


def test_kill_9_at_random_points_then_a_restart_gives_exactly_the_rows_of_an_uninterrupted_run(tmp_path):
    rng = random.Random(SEED)
    log = tmp_path / "kern.log"
    log.write_text(kernel_log(rng))
    env = environment(log)

    clean = tmp_path / "clean"
    flushes = run_to_end(clean, env).count("collect: flushed")
    expected = Counter(visible_rows(clean))
    assert 800 < sum(expected.values()) < LINES and max(expected.values()) == 1

    root = tmp_path / "killed"
    Store.create(str(root))
    unfinished = 0
    for _ in range(KILLS):
        flushes -= run_and_kill(root, env, rng, flushes)
        seen = Counter(visible_rows(root))
        assert not seen - expected, "a row the clean run does not have, or a row twice"
        unfinished += seen != expected

    assert unfinished >= KILLS // 4, "a good share of the kills should land before the job is done"
    run_to_end(root, env)
    assert Counter(visible_rows(root)) == expected
    assert not [p for p in (root / "_staging").rglob("*") if p.is_file()]
