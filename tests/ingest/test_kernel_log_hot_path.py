"""The flood hot path of `deduplicate(parse_lines(...))` changes speed, never results.

Two oracles: the generic path (`deduplicate` over a list of records, each parsed by `feed`),
and, for the folding itself, a plain reference fold written here from `deduplicate`'s
docstring. The cases are those the hot path treats specially: fractions that are not six
digits, kmsg sequence numbers, lines out of order, window edges, hosts interleaved, UUIDs
learnt mid-flood, a tail cache that overflows.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from ingest import kernel_log
from ingest.kernel_log import ParseStats, XidIncident, XidRecord, deduplicate, parse_line, parse_lines

BOOT = datetime(2025, 1, 20, tzinfo=UTC)
REFERENCE = datetime(2025, 6, 1, tzinfo=UTC)
PAYLOAD = "NVRM: Xid (PCI:0000:{bus}:00): 13, pid=77, name=python3, Graphics SM Warp Exception"


def _row(i: XidIncident) -> tuple[object, ...]:
    return (i.ts, i.last_ts, i.node, i.pci_bus_id, i.xid, i.pid, i.process, i.gpu_uuid, i.repeat_count, i.first_line_no)


def _reference(records: list[XidRecord], window: timedelta, node: str | None) -> list[tuple[object, ...]]:
    """Fold by the docstring, simply: same (host, bus id, xid), same GPU, within `window` of the
    incident's first line (which moves to an earlier line folded in); sorted for comparison."""
    open_: dict[tuple[object, ...], XidIncident] = {}
    closed: list[XidIncident] = []
    for r in records:
        key: tuple[object, ...] = (r.host or node, r.pci_bus_id, r.xid)
        inc = open_.get(key)
        same_gpu = inc is not None and (inc.gpu_uuid is None or r.gpu_uuid is None or inc.gpu_uuid == r.gpu_uuid)
        untimed = r.ts is None
        if untimed:
            key = ("untimed", *key)  # untimed lines of a key fold together, whenever they come
            inc = open_.get(key)
            same_gpu = inc is not None and (inc.gpu_uuid is None or r.gpu_uuid is None or inc.gpu_uuid == r.gpu_uuid)
        if inc is not None and same_gpu and (untimed or abs(r.ts - inc.ts) <= window):  # type: ignore[operator]
            inc.repeat_count += 1
            inc.gpu_uuid = inc.gpu_uuid or r.gpu_uuid
            if not untimed:
                inc.last_ts = max(inc.last_ts, r.ts)  # type: ignore[type-var]
                inc.ts = min(inc.ts, r.ts)  # type: ignore[type-var]
            continue
        if inc is not None:
            closed.append(inc)
        open_[key] = XidIncident(
            r.ts,
            r.ts,
            r.host or node,
            r.pci_bus_id,
            r.xid,
            r.pid,
            r.process,
            r.message,
            r.gpu_uuid,
            1,
            r.line_no,  # type: ignore[arg-type]
        )
    return sorted((_row(i) for i in closed + list(open_.values())), key=repr)


def _check(lines: list[str], window: timedelta, **kwargs: object) -> list[tuple[object, ...]]:
    """Fused == generic (in order, with equal counts), and both == the reference fold."""
    fused_stats, generic_stats = ParseStats(), ParseStats()
    fused = [_row(i) for i in deduplicate(parse_lines(lines, stats=fused_stats, **kwargs), window, node="n0")]  # type: ignore[arg-type]
    records = list(parse_lines(lines, stats=generic_stats, **kwargs))  # type: ignore[arg-type]
    assert fused == [_row(i) for i in deduplicate(records, window, node="n0")]
    assert (fused_stats.lines, fused_stats.xid_records, fused_stats.rejected) == (
        generic_stats.lines,
        generic_stats.xid_records,
        generic_stats.rejected,
    )
    assert sorted(fused, key=repr) == _reference(records, window, "n0")
    return fused


def _records_agree_with_parse_line(lines: list[str]) -> None:
    streamed = {r.line_no: r for r in parse_lines(lines, boot_time=BOOT, reference_time=REFERENCE)}
    for line_no, line in enumerate(lines, start=1):
        try:
            alone = parse_line(line, boot_time=BOOT, reference_time=REFERENCE)
        except ValueError:
            alone = None
        got = streamed.get(line_no)
        expected = (alone.ts, alone.host, alone.xid, alone.log_format) if alone else None
        assert ((got.ts, got.host, got.xid, got.log_format) if got else None) == expected, f"line {line_no}: {line!r}"


def _feed_calls(lines: list[str], **kwargs: object) -> int:
    calls = 0
    real_feed = kernel_log.KernelLogParser.feed

    def counting_feed(self: kernel_log.KernelLogParser, line: str, line_no: int) -> XidRecord | None:
        nonlocal calls
        calls += 1
        return real_feed(self, line, line_no)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel_log.KernelLogParser, "feed", counting_feed)
        list(deduplicate(parse_lines(lines, **kwargs), timedelta(minutes=5)))  # type: ignore[arg-type]
    return calls


@pytest.mark.parametrize("digits", [1, 3, 5, 7, 9])
def test_fractions_of_other_lengths_than_six_keep_their_time(digits: int) -> None:
    start = datetime(2025, 1, 21, 4, 41, 44, tzinfo=UTC)
    lines = []
    for i in range(3_000):
        moment = start + timedelta(microseconds=1_337 * i)
        frac = f"{moment.microsecond:06d}{i % 1000:03d}"[:digits]
        lines.append(f"{moment:%Y-%m-%dT%H:%M:%S}.{frac}+00:00 host-a kernel: {PAYLOAD.format(bus='3b')}\n")
    _records_agree_with_parse_line(lines)
    (incident,) = _check(lines, timedelta(minutes=5))
    assert _feed_calls(lines) < 20  # the hot path took the others: it is what was checked
    last = start + timedelta(microseconds=1_337 * 2_999)
    # the last line's time, cut to `digits` digits of a second, as `fromisoformat` reads it
    cut = 10 ** (6 - min(digits, 6))
    assert incident[1] == last.replace(microsecond=last.microsecond // cut * cut)
    assert incident[8] == 3_000


def test_kmsg_sequence_numbers_of_any_decimal_digits_fold_like_the_regex_reads_them() -> None:
    arabic = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
    lines = []
    for i in range(2_000):
        seq = str(100_000 + i)
        if i % 7 == 3:
            seq = seq.translate(arabic)  # a decimal digit to `\d`: same record
        elif i % 7 == 5:
            seq = seq[:-1] + "²"  # a digit to `str.isdigit`, not to `\d`: not a kmsg prefix
        separator = ";" if i % 11 == 6 else ","  # not a kmsg prefix either
        lines.append(f"6,{seq}{separator}{86_400_000_000 + 250 * i},-;{PAYLOAD.format(bus='3b' if i % 2 else '5e')}\n")
    _records_agree_with_parse_line(lines)
    incidents = _check(lines, timedelta(minutes=5), boot_time=BOOT)
    assert sum(i[8] for i in incidents) == len(list(parse_lines(lines, boot_time=BOOT)))  # type: ignore[misc]
    assert _feed_calls(lines, boot_time=BOOT) < len(lines) // 2  # the "²" lines, and a few more


def test_lines_out_of_order_move_the_incident_start_and_its_window() -> None:
    start = datetime(2025, 1, 21, 4, 41, 44, tzinfo=UTC)
    offsets = [5_000, 5_100, 5_200, 1_000, 5_300, 9_000, 200, 4_999]  # seconds after start
    lines = [
        f"{start + timedelta(seconds=s, microseconds=17 * n):%Y-%m-%dT%H:%M:%S.%f}+00:00 h kernel: {PAYLOAD.format(bus='3b')}\n"
        for n, s in enumerate(offsets * 50)
    ]
    incidents = _check(lines, timedelta(hours=1))
    assert min(i[0] for i in incidents) == start + timedelta(seconds=200, microseconds=17 * 6)  # type: ignore[type-var]


@pytest.mark.parametrize("log_format", ["kmsg", "dmesg_uptime"])
def test_lines_exactly_at_the_window_edge_fold_and_one_microsecond_past_starts_anew(log_format: str) -> None:
    window = timedelta(seconds=2)
    steps = [0, 1_000_000, 2_000_000, 2_000_001, 4_000_001, 1_999_999]  # microseconds after a day
    lines = []
    for n, us in enumerate(steps):
        at = 86_400_000_000 + us
        prefix = f"6,{n},{at},-;" if log_format == "kmsg" else f"[{at // 1_000_000}.{at % 1_000_000:06d}] "
        lines.append(prefix + PAYLOAD.format(bus="3b") + "\n")
    incidents = _check(lines, window, boot_time=BOOT)
    day = BOOT + timedelta(days=1)
    # 0 .. 2 s (its window's end, included); then 2 s + 1 us .. 4 s + 1 us, which the late
    # 1.999999 s line joins, moving the incident's start back
    assert [(i[0], i[1], i[8]) for i in incidents] == [
        (day, day + timedelta(seconds=2), 3),
        (day + timedelta(microseconds=1_999_999), day + timedelta(microseconds=4_000_001), 3),
    ]


def test_interleaved_hosts_and_banners_mid_flood() -> None:
    lines = []
    for i in range(4_000):
        host = ("node-a", "node-b", "node-c")[i % 3]
        stamp = f"2025-01-21T04:41:{44 + i // 1000:02d}.{i * 997 % 1_000_000:06d}+00:00"
        lines.append(f"{stamp} {host} kernel: {PAYLOAD.format(bus='3b' if i % 4 else '5e')}\n")
        if i in (500, 2_500):
            lines.append(f"{stamp} node-b kernel: NVRM: GPU at PCI:0000:3b:00: GPU-{i:04d}-aaaa\n")
    incidents = _check(lines, timedelta(minutes=5))
    assert {i[7] for i in incidents if i[2] == "node-b" and i[3] == "0000:3b:00"} == {"GPU-0500-aaaa", "GPU-2500-aaaa"}


def test_a_flood_of_more_distinct_payloads_than_the_caches_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_log, "_CACHE_LIMIT", 4)
    lines = [
        f"[86400.{i:06d}] NVRM: Xid (PCI:0000:3b:00): {13 + i % 3}, pid={i % 11}, name=p{i % 5}, Ch {i % 9:08x}\n"
        for i in range(5_000)
    ]
    incidents = _check(lines, timedelta(minutes=5), boot_time=BOOT)
    assert sorted(i[4] for i in incidents) == [13, 14, 15]  # type: ignore[type-var]
    assert sum(i[8] for i in incidents) == 5_000  # type: ignore[misc]


def test_incident_times_are_utc_whatever_the_zone_of_the_boot_time_or_records() -> None:
    warsaw_boot = BOOT.astimezone(timezone(timedelta(hours=1)))
    lines = [f"[86400.{i:06d}] {PAYLOAD.format(bus='3b')}\n" for i in range(0, 900_000, 1_000)]
    (incident,) = deduplicate(parse_lines(lines, boot_time=warsaw_boot), timedelta(minutes=5))
    assert incident.ts == BOOT + timedelta(days=1) and incident.ts.utcoffset() == timedelta(0)  # type: ignore[union-attr]
    assert incident.last_ts == BOOT + timedelta(days=1, microseconds=899_000)
    assert incident.last_ts.utcoffset() == timedelta(0)  # type: ignore[union-attr]
    # records made elsewhere, in another zone: the same instants
    plus2 = timezone(timedelta(hours=2))
    records = [
        XidRecord(datetime(2025, 1, 21, 6, 0, s, tzinfo=plus2), "h", "0000:3b:00", 79, None, None, "", None, s, "x")
        for s in (5, 1, 9)
    ]
    (folded,) = deduplicate(records, timedelta(minutes=1))
    assert (folded.ts, folded.last_ts, folded.repeat_count) == (records[1].ts, records[2].ts, 3)
