"""Fault injection for `gpufail collect`: kill -9 at its write boundaries and after random delays
(`tests.faults.kill_points`), restart, and the store ends with exactly the rows of an
uninterrupted run (issue 25: "0 lost and 0 duplicated rows").

The kernel log is the source that is read again after a restart, so it carries the check:
floods folded into incidents, distinct XIDs, lines the parser rejects, read in pieces of
`flush_rows` lines. After every kill a reader of the store sees no partial file and no row
twice; after the restart the store equals the clean run's, row for row, with no hidden file
left. Every fourth trial is killed again while it restarts."""

from __future__ import annotations

import json
import os
import random
import signal
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ingest.store import Store
from tests.faults import kill_points

SEED = 25
KILLS = 10
DELAYS = 2
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
    return ["collect", "--once", "--source", "kernel-log", "--out", str(root)]


def environment(log: Path) -> dict[str, str | None]:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("GPUFAIL_")}
    env.update(
        GPUFAIL_COLLECT__KERNEL_LOG_SOURCE="files",
        GPUFAIL_COLLECT__KERNEL_LOG_PATHS=json.dumps([str(log)]),
        GPUFAIL_COLLECT__NODE=NODE,
        GPUFAIL_COLLECT__FLUSH_ROWS="50",
        GPUFAIL_COLLECT__LISTEN="",
    )
    return env


def reader_rows(root: Path) -> Counter:
    """The xid_events rows a reader of the store sees (what the journal committed), each
    visible file read on its own first (a partial file fails here)."""
    for path in kill_points.visible_files(root, "xid_events"):
        pq.read_table(path, partitioning=None)
    store = Store.open(str(root))
    if not store.exists("xid_events"):
        return Counter()
    return Counter(tuple(sorted(r.items())) for r in store.read("xid_events").to_pylist())


def test_kill_9_at_write_boundaries_then_a_restart_gives_exactly_the_rows_of_an_uninterrupted_run(tmp_path):
    rng = random.Random(SEED)
    log = tmp_path / "kern.log"
    log.write_text(kernel_log(rng))
    env = environment(log)

    clean = tmp_path / "clean"
    kills = kill_points.plan(collect_command(clean), KILLS, SEED, env=env, delays=DELAYS)
    expected = reader_rows(clean)
    assert 800 < sum(expected.values()) < LINES and max(expected.values()) == 1
    second = {trial: rng.randint(1, 60) for trial in range(3, len(kills), 4)}

    def trial(i: int) -> tuple[Counter, Path]:
        root = tmp_path / f"kill-{i}"
        status, _ = kill_points.run(collect_command(root), kill=kills[i], env=env)
        assert status == -signal.SIGKILL or (kills[i].after_s is not None and status == 0), kills[i]
        seen = reader_rows(root)
        if i in second:
            status, _ = kill_points.run(collect_command(root), kill=kill_points.Kill(point=second[i]), env=env)
            assert status in (0, -signal.SIGKILL), f"{kills[i]}, then point {second[i]}"
        return seen, root

    # The killed runs are processes of their own: two at a time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        trials = list(pool.map(trial, range(len(kills))))
    for kill, (seen, root) in zip(kills, trials, strict=True):
        assert not seen - expected, f"{kill}: a row the clean run does not have, or a row twice"
        status, _ = kill_points.run(collect_command(root), env=env)
        assert status == 0, kill
        assert reader_rows(root) == expected, kill
        assert kill_points.hidden_files(root) == [], kill
