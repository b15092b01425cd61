"""The live kernel-log collector: floods folded across intervals, cursor and open incidents kept
across restarts, lines read again after a crash not counted twice."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa

from ingest.collect.base import Collector
from ingest.collect.kernel_log import KernelLogCollector
from ingest.collect.log_sources import Cursor, LogChunk
from ingest.store import Store

T0 = datetime(2026, 4, 26, 23, 0, tzinfo=UTC)
WINDOW = timedelta(minutes=5)


class FakeClock:
    def __init__(self, now: datetime = T0) -> None:
        self.t = now
        self.mono = 0.0

    def now(self) -> datetime:
        return self.t

    def monotonic(self) -> float:
        return self.mono

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self.t += timedelta(seconds=seconds)
        self.mono += seconds


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


def collector(store: Store, log: FakeLog, clock: FakeClock, max_lines: int = 1000) -> KernelLogCollector:
    return KernelLogCollector(
        store, log, cluster="c1", node="gpu-node-017", dedup_window=WINDOW, clock=clock, max_lines=max_lines
    )


def rows(collected) -> list[dict]:
    return collected["xid_events"].to_pylist()


def write_and_checkpoint(store: Store, c: KernelLogCollector, tables: list[pa.Table]) -> None:
    for table in tables:
        store.write("xid_events", table)
    c.checkpoint()


def test_it_is_a_collector():
    assert isinstance(collector(Store.create("memory://kl-proto"), FakeLog(), FakeClock()), Collector)


def test_a_flood_spanning_several_intervals_is_one_incident_emitted_when_its_window_has_passed(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    log, clock = FakeLog(), FakeClock()
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
    clock = FakeClock()
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
    c = collector(store, log, FakeClock())
    out = rows(c.collect())
    assert [r["ts"] for r in out] == [old, old + timedelta(minutes=10)]  # 10 min apart: two incidents
    assert c.untimed_records == 1  # a kmsg record without a boot time


def test_a_restart_resumes_after_the_checkpointed_cursor_with_the_open_incident(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    clock = FakeClock()
    log = FakeLog([xid(T0 + timedelta(seconds=i)) for i in range(50)] + [xid(T0 - timedelta(days=1), code=48)])
    first = collector(store, log, clock)
    written = first.collect()
    assert [r["xid"] for r in rows(written)] == [48]
    write_and_checkpoint(store, first, [written["xid_events"]])
    first.close()
    state = store.read_state("collect_kernel_log-gpu-node-017")
    assert state["cursor"] == {"next": 51} and len(state["open"]) == 1

    log.lines += [xid(T0 + timedelta(seconds=100 + i)) for i in range(25)]
    second = collector(store, log, clock)
    assert rows(second.collect()) == []
    assert log.reads[-1] == {"next": 51}  # never re-read the first 51 lines
    clock.advance(600)
    out = rows(second.collect())
    assert [(r["xid"], r["repeat_count"]) for r in out] == [(94, 75)]  # one incident across the restart
    store.write("xid_events", second.collect()["xid_events"])
    assert store.read("xid_events").num_rows == 1


def test_lines_read_again_after_a_kill_between_flush_and_checkpoint_are_not_counted_twice(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    clock = FakeClock()
    start = T0 - timedelta(minutes=1)
    log = FakeLog([xid(start + timedelta(seconds=i)) for i in range(40)])
    first = collector(store, log, clock)
    assert rows(first.collect()) == []
    first.checkpoint()  # state: cursor 40, one open incident of 40 lines

    clock.advance(600)
    log.lines += [xid(start + timedelta(seconds=60 + i)) for i in range(10)]
    flushed = first.collect()
    assert [(r["xid"], r["repeat_count"]) for r in rows(flushed)] == [(94, 50)]
    store.write("xid_events", flushed["xid_events"])
    # killed here: the row is in the store, the checkpoint still says cursor 40 + open incident

    log.lines += [xid(clock.now(), code=79)]
    restarted = collector(store, log, clock)
    assert rows(restarted.collect()) == []
    assert log.reads[-1] == {"next": 40}  # the 10 lines after the checkpoint are read again...
    assert [(r["xid"], r["repeat_count"]) for r in rows(restarted.drain())] == [(79, 1)]  # ...but not counted
    stored = store.read("xid_events").to_pylist()
    assert [(r["xid"], r["repeat_count"]) for r in stored] == [(94, 50)]


def test_a_backlog_larger_than_max_lines_is_read_over_several_calls(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    old = T0 - timedelta(days=1)
    log = FakeLog([xid(old + timedelta(minutes=10 * i)) for i in range(25)])
    c = collector(store, log, FakeClock(), max_lines=10)
    counts = [len(rows(c.collect())) for _ in range(3)]
    counts.append(len(rows(c.drain())))
    assert sum(counts) == 25 and counts[0] <= 10
