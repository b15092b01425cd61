"""Write `devices.csv`: a daily per-device export of a made-up fleet, in another system's column
names, with its failure flag (one row per GPU per day; a failed GPU's last row has failure=1,
and a new board takes its slot the next day).

    python examples/daily_table/make_table.py OUT_FOLDER [--seed N]

The numbers are drawn, not measured: a failing board's corrected-ECC count and retired pages
climb over the days before it fails (a documented precursor of memory failures), and healthy
boards show the same counters rising now and then, so that a model has something to learn and
something to get wrong. It stands in for a real export, which none of the reference material
holds; the walk-through (README.md) runs the same commands on a real one.
"""

from __future__ import annotations

import argparse
import csv
from datetime import date, timedelta
from pathlib import Path

import numpy as np

HOSTS = 12
SLOTS = 8
DAYS = 70
FIRST_DAY = date(2026, 1, 1)
FAILURES = 16
PRECURSOR_DAYS = 6
COLUMNS = [
    "day", "host", "slot", "serial", "model", "temp_max", "power_avg",
    "sbe_count", "dbe_count", "retired_sbe", "retired_dbe", "failure",
]  # fmt: skip


def write_table(out: Path, seed: int = 0) -> Path:
    """The table, written to `out/devices.csv`; returns its path."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    slots = [(h, s) for h in range(HOSTS) for s in range(SLOTS)]
    # Which slots fail on which day (none in the first two weeks, so that a model has history).
    chosen = rng.choice(len(slots), size=FAILURES, replace=False)
    fail_day = {slots[i]: int(rng.integers(14, DAYS - 1)) for i in chosen}
    path = out / "devices.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for host, slot in slots:
            board, sbe, dbe, r_sbe, r_dbe = 0, 0, 0, 0, 0
            failed_on = fail_day.get((host, slot))
            base_temp = 60 + rng.normal(0, 3)
            for d in range(DAYS):
                if failed_on is not None and d == failed_on + 1:
                    board, sbe, dbe, r_sbe, r_dbe = 1, 0, 0, 0, 0  # the replacement board
                serial = f"SN{host:02d}{slot}{board}{seed:03d}"
                ahead = None if failed_on is None or board else failed_on - d
                sick = ahead is not None and 0 <= ahead < PRECURSOR_DAYS
                sbe += int(rng.poisson(40 * (PRECURSOR_DAYS - ahead))) if sick else int(rng.poisson(0.3))
                if rng.random() < 0.01:
                    sbe += int(rng.integers(20, 200))  # a healthy board's burst
                r_sbe += int(sick and rng.random() < 0.6) + int(rng.random() < 0.003)
                dbe += int(sick and ahead < 2 and rng.random() < 0.5)
                r_dbe += int(sick and ahead < 2 and rng.random() < 0.3)
                temp = base_temp + rng.normal(0, 2) + (3 if sick else 0)
                power = 280 + rng.normal(0, 15)
                writer.writerow(
                    [
                        (FIRST_DAY + timedelta(days=d)).isoformat(),
                        f"gpu-node-{host:02d}",
                        slot,
                        serial,
                        "A100-SXM4-80GB",
                        f"{temp:.1f}",
                        f"{power:.1f}",
                        sbe,
                        dbe,
                        r_sbe,
                        r_dbe,
                        int(ahead == 0),
                    ]
                )
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_table(args.out, args.seed))
