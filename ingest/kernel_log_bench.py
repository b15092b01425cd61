"""Parse-speed benchmark for `ingest.kernel_log` (a benchmark, not a test: CONVENTIONS.md 13).

    .venv/bin/python -m ingest.kernel_log_bench            # 1,000,000 lines, every format
    .venv/bin/python -m ingest.kernel_log_bench 200000 dmesg_iso
    .venv/bin/python -m ingest.kernel_log_bench 200000 --parse-only

The input is the worst case for the parser: an XID flood in which every line is an Xid line of
one of 8 GPUs (real floods are 13/45/95 repeated for hours), with one unrelated kernel line in
ten, so the cheap pre-filter rejects little. Lines are built in memory first, so the figure is
parsing and deduplication only, not disk or decompression. `deduplicate(parse_lines(...))` is
timed as `gpufail ingest kernel-log` runs it: the deduplicator drives the parser and folds flood
lines into their incident directly; `--parse-only` times `parse_lines` alone (a record per line).
"""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime, timedelta

from ingest.kernel_log import deduplicate, parse_lines
from ingest.simulator.kernel_log_writer import format_message
from ingest.simulator.presets import LOG_FORMATS

_PAYLOAD = (
    "NVRM: Xid (PCI:0000:{bus:02x}:00): 13, pid='<unknown>', name=<unknown>, "
    "Graphics SM Warp Exception on (GPC 9, TPC 1, SM 1): Out Of Range Address"
)
_NOISE = "IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready"
_START = datetime(2025, 1, 21, 4, 41, 44, tzinfo=UTC)
_BOOT = datetime(2025, 1, 20, tzinfo=UTC)


def _prefix(log_format: str, moment: datetime) -> str:
    uptime = (moment - _BOOT).total_seconds()
    if log_format == "dmesg_uptime":
        return f"[{uptime:12.6f}] "
    if log_format == "kmsg":
        return f"4,{int(uptime)},{int(uptime * 1e6)},-;"
    if log_format in LOG_FORMATS:
        # The formats the simulator writes: the same prefixes the demo's logs carry.
        return format_message(log_format, moment, "gpu-node-007", [""])[0]
    raise ValueError(f"log format {log_format!r}: expected one of {FORMATS}")


FORMATS = ("dmesg_iso", "dmesg_ctime", "dmesg_uptime", "kmsg", "journal", "rfc3339_syslog")


def flood_lines(n_lines: int, log_format: str = "dmesg_iso") -> list[str]:
    """`n_lines` lines of an XID 13 flood on 8 GPUs, 10 lines per millisecond."""
    lines = []
    for i in range(n_lines):
        moment = _START + timedelta(microseconds=100 * i)
        body = _NOISE if i % 10 == 9 else _PAYLOAD.format(bus=0x18 + (i % 8) * 0x10)
        lines.append(_prefix(log_format, moment) + body + "\n")
    return lines


def bench_parse(
    n_lines: int = 1_000_000, log_format: str = "dmesg_iso", *, dedup: bool = True, repeat: int = 3, cpu: bool = False
) -> float:
    """Lines per second for parsing (and, by default, deduplicating) an XID flood, one core.

    The best of `repeat` runs, as `timeit` reports: on a shared machine the slower runs measure
    the neighbours, not the parser. `cpu=True` divides by this process's CPU time instead of
    wall time (the parser is single-threaded), which a busy machine distorts less.
    """
    lines = flood_lines(n_lines, log_format)
    clock = time.process_time if cpu else time.perf_counter
    best = float("inf")
    for _ in range(repeat):
        records = parse_lines(lines, boot_time=_BOOT, reference_time=_START + timedelta(days=1))
        started = clock()
        if dedup:
            incidents = sum(1 for _ in deduplicate(records, timedelta(minutes=5)))
            # 8 GPUs, 100 s of flood per million lines, 5-minute window: a few incidents each.
            if incidents > 8 * (2 + n_lines // 3_000_000):
                raise AssertionError(f"dedup left {incidents} incidents for a flood on 8 GPUs")
        else:
            for _ in records:
                pass
        best = min(best, clock() - started)
    return n_lines / best


def main(argv: list[str]) -> None:
    dedup = "--parse-only" not in argv
    args = [a for a in argv if a != "--parse-only"]
    n_lines = int(args[0]) if args else 1_000_000
    formats = args[1:] or list(FORMATS)
    what = "parse + dedup" if dedup else "parse only"
    print(f"{'format':15s} {'lines':>9s}  {'wall lines/s':>13s}  {'CPU lines/s':>13s}   ({what}, one core, best of 3)")
    for log_format in formats:
        wall = bench_parse(n_lines, log_format, dedup=dedup)
        cpu = bench_parse(n_lines, log_format, dedup=dedup, cpu=True)
        print(f"{log_format:15s} {n_lines:>9,d}  {wall:>13,.0f}  {cpu:>13,.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
