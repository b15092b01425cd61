"""The live kernel-log collector: floods folded across intervals and pieces, cursor and open
incidents handed over through state()/restore(), a backlog read in pieces of read_lines."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ingest.collect.base import Collector, CollectorError
from ingest.collect.kernel_log_collector import KernelLogCollector
from ingest.collect.log_sources import Cursor, LogChunk
from ingest.store import Store
from tests.fakes import FakeClock

T0 = datetime(2026, 4, 26, 23, 0, tzinfo=UTC)
WINDOW = timedelta(minutes=5)


class FakeLog:
    """A log of lines; the cursor is the index of the next line."""

    name = "fake"

    def __init__(self, lines: list[str] | None = None) -> None:
        self.lines = list(lines or [])
        self.reads: list[Cursor | None] = []

    def read(self, cursor: Cursor | None, max_lines: int) -> LogChunk:
        self.reads.append(cursor)
        start = cursor["next"] if cursor else 0
        lines = self.lines[start : start + max_lines]
        end = start + len(lines)
        return LogChunk(lines, {"next": end}, exhausted=end >= len(self.lines))

    def close(self) -> None:
        pass


def xid(at: datetime, code: int = 94, bus: str = "0000:9b:00", node: str = "gpu-node-017") -> str:
    return f"{at.isoformat()} {node} kernel: NVRM: Xid (PCI:{bus}): {code}, pid=1234, name=python3, Contained ECC error"


def collector(
    store: Store, log: FakeLog, clock: FakeClock, max_lines: int = 1000, read_lines: int | None = None
) -> KernelLogCollector:
    return KernelLogCollector(
        store,
        log,
        cluster="c1",
        node="gpu-node-017",
        dedup_window=WINDOW,
        clock=clock,
        max_lines=max_lines,
        read_lines=read_lines,
    )


def rows(collected) -> list[dict]:
    return collected["xid_events"].to_pylist()


def test_it_is_a_collector():
    assert isinstance(collector(Store.create("memory://kl-proto"), FakeLog(), FakeClock(T0)), Collector)


def test_a_flood_spanning_several_intervals_is_one_incident_emitted_when_its_window_has_passed(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    log, clock = FakeLog(), FakeClock(T0)
    c = collector(store, log, clock)
    emitted = []
    for _ in range(8):  # 8 intervals of 30 s, 100 identical lines each
        log.lines += [xid(clock.now() - timedelta(seconds=1) + timedelta(milliseconds=i)) for i in range(100)]
        emitted += rows(c.collect())
        clock.advance(30)
    assert emitted == []  # still within the 5-minute window of the first line
    clock.advance(120)
    emitted += rows(c.collect())
    assert len(emitted) == 1
    row = emitted[0]
    assert (row["xid"], row["pci_bus_id"], row["repeat_count"]) == (94, "0000:9b:00", 800)
    assert row["source"] == "collect:fake" and row["cluster"] == "c1" and row["node"] == "gpu-node-017"
    assert row["last_ts"] > row["ts"]


def test_different_gpus_and_xids_are_different_incidents_and_drain_emits_the_open_ones(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    clock = FakeClock(T0)
    log = FakeLog([xid(T0), xid(T0, code=63), xid(T0, bus="0000:1b:00"), "an unrelated line"])
    c = collector(store, log, clock)
    assert rows(c.collect()) == []
    drained = rows(c.drain())
    assert sorted((r["pci_bus_id"], r["xid"]) for r in drained) == [
        ("0000:1b:00", 94),
        ("0000:9b:00", 63),
        ("0000:9b:00", 94),
    ]
    assert rows(c.drain()) == []


def test_old_lines_are_emitted_at_once_and_untimed_ones_are_counted_not_written(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    old = T0 - timedelta(days=2)
    log = FakeLog(
        [
            xid(old),
            xid(old + timedelta(minutes=10)),
            "6,5,1000,-;NVRM: Xid (PCI:0000:9b:00): 79, GPU has fallen off the bus.",
        ]
    )
    c = collector(store, log, FakeClock(T0))
    out = rows(c.collect())
    assert [r["ts"] for r in out] == [old, old + timedelta(minutes=10)]  # 10 min apart: two incidents
    assert c.untimed_records == 1  # a kmsg record without a boot time


def test_a_restart_resumes_from_the_committed_state_with_the_open_incident(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    clock = FakeClock(T0)
    log = FakeLog([xid(T0 + timedelta(seconds=i)) for i in range(50)] + [xid(T0 - timedelta(days=1), code=48)])
    first = collector(store, log, clock)
    written = first.collect()
    assert [r["xid"] for r in rows(written)] == [48]
    state = first.state()
    first.close()
    assert state["cursor"] == {"next": 51} and len(state["open"]) == 1

    log.lines += [xid(T0 + timedelta(seconds=100 + i)) for i in range(25)]
    second = collector(store, log, clock)
    second.restore(state)
    assert second.state() == state  # nothing read yet: the committed state stands
    assert rows(second.collect()) == []
    assert log.reads[-1] == {"next": 51}  # never re-read the first 51 lines
    clock.advance(600)
    out = rows(second.collect())
    assert [(r["xid"], r["repeat_count"]) for r in out] == [(94, 75)]  # one incident across the restart


def test_without_a_committed_state_it_resumes_from_an_earlier_gpufails_state_file(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    log = FakeLog([xid(T0 - timedelta(days=1) + timedelta(minutes=10 * i)) for i in range(4)])
    store.write_state("collect_kernel_log-gpu-node-017", {"version": 1, "source": "fake", "cursor": {"next": 3}})
    c = collector(store, log, FakeClock(T0))
    c.restore(None)
    assert len(rows(c.collect())) == 1 and log.reads == [{"next": 3}]


def test_a_corrupt_committed_open_incident_is_one_collector_error(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    c = collector(store, FakeLog([]), FakeClock(T0))
    c.restore({"version": 1, "source": "fake", "cursor": {"next": 0}, "open": [{"ts": "yesterday"}]})
    with pytest.raises(CollectorError, match="unreadable open incident"):
        c.collect()


def test_a_backlog_larger_than_max_lines_is_read_over_several_calls(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    old = T0 - timedelta(days=1)
    log = FakeLog([xid(old + timedelta(minutes=10 * i)) for i in range(25)])
    c = collector(store, log, FakeClock(T0), max_lines=10)
    counts = [len(rows(c.collect())) for _ in range(3)]
    counts.append(len(rows(c.drain())))
    assert sum(counts) == 25 and counts[0] <= 10


def flood_log() -> list[str]:
    """Floods on 3 GPUs, lines every 40 s for an hour (several dedup windows each), some
    distinct XIDs between them and lines the parser rejects."""
    start = T0 - timedelta(days=1)
    lines = []
    for i in range(90):
        at = start + timedelta(seconds=40 * i)
        lines += [xid(at, bus=f"0000:{0x18 + g:02x}:00") for g in range(3)]
        if i % 7 == 0:
            lines.append(xid(at, code=48 + i % 3))
        if i % 11 == 0:
            lines.append(f"{at.isoformat()} gpu-node-017 kernel: NVRM: Xid (PCI:0000:18:00): not-a-number")
    return lines


def read_backlog(store: Store, read_lines: int, state: dict | None = None, stop_after: int | None = None):
    """Rows of reading flood_log() in pieces (then draining), optionally from a committed state
    and stopping after `stop_after` pieces; returns (rows, the collector)."""
    c = collector(store, FakeLog(flood_log()), FakeClock(T0), max_lines=10_000, read_lines=read_lines)
    c.restore(state)
    out = rows(c.collect())
    pieces = 1
    while c.backlog and (stop_after is None or pieces < stop_after):
        out += rows(c.collect())
        pieces += 1
    if stop_after is None:
        out += rows(c.drain())
    return out, c


def summary(out: list[dict]) -> list[tuple]:
    return sorted((r["ts"], r["last_ts"], r["pci_bus_id"], r["xid"], r["repeat_count"]) for r in out)


@pytest.mark.parametrize("piece", [1, 7, 64])
def test_a_backlog_read_in_pieces_counts_every_line_once_and_keeps_floods_folded(tmp_path, piece):
    store = Store.create(str(tmp_path / "data"))
    whole, one = read_backlog(store, 10_000)
    pieces, many = read_backlog(store, piece)

    def lines_per_key(out):
        counts: dict[tuple, int] = {}
        for r in out:
            counts[(r["pci_bus_id"], r["xid"])] = counts.get((r["pci_bus_id"], r["xid"]), 0) + r["repeat_count"]
        return counts

    assert lines_per_key(pieces) == lines_per_key(whole)
    assert sum(r["repeat_count"] for r in whole) == 90 * 3 + 13  # every timed XID line counted once
    # An hour of flood per GPU: one incident per window or two, never one per line or piece.
    floods = [r for r in pieces if r["xid"] == 94]
    assert 3 * 6 <= len(floods) <= 3 * 12
    assert all(r["last_ts"] - r["ts"] <= 2 * WINDOW for r in floods)
    assert (
        many.counts()
        == one.counts()
        == {
            "log_lines": {"parsed": len(flood_log()) - 9, "rejected": 9},
            "long_lines": {"fake": 0},
            "left_out": {"implausible_time": 0},
        }
    )


@pytest.mark.parametrize("stop_after", [1, 5, 17, 40])
def test_resuming_from_a_state_taken_between_pieces_gives_the_rows_of_an_uninterrupted_read(tmp_path, stop_after):
    store = Store.create(str(tmp_path / "data"))
    uninterrupted, _ = read_backlog(store, 7)
    before, first = read_backlog(store, 7, stop_after=stop_after)
    after, _ = read_backlog(store, 7, state=first.state())
    assert summary(before + after) == summary(uninterrupted)


def test_max_lines_bounds_one_interval_in_whole_pieces(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    log = FakeLog(flood_log())
    c = collector(store, log, FakeClock(T0), max_lines=100, read_lines=30)
    c.collect()
    calls = 1
    while c.backlog:
        c.collect()
        calls += 1
    assert calls == 4 and [r["next"] for r in log.reads[1:]] == [30, 60, 90]  # 120 lines: pieces stay whole
    c.collect()  # the next interval goes on from there
    assert log.reads[-1] == {"next": 120} and c.backlog
