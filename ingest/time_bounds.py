"""The times a reading or a log line can plausibly have, for every input path.

A clock that was never set says 1970 or 2000; a log line can be dated 2099 by a garbled stamp;
a node's clock can run ahead. Data dated before `EARLIEST_PLAUSIBLE` or more than
`FUTURE_SLACK` after the wall clock of the importing machine is not stored: each importer
counts it in its summary. (Data ahead of the rest of the fleet but not of the wall clock, as
in a backfill, is bounded when the fleet's data end is read: `features.labels.fleet_data_end`.)
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

EARLIEST_PLAUSIBLE = datetime(2010, 1, 1, tzinfo=UTC)
FUTURE_SLACK = timedelta(days=1)
IMPLAUSIBLE = "rows with an implausible time (clock not set?)"
"""How the importers' summaries name what they left out for its time."""


def latest_plausible(now: datetime) -> datetime:
    """The latest time data read at `now` may have."""
    return now + FUTURE_SLACK


def plausible(ts: datetime, now: datetime) -> bool:
    return EARLIEST_PLAUSIBLE <= ts <= latest_plausible(now)
