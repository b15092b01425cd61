"""Floods through `ingest.kernel_log_parser`: every line of a flood keeps its own time and fields
while the parser reads most of them from its line cache, and `deduplicate` folds them as its
docstring says.

Expected values come from how each test builds its lines (integer microseconds, known bus ids),
or, for folding, from a plain reference fold written here from `deduplicate`'s docstring; never
from the parser itself. The made-up lines carry real NVRM payloads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone

import pytest

from ingest import kernel_log_parser as kernel_log
from ingest.kernel_log_parser import ParseStats, XidIncident, XidRecord, deduplicate, parse_line, parse_lines

BOOT = datetime(2025, 1, 20, 0, 0, 0, 250_000, tzinfo=UTC)  # not on a whole second, on purpose
REFERENCE = datetime(2025, 6, 1, tzinfo=UTC)
START = datetime(2025, 1, 21, 4, 41, 44, 999_000, tzinfo=UTC)
PAYLOAD = "NVRM: Xid (PCI:0000:{bus}:00): 13, pid=77, name=python3, Graphics SM Warp Exception"
NOISE = "IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready"
FORMATS = ("dmesg_iso", "rfc3339_syslog", "dmesg_uptime", "kmsg", "dmesg_ctime", "journal")


@dataclass(frozen=True)
class Expected:
    line_no: int
    ts: datetime
    host: str | None
    bus: str


def flood(n_lines: int, log_format: str, step_us: int = 1_337) -> tuple[list[str], list[Expected]]:
    """A flood on 8 GPUs, one unrelated line in ten, lines `step_us` apart (so seconds and the
    digit counts of kmsg's fields change during it), with the record each line must give."""
    lines: list[str] = []
    expected: list[Expected] = []
    for i in range(n_lines):
        moment = START + timedelta(microseconds=step_us * i)
        since_boot_us = (moment - BOOT) // timedelta(microseconds=1)
        bus = f"{0x18 + (i % 8) * 0x10:02x}"
        host: str | None = None
        ts = moment
        if log_format == "dmesg_iso":
            prefix = f"kern  :warn  : {moment:%Y-%m-%dT%H:%M:%S,%f}+00:00 "
        elif log_format == "rfc3339_syslog":
            prefix, host = f"{moment:%Y-%m-%dT%H:%M:%S.%f}+00:00 node-7 kernel: ", "node-7"
        elif log_format == "dmesg_uptime":
            prefix = f"[{since_boot_us // 1_000_000:6d}.{since_boot_us % 1_000_000:06d}] "
        elif log_format == "kmsg":
            prefix = f"4,{99_990 + i},{since_boot_us},-;"  # the sequence number gains a digit
        elif log_format == "dmesg_ctime":
            prefix, ts = f"[{moment:%a %b %d %H:%M:%S %Y}] ", moment.replace(microsecond=0)
        else:
            prefix, host, ts = f"{moment:%b %d %H:%M:%S} node-7 kernel: ", "node-7", moment.replace(microsecond=0)
        if i % 10 == 9:
            lines.append(prefix + NOISE + "\n")
        else:
            lines.append(prefix + PAYLOAD.format(bus=bus) + "\n")
            expected.append(Expected(i + 1, ts, host, f"0000:{bus}:00"))
    return lines, expected


def _fields(record: XidRecord) -> tuple[object, ...]:
    return (record.line_no, record.ts, record.host, record.pci_bus_id, record.xid, record.pid, record.process)


@pytest.mark.parametrize("log_format", FORMATS)
def test_every_line_of_a_flood_keeps_its_own_time_and_fields(log_format: str) -> None:
    lines, expected = flood(6_000, log_format)
    stats = ParseStats()
    records = list(parse_lines(lines, boot_time=BOOT, reference_time=REFERENCE, stats=stats))
    assert [_fields(r) for r in records] == [(e.line_no, e.ts, e.host, e.bus, 13, 77, "python3") for e in expected]
    assert {r.message for r in records} == {"Graphics SM Warp Exception"}
    assert {r.log_format for r in records} == {log_format}
    assert (stats.lines, stats.xid_records, stats.rejected) == (6_000, len(expected), 0)


@pytest.mark.parametrize("log_format", FORMATS)
def test_a_flood_folds_into_one_incident_per_gpu_spanning_its_lines(log_format: str) -> None:
    lines, expected = flood(6_000, log_format)
    stats = ParseStats()
    incidents = list(
        deduplicate(
            parse_lines(lines, boot_time=BOOT, reference_time=REFERENCE, stats=stats), timedelta(hours=1), node="n0"
        )
    )
    by_bus: dict[str, list[Expected]] = {}
    for e in expected:
        by_bus.setdefault(e.bus, []).append(e)
    got = sorted((i.pci_bus_id, i.ts, i.last_ts, i.repeat_count, i.first_line_no, i.node) for i in incidents)
    node = "node-7" if log_format in ("rfc3339_syslog", "journal") else "n0"
    assert got == sorted((bus, es[0].ts, es[-1].ts, len(es), es[0].line_no, node) for bus, es in by_bus.items())
    assert (stats.lines, stats.xid_records) == (6_000, len(expected))


@pytest.mark.parametrize("log_format", ["dmesg_iso", "kmsg"])
def test_a_zero_window_keeps_every_line_of_distinct_time_apart(log_format: str) -> None:
    lines, expected = flood(2_000, log_format)
    incidents = deduplicate(parse_lines(lines, boot_time=BOOT), timedelta(0))
    assert sorted((i.ts, i.pci_bus_id, i.repeat_count) for i in incidents) == sorted((e.ts, e.bus, 1) for e in expected)


@pytest.mark.parametrize("digits", [1, 3, 5, 7, 9])
def test_fractions_of_other_lengths_than_six_keep_their_time(digits: int) -> None:
    lines, times = [], []
    for i in range(3_000):
        moment = START + timedelta(microseconds=1_337 * i)
        frac = f"{moment.microsecond:06d}{i % 1000:03d}"[:digits]
        lines.append(f"{moment:%Y-%m-%dT%H:%M:%S}.{frac}+00:00 host-a kernel: {PAYLOAD.format(bus='3b')}\n")
        # the time cut to `digits` digits of a second, as `fromisoformat` reads it
        cut = 10 ** (6 - min(digits, 6))
        times.append(moment.replace(microsecond=moment.microsecond // cut * cut))
    assert [r.ts for r in parse_lines(lines)] == times
    (incident,) = deduplicate(parse_lines(lines), timedelta(minutes=5))
    assert (incident.ts, incident.last_ts, incident.repeat_count) == (times[0], times[-1], 3_000)


def test_a_fraction_past_microseconds_is_truncated_like_fromisoformat() -> None:
    payload = PAYLOAD.format(bus="3b")
    lines = [f"2025-01-21T04:41:44.{frac}+00:00 host kernel: {payload}\n" for frac in ("1234567", "9999999", "5")]
    records = list(parse_lines(lines))
    assert [r.ts.microsecond for r in records if r.ts] == [123456, 999999, 500000]


def test_kmsg_sequence_numbers_are_any_decimal_digits_and_nothing_else() -> None:
    arabic = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
    lines, kinds = [], []
    for i in range(2_000):
        seq, kind = str(100_000 + i), "kmsg"
        if i % 7 == 3:
            seq = seq.translate(arabic)  # a decimal digit to the regex's `\d`: the same record
        elif i % 7 == 5:
            seq, kind = seq[:-1] + "²", "unknown"  # a digit to `str.isdigit`, not to `\d`
        separator = ","
        if i % 11 == 6:
            separator, kind = ";", "unknown"  # not a kmsg record either
        lines.append(f"6,{seq}{separator}{86_400_000_000 + 250 * i},-;{PAYLOAD.format(bus='3b')}\n")
        kinds.append(kind)
    records = list(parse_lines(lines, boot_time=BOOT))
    assert [r.log_format for r in records] == kinds
    assert [r.ts for r in records] == [
        BOOT + timedelta(microseconds=86_400_000_000 + 250 * i) if kind == "kmsg" else None
        for i, kind in enumerate(kinds)
    ]


def _variants() -> list[str]:
    """Prefixes whose fraction length, zone, digits and format change from line to line."""
    rng = random.Random(7)
    start = datetime(2025, 3, 30, 0, 59, 58, tzinfo=UTC)  # spans Europe's spring DST change
    payload = "NVRM: Xid (PCI:0000:3b:00): 48, pid=77, name=python3, An uncorrectable double bit error"
    arabic_seven = "\u0667"  # a digit to the regex `\d`, but not an ASCII one
    lines = []
    for i in range(400):
        moment = start + timedelta(microseconds=rng.randrange(0, 4_000_000))
        frac = f"{moment.microsecond:06d}"[: rng.choice((1, 3, 6))] + ("" if rng.random() < 0.8 else "789")
        iso = moment.strftime("%Y-%m-%dT%H:%M:%S")
        uptime = int((moment - BOOT).total_seconds())
        arabic_frac = frac.replace("7", arabic_seven)
        lines += [
            f"{iso}.{frac}+00:00 node-{i % 3} kernel: {payload}\n",
            f"kern  :err   : {iso},{frac}+0100 {payload}\n",
            f"{iso}.{frac} {payload}\n",  # naive: the zone given to the parser applies
            f"[{uptime:>6d}.{frac}] {payload}\n",
            f"Mar 30 {moment:%H:%M:%S}.{frac} node-{i % 2} kernel: {payload}\n",
            f"[{uptime:>6d}.{arabic_frac}] {payload}\n",
            f"[{uptime:>6d}.{frac[:-1]}x] {payload}\n",  # not a stamp at all
            f"6,{rng.randrange(10 ** rng.randrange(1, 4))},{uptime}{frac},-;{payload}\n",  # kmsg
            f"6,{i},{uptime}{arabic_frac},-;{payload}\n",
            f"[{uptime:>6d}.{frac}] NVRM: Xid (PCI:0000:3b:00): 4x, garbled\n",
            f"{iso}.{frac}+00:00 node-0 kernel: [ {uptime}.{frac}] {payload}\n",
        ]
    rng.shuffle(lines)
    return lines


def _record(record: XidRecord | None) -> tuple[object, ...] | None:
    if record is None:
        return None
    return (record.ts, record.host, record.pci_bus_id, record.xid, record.pid, record.process, record.message)


@pytest.mark.parametrize("tz", [None, "Europe/Warsaw"])
def test_a_lines_record_does_not_depend_on_the_lines_before_it(tz: str | None) -> None:
    # Formats, fractions, zones and digits changing from line to line: what the parser learnt
    # from earlier lines must never change what a line says.
    lines = _variants()
    streamed = {r.line_no: _record(r) for r in parse_lines(lines, boot_time=BOOT, reference_time=REFERENCE, tz=tz)}
    for line_no, line in enumerate(lines, start=1):
        try:
            alone = _record(parse_line(line, boot_time=BOOT, reference_time=REFERENCE, tz=tz))
        except ValueError:
            alone = None  # a rejected line: the stream must not yield it either
        assert streamed.get(line_no) == alone, f"line {line_no}: {line!r}"
    assert len(streamed) > 2_000


# -- folding -------------------------------------------------------------------------------


def _row(i: XidIncident) -> tuple[object, ...]:
    return (i.ts, i.last_ts, i.node, i.pci_bus_id, i.xid, i.pid, i.process, i.gpu_uuid, i.repeat_count, i.first_line_no)


def _reference(records: list[XidRecord], window: timedelta, node: str | None) -> list[tuple[object, ...]]:
    """Fold by the docstring, simply: same (host, bus id, xid), same GPU, within `window` of the
    incident's first line (which moves to an earlier line folded in); sorted for comparison."""
    open_: dict[tuple[object, ...], XidIncident] = {}
    closed: list[XidIncident] = []
    for r in records:
        key: tuple[object, ...] = (r.host or node, r.pci_bus_id, r.xid)
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
            r.ts, r.ts, r.host or node, r.pci_bus_id, r.xid, r.pid, r.process, r.message, r.gpu_uuid, 1, r.line_no
        )
    return sorted((_row(i) for i in closed + list(open_.values())), key=repr)


def _folded(lines: list[str], window: timedelta, **kwargs: object) -> list[tuple[object, ...]]:
    """`deduplicate(parse_lines(...))`, which folds straight from the parser, checked against
    `deduplicate` of the records and against the reference fold."""
    folded = sorted((_row(i) for i in deduplicate(parse_lines(lines, **kwargs), window, node="n0")), key=repr)  # type: ignore[arg-type]
    records = list(parse_lines(lines, **kwargs))  # type: ignore[arg-type]
    assert sorted((_row(i) for i in deduplicate(records, window, node="n0")), key=repr) == folded
    assert folded == _reference(records, window, "n0")
    return folded


def test_folding_with_banners_replaced_gpus_times_far_apart_hosts_and_junk() -> None:
    # Times jump by weeks from line to line here (kmsg stamps of garbled digits), so incidents
    # also close because the stream's latest time moved past them, which the reference fold
    # does not model: every line is still counted once, in an incident of its GPU.
    rng = random.Random(11)
    lines = _variants()
    banner = "2025-03-30T01:00:00.000000+00:00 node-{h} kernel: NVRM: GPU at PCI:0000:3b:00: GPU-{u}\n"
    for at in sorted(rng.sample(range(len(lines)), 12), reverse=True):
        lines.insert(at, banner.format(h=at % 3, u=f"{at:08d}-aaaa"))  # the GPU of a bus changes
    lines.insert(len(lines) // 2, "\x00\x01binary junk\n")
    kwargs = {"boot_time": BOOT, "reference_time": REFERENCE}
    records = list(parse_lines(lines, **kwargs))  # type: ignore[arg-type]
    for window in (timedelta(0), timedelta(milliseconds=700), timedelta(hours=1)):
        folded = list(deduplicate(parse_lines(lines, **kwargs), window, node="n0"))  # type: ignore[arg-type]
        assert sorted(map(_row, folded), key=repr) == sorted(
            map(_row, deduplicate(records, window, node="n0")), key=repr
        )
        assert sum(i.repeat_count for i in folded) == len(records)
        for incident in folded:
            assert incident.ts is None or incident.last_ts - incident.ts <= 2 * window  # type: ignore[operator]
        uuids = {(r.host or "n0", r.gpu_uuid) for r in records} | {(r.host or "n0", None) for r in records}
        assert {(i.node, i.gpu_uuid) for i in folded} <= uuids
    _folded(lines[:600], timedelta(milliseconds=700), **kwargs)  # a stretch where none closed early


def test_lines_out_of_order_move_the_incident_start_and_its_window() -> None:
    offsets = [5_000, 5_100, 5_200, 1_000, 5_300, 9_000, 200, 4_999]  # seconds after START
    lines = [
        f"{START + timedelta(seconds=s, microseconds=17 * n):%Y-%m-%dT%H:%M:%S.%f}+00:00 h kernel: "
        f"{PAYLOAD.format(bus='3b')}\n"
        for n, s in enumerate(offsets * 50)
    ]
    incidents = _folded(lines, timedelta(hours=1))
    assert min(i[0] for i in incidents) == START + timedelta(seconds=200, microseconds=17 * 6)  # type: ignore[type-var]


@pytest.mark.parametrize("log_format", ["kmsg", "dmesg_uptime"])
def test_lines_exactly_at_the_window_edge_fold_and_one_microsecond_past_starts_anew(log_format: str) -> None:
    window = timedelta(seconds=2)
    steps = [0, 1_000_000, 2_000_000, 2_000_001, 4_000_001, 1_999_999]  # microseconds after a day
    lines = []
    for n, us in enumerate(steps):
        at = 86_400_000_000 + us
        prefix = f"6,{n},{at},-;" if log_format == "kmsg" else f"[{at // 1_000_000}.{at % 1_000_000:06d}] "
        lines.append(prefix + PAYLOAD.format(bus="3b") + "\n")
    incidents = _folded(lines, window, boot_time=BOOT)
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
    incidents = _folded(lines, timedelta(minutes=5))
    assert {i[7] for i in incidents if i[2] == "node-b" and i[3] == "0000:3b:00"} == {"GPU-0500-aaaa", "GPU-2500-aaaa"}


def test_a_banner_mid_flood_splits_it_where_the_gpu_was_replaced() -> None:
    lines, _ = flood(3_000, "rfc3339_syslog", step_us=100)
    banner = f"{START:%Y-%m-%dT%H:%M:%S.%f}+00:00 node-7 kernel: NVRM: GPU at PCI:0000:18:00: GPU-{{}}\n"
    for at, uuid in ((2_000, "bbbb"), (1_000, "aaaa")):
        lines.insert(at, banner.format(uuid))
    incidents = _folded(lines, timedelta(minutes=5), boot_time=BOOT, reference_time=REFERENCE)
    bus_18 = [(i[7], i[8]) for i in incidents if i[3] == "0000:18:00"]
    # 375 lines of this GPU: those before the first banner fold into the incident that learns
    # its UUID (aaaa); the replacement's (bbbb) start a new one
    assert sorted(bus_18, key=str) == [("GPU-aaaa", 250), ("GPU-bbbb", 125)]


def test_a_flood_of_more_distinct_payloads_than_the_caches_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_log, "_CACHE_LIMIT", 4)
    lines = [
        f"[86400.{i:06d}] NVRM: Xid (PCI:0000:3b:00): {13 + i % 3}, pid={i % 11}, name=p{i % 5}, Ch {i % 9:08x}\n"
        for i in range(5_000)
    ]
    records = list(parse_lines(lines, boot_time=BOOT))
    assert [(r.xid, r.pid, r.process, r.message) for r in records] == [
        (13 + i % 3, i % 11, f"p{i % 5}", f"Ch {i % 9:08x}") for i in range(5_000)
    ]
    incidents = _folded(lines, timedelta(minutes=5), boot_time=BOOT)
    assert sorted(i[4] for i in incidents) == [13, 14, 15]  # type: ignore[type-var]
    assert sum(i[8] for i in incidents) == 5_000  # type: ignore[misc]


def test_a_flood_without_a_time_folds_by_key() -> None:
    lines = flood(500, "kmsg")[0] + flood(500, "dmesg_uptime")[0]
    incidents = _folded(lines, timedelta(minutes=5))  # no boot time: untimed
    assert {i[0] for i in incidents} == {None}
    assert (len(incidents), sum(i[8] for i in incidents)) == (8, 900)  # type: ignore[misc]


def test_a_partly_consumed_parse_is_deduplicated_from_where_it_stopped() -> None:
    lines, _ = flood(100, "dmesg_iso")
    records = parse_lines(lines)
    first = next(records)
    rest = list(deduplicate(records, timedelta(minutes=5)))
    assert first.line_no == 1 and sum(i.repeat_count for i in rest) == 89


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
