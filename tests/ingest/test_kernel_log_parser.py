"""Unit tests of `ingest.kernel_log_parser`: parsing every real log format and Xid line shape,
context lines, the off-the-bus message, rejected lines, bounded messages, year inference, time
zones and deduplication. Floods (the parser's line cache, folding) are in
`test_kernel_log_floods.py`.

Real lines come from `tests/fixtures/kernel_log/` (see SOURCE.txt there). Lines written inline
below are made up for this test: real NVRM payloads wrapped in the prefixes of formats for which
the fixtures hold no Xid line (kmsg, RFC 3339 syslog, journal with host), or edge cases.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.kernel_log_parser import (
    MAX_MESSAGE_CHARS,
    MONTH_ABBREVIATIONS,
    OFF_BUS_MESSAGE,
    ParseStats,
    XidRecord,
    deduplicate,
    infer_year,
    parse_line,
    parse_lines,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kernel_log"
BOOT = datetime(2026, 3, 1, 8, 0, tzinfo=UTC)
REF = datetime(2026, 6, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Row:
    number: int  # 1-based among the data rows of the TSV
    kind: str  # an Xid code, ctx:N, none or sxid
    log_format: str
    line: str


def real_rows() -> list[Row]:
    text = (FIXTURES / "xid_real_lines.tsv").read_text(encoding="utf-8")
    data = [line for line in text.splitlines() if line and not line.startswith("#")]
    rows = []
    for number, line in enumerate(data, start=1):
        kind, log_format, _gpu, _source, raw = line.split("\t", 4)
        rows.append(Row(number, kind, log_format, raw))
    return rows


ROWS = real_rows()
XID_ROWS = [r for r in ROWS if r.kind.isdigit()]
OTHER_ROWS = [r for r in ROWS if not r.kind.isdigit()]

# The TSV's format names -> the parser's (the TSV splits out localized months and multi-line
# messages, which the parser handles inside the journal and dmesg formats).
FORMAT_NAMES = {
    "bare": "bare",
    "journal_noprefix": "journal_noprefix",
    "journal_localized": "journal",
    "dmesg_uptime": "dmesg_uptime",
    "dmesg_ctime": "dmesg_ctime",
    "dmesg_iso": "dmesg_iso",
    "journal": "journal",
    "journal_nohost": "journal_nohost",
}


def parse(line: str, **kwargs: object) -> XidRecord:
    record = parse_line(line, boot_time=BOOT, reference_time=REF, **kwargs)  # type: ignore[arg-type]
    assert record is not None, line
    return record


def test_fixture_covers_the_formats_we_claim() -> None:
    assert len(XID_ROWS) == 39
    assert {r.log_format for r in XID_ROWS} == set(FORMAT_NAMES) - {"journal"}


@pytest.mark.parametrize("row", XID_ROWS, ids=lambda r: f"row{r.number}-{r.log_format}-xid{r.kind}")
def test_every_real_xid_line_gives_its_code_bus_id_and_format(row: Row) -> None:
    record = parse(row.line)
    assert record.xid == int(row.kind)
    # The bus id as printed, read independently of the parser: domain:bus:device in hex.
    printed = re.search(r"Xid \((?:PCI:)?([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-7])?\)", row.line)
    assert printed is not None
    assert record.pci_bus_id == ":".join(printed.groups()).lower()
    assert record.log_format == FORMAT_NAMES[row.log_format]


@pytest.mark.parametrize("row", OTHER_ROWS, ids=lambda r: f"row{r.number}-{r.kind}")
def test_context_fault_and_sxid_lines_alone_give_no_record(row: Row) -> None:
    assert parse_line(row.line, boot_time=BOOT, reference_time=REF) is None


def row(number: int) -> str:
    return ROWS[number - 1].line


@pytest.mark.parametrize(
    ("number", "ts", "pci", "pid", "process", "message"),
    [
        # dmesg uptime: boot time + 11272.551321 s
        (
            2,
            BOOT + timedelta(seconds=11272, microseconds=551321),
            "0000:0b:00",
            11263,
            "Renderer",
            "Ch 00000020, errorString CTX SWITCH TIMEOUT, Info 0xac00d",
        ),
        # journal without host, year from the reference time; note the extra spaces after pid
        (
            4,
            datetime(2025, 9, 18, 20, 7, 1, tzinfo=UTC),
            "0000:02:00",
            8494,
            "RenderThread",
            "channel 0x0000000d, CTX SWITCH TIMEOUT, Info 0x14c011",
        ),
        (7, None, "0000:01:00", 15349, "Main", "channel 0x00000018, errorString CTX SWITCH TIMEOUT, Info 0x5c02a"),
        # Polish month: kwi = April
        (
            9,
            datetime(2026, 4, 15, 7, 56, 59, tzinfo=UTC),
            "0000:07:00",
            326,
            "modprobe",
            "channel 0x00000003 0000c597 00000000 00000000",
        ),
        # pid='<unknown>', name=<unknown>
        (
            10,
            datetime(2024, 8, 30, 11, 43, 9, tzinfo=UTC),
            "0000:cb:00",
            None,
            None,
            "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
        ),
        # a non-zero PCI domain
        (
            14,
            datetime(2026, 4, 26, 23, 12, 26, tzinfo=UTC),
            "0001:6c:00",
            10200,
            "NvmlTaskRunner",
            "Timeout after 45s of waiting for RPC response from GPU5 GSP! Expected function 76 (GSP_RM_CONTROL) "
            "sequence 24174 (0x20801322 0x808).",
        ),
        # no pid, no name
        (
            18,
            None,
            "0000:00:00",
            None,
            None,
            "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x026001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
        ),
        (
            27,
            datetime(2025, 1, 21, 4, 41, 44, 283302, tzinfo=UTC),
            "0000:38:00",
            None,
            None,
            "Graphics SM Global Exception on (GPC 8, TPC 5, SM 1): Multiple Warp Errors",
        ),
        (33, None, "0000:01:00", None, None, "Row remapping pending"),
        # process names with ':' and '['
        (
            39,
            None,
            "0000:17:00",
            15822502,
            "nvc:[driver]",
            "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20802a02 0x8).",
        ),
        # gpufail's own H100 (driver 580.159.04): an MMU fault provoked by an out-of-bounds write
        (
            43,
            BOOT + timedelta(seconds=63, microseconds=382722),
            "0000:00:06",
            782,
            "python3",
            "channel 0x0000000a, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC1 GPCCLIENT_T1_8 faulted @ "
            "0x8062_3be00000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE",
        ),
        (
            28,
            None,
            "0018:01:00",
            876767,
            "ray::WorkerDict",
            "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)",
        ),
        # Xid line shapes of current drivers: the code, then a space and key=value fields
        (44, None, "0001:00:00", None, None, "Recommended Action=CONTACT_SUPPORT"),
        # ... or a pid followed by a space and more
        (45, None, "0002:00:00", 1582259, None, "Recommended Action=COMPONENT_RESET"),
        # the code alone; a bus id with its PCI function
        (46, None, "0000:3f:00", None, None, ""),
        (47, None, "0000:b3:00", None, None, ""),
        # NVLink subcodes: runs of spaces kept, R575+ names with '/'
        (
            48,
            None,
            "0018:01:00",
            None,
            None,
            "NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
        ),
        (
            49,
            None,
            "0000:04:00",
            None,
            None,
            "NETIR_LINK_EVT/NETIR_LINK_DOWN Fatal XC0 i0 Link 00 (0x00000011 0x00000000 0x00000000 0x00000000)",
        ),
        (
            50,
            None,
            "0003:00:00",
            None,
            None,
            "NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
        ),
        # the form without "PCI:" of older drivers
        (51, None, "0000:03:00", None, None, "Channel 00000001"),
        # Xid 154 as NVIDIA's catalog words it: no comma after the code
        (
            52,
            None,
            "0008:01:00",
            None,
            None,
            "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
        ),
    ],
)
def test_real_lines_exact_fields(
    number: int, ts: datetime | None, pci: str, pid: int | None, process: str | None, message: str
) -> None:
    record = parse(row(number))
    assert (record.ts, record.pci_bus_id, record.pid, record.process, record.message) == (
        ts,
        pci,
        pid,
        process,
        message,
    )


def test_host_is_taken_from_formats_that_have_one() -> None:
    assert parse(row(9)).host == "testowy"
    assert parse(row(4)).host is None


def test_whole_real_file_in_order_attaches_banner_uuids_and_reads_off_bus_text() -> None:
    stats = ParseStats()
    records = list(parse_lines((r.line for r in ROWS), boot_time=BOOT, reference_time=REF, stats=stats))
    assert stats.lines == len(ROWS)
    assert stats.rejected == 0
    # every Xid row, plus one record for the two-line off-the-bus message; SXid rows ignored
    assert len(records) == len(XID_ROWS) + 1
    by_line = {r.line_no: r for r in records}
    assert by_line[2].gpu_uuid == "GPU-aaaba90e-a327-1a65-9c8d-fd28b59b8057"  # banner on row 1
    assert by_line[9].gpu_uuid == "GPU-fb51809b-350a-99db-67b5-e16fc6d498ab"  # banner on row 8, same host
    assert by_line[4].gpu_uuid is None  # a banner of another bus id does not leak
    off_bus = by_line[21]
    assert (off_bus.xid, off_bus.pci_bus_id, off_bus.message) == (79, "0000:b3:00", OFF_BUS_MESSAGE)
    assert off_bus.ts == BOOT + timedelta(seconds=1843, microseconds=308145)  # time of the first line
    assert not any(r.xid >= 20000 for r in records)  # no SXid code slipped through


def test_banner_uuid_applies_only_to_later_lines_of_its_bus_id() -> None:
    lines = [
        "[ 10.0] NVRM: Xid (PCI:0000:0b:00): 13, pid=1, name=a, x",
        "[ 11.0] NVRM: GPU at PCI:0000:0b:00: GPU-11111111-2222-3333-4444-555555555555",
        "[ 12.0] NVRM: Xid (PCI:0000:0b:00): 13, pid=1, name=a, x",
        "[ 13.0] NVRM: Xid (PCI:0000:0c:00): 13, pid=1, name=a, x",
    ]
    uuids = [r.gpu_uuid for r in parse_lines(lines)]
    assert uuids == [None, "GPU-11111111-2222-3333-4444-555555555555", None]


def test_off_bus_message_as_the_driver_prints_it_in_three_lines() -> None:
    lines = [
        "Jul 09 10:42:47 pool0-0082 kernel: NVRM: The NVIDIA GPU 0000:b3:00.0",
        "Jul 09 10:42:47 pool0-0082 kernel: NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "Jul 09 10:42:47 pool0-0082 kernel: NVRM: fallen off the bus and is not responding to commands.",
    ]
    (record,) = parse_lines(lines, reference_time=REF)
    assert (record.xid, record.pci_bus_id, record.host, record.line_no) == (79, "0000:b3:00", "pool0-0082", 1)
    assert "off-the-bus" in record.message
    assert record.ts == datetime(2025, 7, 9, 10, 42, 47, tzinfo=UTC)


def test_off_bus_message_on_one_line() -> None:
    record = parse("[ 1843.308145] NVRM: GPU 0000:b3:00.0: GPU has fallen off the bus.")
    assert (record.xid, record.pci_bus_id, record.message) == (79, "0000:b3:00", OFF_BUS_MESSAGE)


def test_off_bus_continuation_too_far_from_its_start_is_not_guessed() -> None:
    lines = ["NVRM: The NVIDIA GPU 0000:b3:00.0"] + ["NVRM: unrelated driver chatter"] * 10
    lines.append("NVRM: fallen off the bus and is not responding to commands.")
    assert list(parse_lines(lines)) == []


def test_sxid_lines_are_not_gpu_xids() -> None:
    sxid = [r.line for r in ROWS if r.kind == "sxid"]
    stats = ParseStats()
    assert list(parse_lines(sxid, stats=stats)) == []
    assert stats.rejected == 0


# -- formats without an Xid line among the fixtures: made-up lines with real payloads --------

PAYLOAD = "NVRM: Xid (PCI:0000:9b:00): 94, pid=1234, name=python3, Contained ECC error"


def test_kmsg_record_uses_monotonic_microseconds_and_boot_time() -> None:
    line = "4,5021,206764307,-;" + PAYLOAD
    assert parse(line).ts == BOOT + timedelta(microseconds=206764307)
    assert parse(line).log_format == "kmsg"
    assert parse_line(line).ts is None  # type: ignore[union-attr]  # no boot time: cannot place it


def test_real_kmsg_file_without_nvrm_lines_gives_nothing_and_rejects_nothing() -> None:
    lines = (FIXTURES / "gpud_kmsg.1.log").read_text().splitlines()
    stats = ParseStats()
    assert list(parse_lines(lines, boot_time=BOOT, stats=stats)) == []
    assert (stats.lines, stats.rejected) == (len(lines), 0)


@pytest.mark.parametrize(
    ("line", "ts", "host"),
    [
        (
            "2026-06-01T15:55:06.218036+03:00 gpu-node-007 kernel: " + PAYLOAD,
            datetime(2026, 6, 1, 12, 55, 6, 218036, tzinfo=UTC),
            "gpu-node-007",
        ),
        (
            "2026-06-01T12:55:06Z gpu-node-007 kernel: [ 7839.537911] " + PAYLOAD,
            datetime(2026, 6, 1, 12, 55, 6, tzinfo=UTC),
            "gpu-node-007",
        ),
        ("Jul 09 10:42:47 pool0-0082 kernel: " + PAYLOAD, datetime(2025, 7, 9, 10, 42, 47, tzinfo=UTC), "pool0-0082"),
        (
            "Jul  9 10:42:47 pool0-0082 kernel: [ 7839.537911] " + PAYLOAD,
            datetime(2025, 7, 9, 10, 42, 47, tzinfo=UTC),
            "pool0-0082",
        ),
        (
            "kern  :err   : 2025-01-21T04:41:44,283302+00:00 " + PAYLOAD,
            datetime(2025, 1, 21, 4, 41, 44, 283302, tzinfo=UTC),
            None,
        ),
        ("2025-01-21T04:41:44,283302+00:00 " + PAYLOAD, datetime(2025, 1, 21, 4, 41, 44, 283302, tzinfo=UTC), None),
        ("[Sun Feb 23 16:24:18 2025] " + PAYLOAD, datetime(2025, 2, 23, 16, 24, 18, tzinfo=UTC), None),
        ("<4>" + PAYLOAD, None, None),
    ],
)
def test_prefix_formats(line: str, ts: datetime | None, host: str | None) -> None:
    record = parse(line)
    assert (record.ts, record.host, record.xid, record.pid) == (ts, host, 94, 1234)


@pytest.mark.parametrize(
    ("month", "number"),
    [("kwi", 4), ("Mär", 3), ("févr.", 2), ("мая", 5), ("4月", 4), ("ene", 1), ("Okt", 10), ("gru", 12)],
)
def test_localized_journal_months(month: str, number: int) -> None:
    record = parse(f"{month} 15 07:56:59 testowy kernel: {PAYLOAD}")
    assert record.ts is not None and record.ts.month == number


def test_month_table_is_unambiguous_and_complete() -> None:
    for locale, names in MONTH_ABBREVIATIONS.items():
        assert len(set(names)) == 12, locale


def test_unknown_month_gives_no_time_rather_than_a_wrong_one() -> None:
    record = parse(f"Foo 15 07:56:59 host kernel: {PAYLOAD}")
    assert record.ts is None and record.xid == 94


# -- time --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stamp", "reference", "expected"),
    [
        ("Dec 31 23:59:58", datetime(2026, 1, 1, 0, 30, tzinfo=UTC), datetime(2025, 12, 31, 23, 59, 58, tzinfo=UTC)),
        ("Jan 01 00:10:00", datetime(2026, 1, 1, 0, 30, tzinfo=UTC), datetime(2026, 1, 1, 0, 10, tzinfo=UTC)),
        # the writer's clock a little ahead of the reader's: within the day of slack
        ("Jan 01 00:05:00", datetime(2025, 12, 31, 23, 50, tzinfo=UTC), datetime(2026, 1, 1, 0, 5, tzinfo=UTC)),
        # more than a day after the reference: last year's
        ("Jan 05 00:00:00", datetime(2025, 12, 31, 23, 50, tzinfo=UTC), datetime(2025, 1, 5, tzinfo=UTC)),
        ("Dec 30 12:00:00", datetime(2026, 1, 2, tzinfo=UTC), datetime(2025, 12, 30, 12, tzinfo=UTC)),
        # Feb 29 goes back to the last leap year
        ("Feb 29 10:00:00", datetime(2027, 3, 1, tzinfo=UTC), datetime(2024, 2, 29, 10, tzinfo=UTC)),
    ],
)
def test_journal_year_inference_around_new_year(stamp: str, reference: datetime, expected: datetime) -> None:
    record = parse_line(f"{stamp} node-1 kernel: {PAYLOAD}", reference_time=reference)
    assert record is not None and record.ts == expected


def test_year_less_stamp_without_reference_time_has_no_time() -> None:
    assert parse_line(f"Dec 31 23:59:58 node-1 kernel: {PAYLOAD}").ts is None  # type: ignore[union-attr]


def test_infer_year_in_a_time_zone() -> None:
    # 00:30 in Warsaw on Jan 1 is 23:30 UTC on Dec 31
    reference = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)
    from zoneinfo import ZoneInfo

    moment = infer_year(1, 1, 0, 30, 0, reference, ZoneInfo("Europe/Warsaw"))
    assert moment == datetime(2025, 12, 31, 23, 30, tzinfo=UTC)


def test_ctime_is_utc_unless_a_time_zone_is_given() -> None:
    line = row(10)  # [Fri Aug 30 11:43:09 2024]
    assert parse(line).ts == datetime(2024, 8, 30, 11, 43, 9, tzinfo=UTC)
    assert parse(line, tz="Europe/Warsaw").ts == datetime(2024, 8, 30, 9, 43, 9, tzinfo=UTC)  # CEST, +2
    assert parse(line, tz="America/New_York").ts == datetime(2024, 8, 30, 15, 43, 9, tzinfo=UTC)  # EDT, -4


def test_explicit_offsets_ignore_the_time_zone_argument() -> None:
    line = "2026-06-01T15:55:06+03:00 host kernel: " + PAYLOAD
    assert parse(line, tz="America/New_York").ts == datetime(2026, 6, 1, 12, 55, 6, tzinfo=UTC)


def test_unknown_time_zone_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="Mars/Olympus"):
        parse_line(PAYLOAD, tz="Mars/Olympus")


# -- bad input -----------------------------------------------------------------------------


def test_malformed_xid_line_raises_for_one_line_with_the_reason() -> None:
    with pytest.raises(ValueError, match="'abc' is not a number"):
        parse_line("NVRM: Xid (PCI:0000:3b:00): abc, pid=1, name=x, y")


def test_malformed_lines_in_a_stream_are_counted_with_line_numbers_not_raised() -> None:
    lines = [
        row(2),
        "[ 5.0] NVRM: Xid (PCI:0000:3b:00): abc, pid=1, name=x, y",  # non-numeric code
        "[ 5.1] NVRM: Xid (PCI:zz:3b): 13, pid=1, name=x, y",  # bad bus id
        "[ 5.2] NVRM: Xid garbled",
        "[ 5.3] NVRM: Xid (PCI:0000:3b:00): 13abc, pid=1, name=x, y",  # a code with letters
        "\x00\x00\x00\x00",
        "caf\ufffd\ufffd binary",
        row(27),
    ]
    stats = ParseStats()
    records = list(parse_lines(lines, stats=stats))
    assert [r.xid for r in records] == [109, 13]
    assert stats.rejected == 6
    assert [r.line_no for r in stats.rejected_lines] == [2, 3, 4, 5, 6, 7]
    assert "not a number" in stats.rejected_lines[0].reason
    assert "PCI bus id" in stats.rejected_lines[1].reason


def test_windows_line_endings_are_not_part_of_the_message() -> None:
    record = parse(row(27) + "\r\n")
    assert record.message.endswith("Multiple Warp Errors")


def test_garbled_pid_keeps_the_xid() -> None:
    record = parse("NVRM: Xid (PCI:0000:3b:00): 48, pid=??, name=python3, DBE")
    assert (record.xid, record.pid, record.process, record.message) == (48, None, "python3", "DBE")


@pytest.mark.parametrize(
    ("payload", "xid", "pid", "process", "message"),
    [
        ("79 Recommended Action=CONTACT_SUPPORT", 79, None, None, "Recommended Action=CONTACT_SUPPORT"),
        ("13\tpid=5, name=a, m", 13, 5, "a", "m"),  # any blank after the code
        (
            "119, pid=1582259 Recommended Action=COMPONENT_RESET",
            119,
            1582259,
            None,
            "Recommended Action=COMPONENT_RESET",
        ),
        ("31, pid=782, name=python3", 31, 782, "python3", ""),
        ("31, pid=782", 31, 782, None, ""),  # a pid and nothing after it
        ("46", 46, None, None, ""),
        ("46   ", 46, None, None, ""),
        ("13,pid=5,name=b,c", 13, 5, "b", "c"),
        ("154 GPU recovery action changed", 154, None, None, "GPU recovery action changed"),
    ],
)
def test_the_code_is_the_leading_integer_and_the_rest_the_message(
    payload: str, xid: int, pid: int | None, process: str | None, message: str
) -> None:
    record = parse(f"[ 5.0] NVRM: Xid (PCI:0000:3b:00): {payload}")
    assert (record.xid, record.pid, record.process, record.message) == (xid, pid, process, message)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ("13abc, pid=1, name=x, y", "'13abc' is not a number"),  # letters glued to the code
        ("abc def, pid=1", "'abc' is not a number"),
        ("", "'' is not a number"),
        (", pid=1", "'' is not a number"),
        ("99999999999, pid=1", "out of range"),  # beyond the int32 column it is stored in
        ("1" * 5000 + ", x", "out of range"),  # longer than int() reads
    ],
)
def test_an_xid_line_without_a_usable_code_is_rejected_with_the_reason(payload: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        parse_line(f"NVRM: Xid (PCI:0000:3b:00): {payload}")


def test_a_pid_beyond_the_int64_column_is_dropped_not_stored_wrong() -> None:
    record = parse("NVRM: Xid (PCI:0000:3b:00): 13, pid=99999999999999999999, name=a, m")
    assert (record.xid, record.pid, record.process, record.message) == (13, None, "a", "m")


@pytest.mark.parametrize(
    "line",
    [
        "4,1,99999999999999999999999,-;NVRM: Xid (PCI:0000:3b:00): 13, x",  # kmsg microseconds
        "[99999999999999999.5] NVRM: Xid (PCI:0000:3b:00): 13, x",  # uptime seconds
        "[" + "9" * 5000 + ".5] NVRM: Xid (PCI:0000:3b:00): 13, x",
        "9999-12-31T23:59:59-05:00 host kernel: NVRM: Xid (PCI:0000:3b:00): 13, x",  # past year 9999 in UTC
    ],
)
def test_a_stamp_out_of_range_gives_no_time_rather_than_an_error(line: str) -> None:
    record = parse(line)
    assert (record.ts, record.xid) == (None, 13)


# -- bounded messages ----------------------------------------------------------------------


def test_a_huge_message_is_cut_to_the_limit_and_counted() -> None:
    huge = "x" * 20_000_000
    line = f"[ 5.000001] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, {huge}\n"
    stats = ParseStats()
    records = list(parse_lines([line, line.replace("5.000001", "5.000002"), row(2)], stats=stats))
    assert [r.xid for r in records] == [13, 13, 109]
    cut = records[0].message
    assert cut == "x" * MAX_MESSAGE_CHARS + " [truncated: 20,000,000 characters]"
    assert records[1].message == cut and records[2].message.startswith("Ch 00000020")
    assert (stats.truncated_messages, stats.xid_records, stats.rejected) == (2, 3, 0)


def test_a_message_at_the_limit_is_kept_whole() -> None:
    message = "y" * MAX_MESSAGE_CHARS
    stats = ParseStats()
    (record,) = parse_lines([f"NVRM: Xid (PCI:0000:3b:00): 13, {message}"], stats=stats)
    assert record.message == message and stats.truncated_messages == 0


@pytest.mark.parametrize("length", [MAX_MESSAGE_CHARS + 1, 3 * MAX_MESSAGE_CHARS])
def test_every_line_of_a_flood_of_long_messages_is_counted_as_cut(length: int) -> None:
    lines = [f"[ 5.{i:06d}] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, {'m' * length}" for i in range(300)]
    stats = ParseStats()
    records = list(parse_lines(lines, stats=stats))
    assert {len(r.message) for r in records} == {MAX_MESSAGE_CHARS + len(f" [truncated: {length:,} characters]")}
    assert (stats.truncated_messages, stats.xid_records) == (300, 300)


def test_a_huge_process_name_is_cut_too() -> None:
    stats = ParseStats()
    (record,) = parse_lines([f"NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name={'p' * 1_000_000}, short"], stats=stats)
    assert record.process == "p" * MAX_MESSAGE_CHARS + " [truncated: 1,000,000 characters]"
    assert (record.message, stats.truncated_messages) == ("short", 1)


def test_a_flood_of_huge_messages_folds_into_one_incident_with_the_cut_message() -> None:
    lines = [f"[ 5.{i:06d}] NVRM: Xid (PCI:0000:3b:00): 13, {'z' * 100_000}" for i in range(50)]
    stats = ParseStats()
    (incident,) = deduplicate(parse_lines(lines, stats=stats), timedelta(minutes=5))
    assert incident.repeat_count == 50 and len(incident.message) < MAX_MESSAGE_CHARS + 40
    assert stats.truncated_messages == 50


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=200), max_size=20))
def test_parser_never_raises_on_arbitrary_text(lines: list[str]) -> None:
    stats = ParseStats()
    list(parse_lines(lines, stats=stats))
    assert stats.lines == len(lines)


@settings(max_examples=200, deadline=None)
@given(
    xid=st.integers(0, 10_000),
    bus=st.integers(0, 255),
    pid=st.one_of(st.none(), st.integers(0, 10**8)),
    message=st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=60),
)
def test_generated_xid_lines_round_trip(xid: int, bus: int, pid: int | None, message: str) -> None:
    who = "pid='<unknown>', name=<unknown>" if pid is None else f"pid={pid}, name=proc"
    line = f"[ 12.5] NVRM: Xid (PCI:0000:{bus:02x}:00): {xid}, {who}, {message}"
    record = parse(line)
    assert (record.xid, record.pci_bus_id, record.pid, record.message) == (
        xid,
        f"0000:{bus:02x}:00",
        pid,
        message.strip(),
    )


# -- deduplication -------------------------------------------------------------------------

T0 = datetime(2026, 1, 5, tzinfo=UTC)


def rec(
    seconds: float, *, xid: int = 13, pci: str = "0000:3b:00", host: str | None = "n1", uuid: str | None = None
) -> XidRecord:
    ts = T0 + timedelta(seconds=seconds)
    return XidRecord(ts, host, pci, xid, None, None, "m", uuid, int(seconds), "bare")


def test_flood_of_identical_lines_is_one_incident() -> None:
    n = 20_000
    records = (rec(i * 0.01) for i in range(n))  # 200 s of lines, window 5 min
    (incident,) = deduplicate(records, timedelta(minutes=5))
    assert incident.repeat_count == n
    assert incident.ts == T0
    assert incident.last_ts == T0 + timedelta(seconds=(n - 1) * 0.01)


def test_flood_of_real_lines_is_one_incident() -> None:
    lines = [row(10)] * 100_000
    (incident,) = deduplicate(parse_lines(lines), timedelta(minutes=1))
    assert (incident.xid, incident.pci_bus_id, incident.repeat_count) == (13, "0000:cb:00", 100_000)


def test_window_is_anchored_on_the_incidents_first_line() -> None:
    records = [rec(0), rec(240), rec(300), rec(301), rec(500), rec(700)]
    incidents = list(deduplicate(records, timedelta(minutes=5)))
    assert [(i.ts, i.repeat_count) for i in incidents] == [
        (T0, 3),  # 0, 240, 300 (exactly the window: still in)
        (T0 + timedelta(seconds=301), 2),  # 301 starts a new one; 500 is within 5 min of it
        (T0 + timedelta(seconds=700), 1),  # 700 is 200 s after 500 but 399 s after 301: not sliding
    ]
    assert incidents[1].last_ts == T0 + timedelta(seconds=500)


def test_different_gpus_xids_and_nodes_are_not_merged() -> None:
    records = [rec(0), rec(1, pci="0000:4c:00"), rec(2, xid=31), rec(3, host="n2"), rec(4)]
    incidents = sorted(deduplicate(records, timedelta(minutes=5)), key=lambda i: i.ts)  # type: ignore[arg-type, return-value]
    assert [(i.node, i.pci_bus_id, i.xid, i.repeat_count) for i in incidents] == [
        ("n1", "0000:3b:00", 13, 2),
        ("n1", "0000:4c:00", 13, 1),
        ("n1", "0000:3b:00", 31, 1),
        ("n2", "0000:3b:00", 13, 1),
    ]


def test_records_without_host_take_the_default_node() -> None:
    (incident,) = deduplicate([rec(0, host=None), rec(1, host=None)], timedelta(minutes=5), node="gpu-node-007")
    assert (incident.node, incident.repeat_count) == ("gpu-node-007", 2)


def test_a_replaced_gpu_starts_a_new_incident_and_a_late_uuid_is_kept() -> None:
    records = [rec(0), rec(1, uuid="GPU-A"), rec(2, uuid="GPU-B"), rec(3)]
    incidents = list(deduplicate(records, timedelta(minutes=5)))
    assert [(i.gpu_uuid, i.repeat_count) for i in incidents] == [("GPU-A", 2), ("GPU-B", 2)]


def test_out_of_order_lines_extend_the_incident_backwards() -> None:
    (incident,) = deduplicate([rec(10), rec(5), rec(20)], timedelta(minutes=5))
    assert (incident.ts, incident.last_ts, incident.repeat_count) == (
        T0 + timedelta(seconds=5),
        T0 + timedelta(seconds=20),
        3,
    )


def test_untimed_records_fold_by_key() -> None:
    untimed = [XidRecord(None, None, "0000:3b:00", 13, None, None, "m", None, i, "bare") for i in range(3)]
    (incident,) = deduplicate(untimed, timedelta(minutes=5), node="n1")
    assert (incident.ts, incident.repeat_count) == (None, 3)


def test_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        list(deduplicate([], timedelta(seconds=-1)))


def test_dedup_streams_instead_of_holding_the_whole_log() -> None:
    # 5,000 distinct GPUs, one line each, a second apart, window 10 s: incidents must come out
    # while the stream is being read, not all at its end.
    consumed = 0

    def records() -> Iterator[XidRecord]:
        nonlocal consumed
        for i in range(5_000):
            consumed += 1
            yield rec(i, host=f"node-{i}")

    first_out_at = None
    total = 0
    for _ in deduplicate(records(), timedelta(seconds=10)):
        total += 1
        if first_out_at is None:
            first_out_at = consumed
    assert total == 5_000
    assert first_out_at is not None and first_out_at <= 2_100


def test_real_iso_log_burst_folds_per_xid() -> None:
    lines = (FIXTURES / "gpud_dmesg.decode.iso.log").read_text().splitlines()
    incidents = sorted(deduplicate(parse_lines(lines), timedelta(minutes=5)), key=lambda i: i.xid)
    assert [(i.xid, i.repeat_count, i.pci_bus_id) for i in incidents] == [(13, 16, "0000:38:00"), (43, 1, "0000:38:00")]
    assert incidents[0].ts == datetime(2025, 1, 21, 4, 41, 44, 283302, tzinfo=UTC)
    assert incidents[0].last_ts == datetime(2025, 1, 21, 4, 41, 44, 285147, tzinfo=UTC)
    assert incidents[1].pid == 2924364 and incidents[1].process == "pt_main_thread"


def test_real_gsp_timeout_log_gets_the_banner_uuid_and_splits_at_the_window() -> None:
    lines = (FIXTURES / "gpud_dmesg-with-xid-119.log").read_text().splitlines()
    stats = ParseStats()
    records = list(parse_lines(lines, stats=stats))
    assert [r.xid for r in records] == [119] * 5
    assert {r.gpu_uuid for r in records} == {"GPU-509665ad-b600-ac93-3616-d754b23d636d"}
    assert stats.rejected == 0
    incidents = list(deduplicate(records, timedelta(minutes=5)))
    # 16:24:18, :24, :30 and 16:27:12 fold; 16:30:13 is 5 min 55 s after the first line
    assert [i.repeat_count for i in incidents] == [4, 1]
    assert incidents[1].ts == datetime(2025, 2, 23, 16, 30, 13, tzinfo=UTC)
