"""Live kernel-log sources: /dev/kmsg records, journalctl JSON with its cursor, followed files."""

from __future__ import annotations

import os
import stat
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ingest.collect.base import CollectorError
from ingest.collect.log_sources import FileSource, JournalSource, KmsgSource
from ingest.kernel_log_parser import parse_lines

FIXTURES = Path(__file__).parents[1] / "fixtures" / "collect"
BOOT = datetime(2026, 4, 26, 22, 12, tzinfo=UTC)


def kmsg_fixture_records() -> list[bytes]:
    """The fixture's records as /dev/kmsg's read(2) returns them: one record, its dictionary
    lines included, per read."""
    records: list[str] = []
    for line in (FIXTURES / "kmsg_records.txt").read_text().splitlines():
        if line.startswith(" ") and records:
            records[-1] += "\n" + line
        else:
            records.append(line)
    return [(r + "\n").encode() for r in records]


class FakeKmsg:
    """/dev/kmsg: a list of records; BrokenPipeError where `overrun_before` says; then EAGAIN."""

    def __init__(self, records: list[bytes], overrun_before: int | None = None) -> None:
        self.records = list(records)
        self.overrun_before = overrun_before
        self.closed = False

    def read(self, size: int) -> bytes:
        if not self.records:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        if self.overrun_before is not None and self.records[0].startswith(f"3,{self.overrun_before},".encode()):
            self.overrun_before = None
            raise BrokenPipeError(32, "Broken pipe")
        return self.records.pop(0)

    def close(self) -> None:
        self.closed = True


def kmsg_source(device: FakeKmsg, boot_id: str = "boot-a") -> KmsgSource:
    return KmsgSource("/dev/kmsg", boot_id=lambda: boot_id, boot_time=lambda: BOOT, open_device=lambda path: device)


# -- kmsg --------------------------------------------------------------------------------


def test_kmsg_reads_records_until_eagain_and_counts_overwritten_ones_from_the_sequence_gap():
    device = FakeKmsg(kmsg_fixture_records(), overrun_before=1209)
    chunk = kmsg_source(device).read(None, 1000)
    assert len(chunk.lines) == 9
    assert chunk.lines[0] == "6,1200,3600000000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  570.158.01"
    assert not any(line.startswith(" ") for line in chunk.lines)  # dictionary lines dropped
    assert chunk.lost == 3  # seq 1206, 1207, 1208
    assert chunk.cursor == {"boot_id": "boot-a", "seq": 1211}
    assert chunk.exhausted and chunk.boot_time == BOOT
    records = list(parse_lines(chunk.lines, boot_time=chunk.boot_time))
    assert [(r.xid, r.pci_bus_id) for r in records] == [
        (119, "0001:6c:00"),
        (94, "0000:9b:00"),
        (94, "0000:9b:00"),
        (94, "0000:9b:00"),
        (79, "0000:b3:00"),
    ]
    assert records[0].ts == datetime(2026, 4, 26, 23, 12, 26, tzinfo=UTC)  # boot + 3626 s
    assert records[1].gpu_uuid == "GPU-aaaba90e-a327-1a65-9c8d-fd28b59b8057"


def test_kmsg_resumes_after_the_cursor_of_the_same_boot_and_ignores_one_of_another_boot():
    records = kmsg_fixture_records()
    chunk = kmsg_source(FakeKmsg(records)).read({"boot_id": "boot-a", "seq": 1204}, 1000)
    assert [line.split(",")[1] for line in chunk.lines] == ["1205", "1209", "1210", "1211"]
    assert chunk.lost == 3
    other_boot = kmsg_source(FakeKmsg(records), boot_id="boot-b").read({"boot_id": "boot-a", "seq": 1204}, 1000)
    assert len(other_boot.lines) == 9


def test_kmsg_stops_at_max_lines_and_continues_from_there():
    source = kmsg_source(FakeKmsg(kmsg_fixture_records()))
    first = source.read(None, 4)
    assert len(first.lines) == 4 and not first.exhausted
    second = source.read(first.cursor, 1000)
    assert len(second.lines) == 5 and second.exhausted
    assert second.cursor["seq"] == 1211


def test_kmsg_nothing_new_keeps_the_cursor():
    chunk = kmsg_source(FakeKmsg([])).read({"boot_id": "boot-a", "seq": 7}, 10)
    assert chunk.lines == [] and chunk.cursor == {"boot_id": "boot-a", "seq": 7}


def test_kmsg_unreadable_device_is_a_collector_error_naming_it(tmp_path):
    missing = tmp_path / "no-kmsg"
    with pytest.raises(CollectorError, match=r"cannot open .*no-kmsg .*readable"):
        KmsgSource(str(missing)).read(None, 10)


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg not readable here")
def test_the_real_dev_kmsg_reads_without_blocking_and_resumes_after_its_cursor():
    source = KmsgSource()
    try:
        first = source.read(None, 100_000)
        assert first.exhausted  # EAGAIN ended the read: it did not block
        assert first.cursor["seq"] >= 0
        again = KmsgSource()
        try:
            later = again.read(first.cursor, 100_000)
        finally:
            again.close()
        assert all(int(line.split(",")[1]) > first.cursor["seq"] for line in later.lines)
    finally:
        source.close()


# -- journal ---------------------------------------------------------------------------


FAKE_JOURNALCTL = """\
import sys
args = sys.argv[1:]
assert "_TRANSPORT=kernel" in args and "--output=json" in args, args
after = next((a.split("=", 1)[1] for a in args if a.startswith("--after-cursor=")), None)
if after == "bogus":
    print("Failed to seek to cursor: Invalid argument", file=sys.stderr)
    sys.exit(1)
lines = open(sys.argv[0] + ".data").read().splitlines()
started = after is None
for line in lines:
    if started:
        print(line)
    elif ('"__CURSOR":"' + after + '"') in line:
        started = True
"""


@pytest.fixture
def journalctl(tmp_path):
    exe = tmp_path / "journalctl"
    exe.write_text(f"#!{sys.executable}\n" + FAKE_JOURNALCTL)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "journalctl.data").write_text((FIXTURES / "journal_kernel.json").read_text())
    return str(exe)


def test_journal_entries_become_timed_lines_and_the_cursor_resumes_after_the_last(journalctl):
    source = JournalSource(executable=journalctl)
    chunk = source.read(None, 1000)
    assert len(chunk.lines) == 14
    assert chunk.lines[2].startswith("2026-04-26T23:12:26+00:00 NVRM: Xid (PCI:0001:6c:00): 119,")
    assert "\ufffd" in chunk.lines[-1]  # the byte-array MESSAGE, decoded
    records = list(parse_lines(chunk.lines))
    assert sorted({r.xid for r in records}) == [63, 79, 94, 119]
    assert all(r.ts is not None for r in records)
    assert chunk.cursor["cursor"].startswith("s=5d6b1e0c")
    assert source.read(chunk.cursor, 1000).lines == []
    head = source.read(None, 3)
    assert len(head.lines) == 3 and not head.exhausted
    rest = source.read(head.cursor, 1000)
    assert [*head.lines, *rest.lines] == chunk.lines


def test_journal_failures_are_collector_errors(journalctl, tmp_path):
    with pytest.raises(CollectorError, match="not found"):
        JournalSource(executable=str(tmp_path / "no-such-journalctl")).read(None, 10)
    with pytest.raises(CollectorError, match="Failed to seek to cursor.*delete the kernel-log entry of _state"):
        JournalSource(executable=journalctl).read({"cursor": "bogus"}, 10)
    Path(journalctl + ".data").write_text("-- No entries --\n")
    with pytest.raises(CollectorError, match="line 1: not a JSON object"):
        JournalSource(executable=journalctl).read(None, 10)


# -- files -----------------------------------------------------------------------------


def xid_line(n: int) -> str:
    return f"2026-04-26T23:{n // 60 % 60:02d}:{n % 60:02d}.000000+00:00 gpu-node-017 kernel: NVRM: Xid (PCI:0000:9b:00): 94, pid={n}, name=python3, Contained ECC error\n"


def test_a_file_being_appended_to_is_read_line_by_line_and_a_partial_line_waits(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(xid_line(1) + xid_line(2))
    source = FileSource([str(log)])
    first = source.read(None, 100)
    assert len(first.lines) == 2
    with log.open("a") as fh:
        fh.write(xid_line(3) + xid_line(4)[:30])  # a writer mid-line
    second = source.read(first.cursor, 100)
    assert second.lines == [xid_line(3).rstrip("\n")]
    with log.open("a") as fh:
        fh.write(xid_line(4)[30:])
    third = source.read(second.cursor, 100)
    assert third.lines == [xid_line(4).rstrip("\n")]
    assert source.read(third.cursor, 100).lines == []


def test_a_rotated_file_is_finished_before_the_new_one_is_read(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(xid_line(1))
    source = FileSource([str(log)])
    cursor = source.read(None, 100).cursor
    with log.open("a") as fh:
        fh.write(xid_line(2))  # written just before logrotate renames the file
    log.rename(tmp_path / "kern.log.1")
    log.write_text(xid_line(3))
    chunk = source.read(cursor, 100)
    assert chunk.lines == [xid_line(2).rstrip("\n"), xid_line(3).rstrip("\n")]
    assert source.read(chunk.cursor, 100).lines == []


def test_a_truncated_or_replaced_file_is_read_from_its_start(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(xid_line(1) + xid_line(2))
    source = FileSource([str(log)])
    cursor = source.read(None, 100).cursor
    log.write_text(xid_line(9))  # copytruncate: same inode, shorter
    assert source.read(cursor, 100).lines == [xid_line(9).rstrip("\n")]


def test_a_missing_file_is_nothing_to_report_and_max_lines_spans_files(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    b.write_text(xid_line(1) + xid_line(2) + xid_line(3))
    source = FileSource([str(a), str(b)])
    first = source.read(None, 2)
    assert len(first.lines) == 2 and not first.exhausted
    second = source.read(first.cursor, 2)
    assert second.lines == [xid_line(3).rstrip("\n")] and second.exhausted
