"""The prefix cache of `KernelLogParser` changes speed, never results.

The oracle is `parse_line`, which parses each line with a fresh parser (so with an empty
cache, through the prefix regexes); a stream parsed by `parse_lines` must give the same record
for every line, whatever the order in which formats, seconds and fractions come.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from ingest.kernel_log import ParseStats, XidRecord, deduplicate, parse_line, parse_lines
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
            f"6,{rng.randrange(10 ** rng.randrange(1, 4))},{uptime}{frac},-;{PAYLOAD}\n",  # kmsg
            f"6,{i},{uptime}{arabic_frac},-;{PAYLOAD}\n",
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


# -- deduplicate driving parse_lines itself ------------------------------------------------------


def _incidents(records: object, window: timedelta, node: str | None = None) -> list[tuple[object, ...]]:
    return [
        (
            i.ts,
            i.last_ts,
            i.node,
            i.pci_bus_id,
            i.xid,
            i.pid,
            i.process,
            i.message,
            i.gpu_uuid,
            i.repeat_count,
            i.first_line_no,
        )
        for i in deduplicate(records, window, node=node)  # type: ignore[arg-type]
    ]


def _fused_equals_generic(lines: list[str], window: timedelta, **kwargs: object) -> list[tuple[object, ...]]:
    fused_stats, generic_stats = ParseStats(), ParseStats()
    fused = _incidents(parse_lines(lines, stats=fused_stats, **kwargs), window, node="n0")  # type: ignore[arg-type]
    records = list(parse_lines(lines, stats=generic_stats, **kwargs))  # type: ignore[arg-type]
    assert fused == _incidents(records, window, node="n0")
    assert (fused_stats.lines, fused_stats.xid_records, fused_stats.rejected) == (
        generic_stats.lines,
        generic_stats.xid_records,
        generic_stats.rejected,
    )
    return fused


@pytest.mark.parametrize("log_format", FORMATS)
@pytest.mark.parametrize("window", [timedelta(0), timedelta(microseconds=300), timedelta(minutes=5)])
def test_deduplicating_a_flood_straight_from_the_parser_equals_deduplicating_its_records(
    log_format: str, window: timedelta
) -> None:
    incidents = _fused_equals_generic(flood_lines(4_000, log_format), window, boot_time=BOOT, reference_time=REFERENCE)
    assert sum(i[9] for i in incidents) == 3_600  # type: ignore[misc]  # every Xid line, once


def test_fused_dedup_with_banners_replaced_gpus_shuffled_times_hosts_and_junk() -> None:
    rng = random.Random(11)
    lines = _variants()
    banner = "2025-03-30T01:00:00.000000+00:00 node-{h} kernel: NVRM: GPU at PCI:0000:3b:00: GPU-{u}\n"
    for at in sorted(rng.sample(range(len(lines)), 12), reverse=True):
        lines.insert(at, banner.format(h=at % 3, u=f"{at:08d}-aaaa"))  # the GPU of a bus changes
    lines.insert(len(lines) // 2, "\x00\x01binary junk\n")
    for window in (timedelta(0), timedelta(milliseconds=700), timedelta(hours=1)):
        _fused_equals_generic(lines, window, boot_time=BOOT, reference_time=REFERENCE)


def test_fused_dedup_of_lines_without_a_time() -> None:
    lines = flood_lines(500, "kmsg") + flood_lines(500, "dmesg_uptime")
    incidents = _fused_equals_generic(lines, timedelta(minutes=5))  # no boot time: untimed
    assert {i[0] for i in incidents} == {None}


def test_a_partly_consumed_parse_is_deduplicated_from_where_it_stopped() -> None:
    records = parse_lines(flood_lines(100, "dmesg_iso"))
    first = next(records)
    rest = _incidents(records, timedelta(minutes=5))
    assert first.line_no == 1 and sum(i[9] for i in rest) == 89  # type: ignore[misc]


def test_fused_dedup_splits_a_flood_where_a_banner_says_the_gpu_was_replaced() -> None:
    lines = flood_lines(3_000, "rfc3339_syslog")
    banner = "2025-01-21T04:41:44.000000+00:00 gpu-node-007 kernel: NVRM: GPU at PCI:0000:18:00: GPU-{}\n"
    for at, uuid in ((2_000, "bbbb"), (1_000, "aaaa")):
        lines.insert(at, banner.format(uuid))
    incidents = _fused_equals_generic(lines, timedelta(minutes=5), boot_time=BOOT, reference_time=REFERENCE)
    bus_18 = [(i[8], i[9]) for i in incidents if i[3] == "0000:18:00"]
    # 375 lines of this GPU: those before the first banner fold into the incident that learns
    # its UUID (aaaa); the replacement's (bbbb) start a new one
    assert sorted(bus_18, key=str) == [("GPU-aaaa", 250), ("GPU-bbbb", 125)]
