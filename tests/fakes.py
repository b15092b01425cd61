"""Fakes shared by several test modules and the benchmarks (one home each)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


class FakeClock:
    """The collectors' and the daemon's clock (`ingest.collect.base.Clock`), moved by hand: wall
    and monotonic time advance only when the code under test sleeps or a test calls `advance`,
    so hours of ticks run in no time and measure only the code's own work. `slept` adds up the
    seconds slept."""

    def __init__(self, now: datetime = datetime(2026, 1, 1, tzinfo=UTC)) -> None:
        self.t = now
        self.mono = 0.0
        self.slept = 0.0

    def now(self) -> datetime:
        return self.t

    def monotonic(self) -> float:
        return self.mono

    def sleep(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.slept += seconds
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self.t += timedelta(seconds=seconds)
        self.mono += seconds
