"""The one interface every live collector implements, and the record of each collector run.

A collector reads one source (NVML, the kernel log, a dcgm-exporter endpoint) once per call of
`collect()` and returns what it saw as Arrow tables keyed by the store dataset they belong to
("telemetry", "xid_events"). The daemon buffers those tables and flushes them to the store.

Rules:
- "nothing to report" is an empty mapping or empty tables, never an error;
- a vendor error (pynvml.NVMLError, an HTTP failure, an unreadable /dev/kmsg) is turned into
  one `CollectorError` at the collector boundary, with a message that says what failed and
  where; the daemon records it in `collector_runs` and moves on to the next collector;
- a lost GPU is data (an event row), not an error: the other GPUs keep being collected;
- time comes from a `Clock` so tests never sleep.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from ingest.errors import GpufailError

Collected = Mapping[str, pa.Table]
"""Dataset name ("telemetry", "xid_events") -> rows with exactly that dataset's schema."""


class CollectorError(GpufailError):
    """A collector could not read its source this time (library missing, driver not loaded,
    endpoint down, permission denied). The message names the collector and the source."""


@runtime_checkable
class Collector(Protocol):
    name: str
    """Registry name, e.g. "nvml"; also the `collector` column of `collector_runs`."""

    def collect(self) -> Collected:
        """Read the source once; return new rows per dataset. Raise only `CollectorError`."""
        ...

    def close(self) -> None:
        """Release handles (nvmlShutdown, file handles). Called once when the daemon stops."""
        ...


@runtime_checkable
class Resumable(Collector, Protocol):
    """A collector that reads a source it can read again from a position (the kernel log): the
    daemon commits `state()` together with the rows it covers and hands the last committed state
    back through `restore()` when it starts, so a restart neither loses nor repeats a line."""

    def state(self) -> dict[str, Any]:
        """JSON-able position (cursor, incidents still open) just after everything `collect` and
        `drain` have returned so far."""
        ...

    def restore(self, state: dict[str, Any] | None) -> None:
        """Resume from a committed `state()`; None when the daemon has committed none."""
        ...

    @property
    def backlog(self) -> bool:
        """True when the last `collect()` stopped before the end of what the source holds and
        the daemon may call it again in this interval (after flushing what it returned)."""
        ...


@runtime_checkable
class Draining(Protocol):
    def drain(self) -> Collected:
        """Hand over what is held back (open incidents) because the daemon is stopping."""
        ...


@runtime_checkable
class Counting(Protocol):
    def counts(self) -> Mapping[str, Mapping[str, int]]:
        """Cumulative counts since the collector was made, for the daemon's metrics, by kind
        and label value: `{"log_lines": {"parsed": n, "rejected": m}}`,
        `{"nvml_errors": {"nvmlDeviceGetTemperature": n}}`."""
        ...


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time, timezone-aware UTC."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin that never go backwards (durations, deadlines)."""
        ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock: wall time for timestamps, the monotonic clock for durations."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


@dataclass(frozen=True)
class CollectorRun:
    """One call of one collector's `collect()`: what the daemon writes to `collector_runs`."""

    ts: datetime
    cluster: str
    node: str
    collector: str
    ok: bool
    duration_s: float
    rows: int
    error: str | None = None
