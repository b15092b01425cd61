"""The prefix cache of `KernelLogParser` changes speed, never results.

The oracle is `parse_line`, which parses each line with a fresh parser (so with an empty
cache, through the prefix regexes); a stream parsed by `parse_lines` must give the same record
for every line, whatever the order in which formats, seconds and fractions come.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from ingest.kernel_log import XidRecord, parse_line, parse_lines
from ingest.kernel_log_bench import FORMATS, flood_lines

BOOT = datetime(2025, 1, 20, 0, 0, 0, 250_000, tzinfo=UTC)  # not on a whole second, on purpose
REFERENCE = datetime(2025, 6, 1, tzinfo=UTC)
ARABIC_SEVEN = "\u0667"  # a digit to the regex `\d`, but not an ASCII one
PAYLOAD = "NVRM: Xid (PCI:0000:3b:00): 48, pid=77, name=python3, An uncorrectable double bit error"


def _comparable(record: XidRecord | None) -> tuple[object, ...] | None:
    if record is None:
        return None
    return (
        record.ts,
        record.host,
        record.pci_bus_id,
        record.xid,
        record.pid,
        record.process,
        record.message,
        record.log_format,
    )


def _assert_stream_equals_lines(lines: list[str], tz: str | None = None) -> int:
    streamed = {r.line_no: _comparable(r) for r in parse_lines(lines, boot_time=BOOT, reference_time=REFERENCE, tz=tz)}
    for line_no, line in enumerate(lines, start=1):
        try:
            alone = _comparable(parse_line(line, boot_time=BOOT, reference_time=REFERENCE, tz=tz))
        except ValueError:
            alone = None  # a rejected line: the stream must not yield it either
        assert streamed.get(line_no) == alone, f"line {line_no}: {line!r}"
    return len(streamed)


@pytest.mark.parametrize("log_format", FORMATS)
def test_a_flood_parses_the_same_with_and_without_the_cache(log_format: str) -> None:
    lines = flood_lines(3_000, log_format)[::7]  # spread over seconds, so the cache key changes
    assert _assert_stream_equals_lines(lines) > 300


def _variants() -> list[str]:
    """Prefixes whose fraction length, zone, digits and format change from line to line."""
    rng = random.Random(7)
    start = datetime(2025, 3, 30, 0, 59, 58, tzinfo=UTC)  # spans Europe's spring DST change
    lines = []
    for i in range(400):
        moment = start + timedelta(microseconds=rng.randrange(0, 4_000_000))
        frac = f"{moment.microsecond:06d}"[: rng.choice((1, 3, 6))] + ("" if rng.random() < 0.8 else "789")
        iso = moment.strftime("%Y-%m-%dT%H:%M:%S")
        uptime = int((moment - BOOT).total_seconds())
        arabic_frac = frac.replace("7", ARABIC_SEVEN)
        lines += [
            f"{iso}.{frac}+00:00 node-{i % 3} kernel: {PAYLOAD}\n",
            f"kern  :err   : {iso},{frac}+0100 {PAYLOAD}\n",
            f"{iso}.{frac} {PAYLOAD}\n",  # naive: the zone given to the parser applies
            f"[{uptime:>6d}.{frac}] {PAYLOAD}\n",
            f"Mar 30 {moment:%H:%M:%S}.{frac} node-{i % 2} kernel: {PAYLOAD}\n",
            f"[{uptime:>6d}.{arabic_frac}] {PAYLOAD}\n",
            f"[{uptime:>6d}.{frac[:-1]}x] {PAYLOAD}\n",  # not a stamp at all
            f"[{uptime:>6d}.{frac}] NVRM: Xid (PCI:0000:3b:00): 4x, garbled\n",
            f"{iso}.{frac}+00:00 node-0 kernel: [ {uptime}.{frac}] {PAYLOAD}\n",
        ]
    rng.shuffle(lines)
    return lines


@pytest.mark.parametrize("tz", [None, "Europe/Warsaw"])
def test_mixed_formats_fractions_and_zones_parse_the_same_with_and_without_the_cache(tz: str | None) -> None:
    assert _assert_stream_equals_lines(_variants(), tz=tz) > 2000


def test_a_fraction_past_microseconds_is_truncated_like_fromisoformat() -> None:
    lines = [f"2025-01-21T04:41:44.{frac}+00:00 host kernel: {PAYLOAD}\n" for frac in ("1234567", "9999999", "5")]
    records = list(parse_lines(lines))
    assert [r.ts.microsecond for r in records if r.ts] == [123456, 999999, 500000]
