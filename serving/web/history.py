"""The fleet's recent past for the operator's pages: risk over time, alarms and failures per day.

`risk_history` is the one place the pages take past risks from (today the predictions
snapshots that `gpufail score` and the nightly job append; a calibrated risk will replace it
here). Everything else in this module is a function of its output:

- an **alarm** is a GPU, or a node, entering the alarm level: its risk reaches the enter
  threshold of the weakest configured tier at or above `ALARM_TIER`, where at its previous
  snapshot it was below (or it had none). The policy's hysteresis, cooldown and breaker are
  not applied: this counts what the risk said, not what was published (the actions page
  shows that);
- a **failure** is a GPU with a failure XID ([labels] failure_xids) in `xid_events` that day,
  counted once per GPU and day, as `gpufail_failed_gpus_24h` counts them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

import polars as pl
import pyarrow.compute as pc
import pyarrow.dataset as ds

from serving.policy import TIERS, PolicyConfig, tier_rank

ALARM_TIER = "avoid"
"""An alarm is entering this tier or a stronger one."""
PREDICTIONS = "predictions"
RISK_COLUMNS = ("ts", "cluster", "node", "gpu_index", "gpu_uuid", "risk", "node_risk", "model_version")


def alarm_threshold(tiers: PolicyConfig) -> tuple[str, float] | None:
    """(tier, enter threshold) of the weakest configured tier at or above `ALARM_TIER`; None
    when every such tier is switched off."""
    for t in tiers.tiers:  # weakest first
        if tier_rank(t.name) >= TIERS.index(ALARM_TIER):
            return t.name, t.enter
    return None


def _day_start(day: date) -> datetime:
    return datetime.combine(day, time.min, tzinfo=UTC)


TS_TYPE = pl.Datetime("us", "UTC")
RISK_SCHEMA: dict[str, Any] = {
    "ts": TS_TYPE,
    "cluster": pl.String,
    "node": pl.String,
    "gpu_index": pl.Int32,
    "gpu_uuid": pl.String,
    "risk": pl.Float64,
    "node_risk": pl.Float64,
    "model_version": pl.String,
}


def risk_history(
    store: Any, start: datetime, end: datetime, *, cluster: str | None = None, node: str | None = None
) -> pl.DataFrame:
    """Every GPU's risk at each snapshot with start <= ts < end (optionally one node's GPUs):
    `RISK_COLUMNS`, sorted by ts. A grid time scored by several models counts once, with the
    model whose version sorts last (within a kind, the one trained latest: versions are
    `kind-<train end>-<digest>`)."""
    files = store.files(PREDICTIONS, start.date(), (end - timedelta(microseconds=1)).date())
    if not files:
        return pl.DataFrame(schema=RISK_SCHEMA)
    where = (pl.col("ts") >= pl.lit(start, dtype=TS_TYPE)) & (pl.col("ts") < pl.lit(end, dtype=TS_TYPE))
    if node is not None:
        where &= pl.col("node") == node
    if cluster is not None:
        where &= pl.col("cluster") == cluster
    if store.is_local:
        # polars reads these files ~10x faster than pyarrow's dataset reader; files written
        # before predictions gained top_features lack that column, which is not read.
        scan = pl.scan_parquet(files, hive_partitioning=False, extra_columns="ignore")
    else:
        scan = pl.scan_pyarrow_dataset(ds.dataset(files, format="parquet", filesystem=store.fs))
    frame = scan.select(RISK_COLUMNS).filter(where).collect().cast(RISK_SCHEMA)  # type: ignore[arg-type]
    runs = frame.select("ts", "model_version").unique()
    chosen = runs.group_by("ts").agg(pl.col("model_version").max())
    if chosen.height < runs.height:
        frame = frame.join(chosen, on=["ts", "model_version"], how="semi")
    return frame.sort("ts", maintain_order=True)


def _entries(frame: pl.DataFrame, key: Sequence[str], risk: str, threshold: float) -> pl.DataFrame:
    """Rows where `risk` reaches `threshold` and the same key's previous row was below it."""
    above = pl.col(risk) >= threshold
    # `over` keeps each key's rows in frame order: by time, as `risk_history` returns them.
    previous = above.shift(1).over(list(key))
    return frame.filter(above & previous.fill_null(False).not_()).select("ts", *key)


def alarms_per_day(history: pl.DataFrame, tiers: PolicyConfig, first_day: date) -> dict[str, dict[date, int]]:
    """{"gpu": {day: GPUs entering the alarm level}, "node": {day: nodes entering it}} for the
    days from `first_day` on, from `risk_history`'s rows (in time order). `history` should
    start a little before `first_day` (a GPU already above the threshold then is not counted
    again when the window opens)."""
    found = alarm_threshold(tiers)
    out: dict[str, dict[date, int]] = {"gpu": {}, "node": {}}
    if found is None or history.height == 0:
        return out
    threshold = found[1]
    nodes = history.unique(["cluster", "node", "ts"], maintain_order=True).select("ts", "cluster", "node", "node_risk")
    for name, frame, key, column in (
        ("gpu", history, ("gpu_uuid",), "risk"),
        ("node", nodes, ("cluster", "node"), "node_risk"),
    ):
        entered = _entries(frame, key, column, threshold).filter(pl.col("ts") >= _day_start(first_day))
        counts = entered.group_by(pl.col("ts").dt.date().alias("day")).len()
        out[name] = dict(zip(counts["day"].to_list(), counts["len"].to_list(), strict=True))
    return out


def failed_gpus_per_day(store: Any, failure_xids: Sequence[int], start: datetime, end: datetime) -> dict[date, int]:
    """Day -> GPUs with a failure XID that day (a GPU without a uuid counts by node and bus)."""
    if not failure_xids or not store.files("xid_events", start.date(), (end - timedelta(microseconds=1)).date()):
        return {}
    events = store.read(
        "xid_events",
        start=start,
        end=end,
        columns=["ts", "node", "pci_bus_id", "gpu_uuid"],
        filter=pc.field("xid").isin(list(failure_xids)),
    )
    frame = pl.from_arrow(events)
    assert isinstance(frame, pl.DataFrame)
    if frame.height == 0:
        return {}
    gpu = pl.coalesce(pl.col("gpu_uuid"), pl.concat_str(pl.col("node"), pl.lit("/"), pl.col("pci_bus_id")))
    counts = frame.select(pl.col("ts").dt.date().alias("day"), gpu.alias("gpu")).unique().group_by("day").len()
    return dict(zip(counts["day"].to_list(), counts["len"].to_list(), strict=True))


@dataclass(frozen=True)
class DailyCounts:
    days: list[date]
    gpu_alarms: list[int]
    node_alarms: list[int]
    failed_gpus: list[int]
    alarm_tier: str | None
    alarm_threshold: float | None
    snapshots: int
    """Prediction snapshots (grid times) in the window."""


def daily_counts(
    store: Any, tiers: PolicyConfig, failure_xids: Sequence[int], last_day: date, days: int
) -> DailyCounts:
    """Alarms (GPUs and nodes) and failed GPUs per day over the `days` days ending `last_day`."""
    first_day = last_day - timedelta(days=days - 1)
    end = _day_start(last_day + timedelta(days=1))
    # One day before the window: who was already above the threshold when it opens.
    history = risk_history(store, _day_start(first_day - timedelta(days=1)), end)
    alarms = alarms_per_day(history, tiers, first_day)
    failed = failed_gpus_per_day(store, failure_xids, _day_start(first_day), end)
    window = [first_day + timedelta(days=i) for i in range(days)]
    found = alarm_threshold(tiers)
    in_window = history.filter(pl.col("ts") >= _day_start(first_day))
    return DailyCounts(
        days=window,
        gpu_alarms=[alarms["gpu"].get(d, 0) for d in window],
        node_alarms=[alarms["node"].get(d, 0) for d in window],
        failed_gpus=[failed.get(d, 0) for d in window],
        alarm_tier=None if found is None else found[0],
        alarm_threshold=None if found is None else found[1],
        snapshots=in_window["ts"].n_unique() if in_window.height else 0,
    )


def last_data_day(store: Any, fallback: date) -> date:
    """The newest day with predictions or XID events, and at least `fallback` (the day of the
    served features): the history ends where the data ends, which for replayed or simulated
    data is not today."""
    days = [fallback]
    for dataset in (PREDICTIONS, "xid_events"):
        found = store.dates(dataset)
        if found:
            days.append(found[-1])
    return max(days)


class DailyCountsCache:
    """`daily_counts`, kept until its inputs change: the files of the predictions and
    xid_events datasets in the window (files are written once, so a new file is the only
    change), the tiers and the window. Listing the files is cheap; reading weeks of snapshots
    of a large fleet is not, so when the inputs change the previous counts are served (marked
    stale) while one background thread computes the new ones; only the very first call waits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[Any, ...] | None = None
        self._value: DailyCounts | None = None
        self._refresh: threading.Thread | None = None
        self._failed: tuple[Any, ...] | None = None
        """The inputs a background refresh failed on: not tried again until they change."""
        self.error = ""
        """Why the last background refresh failed ('' when it did not)."""

    def get(
        self, store: Any, tiers: PolicyConfig, failure_xids: Sequence[int], last_day: date, days: int
    ) -> tuple[DailyCounts, bool]:
        """(the counts, whether they are from before the latest change of the inputs)."""
        first = last_day - timedelta(days=days)
        key = (
            tuple(store.files(PREDICTIONS, first, last_day)),
            tuple(store.files("xid_events", first, last_day)),
            tiers,
            tuple(failure_xids),
            last_day,
            days,
        )
        with self._lock:
            if key == self._key and self._value is not None:
                return self._value, False
            if self._value is not None:
                idle = self._refresh is None or not self._refresh.is_alive()
                if idle and key != self._failed:
                    self._refresh = threading.Thread(
                        target=self._compute,
                        args=(key, store, tiers, failure_xids, last_day, days),
                        name="gpufail-web-history",
                        daemon=True,
                    )
                    self._refresh.start()
                return self._value, True
            value = daily_counts(store, tiers, failure_xids, last_day, days)
            self._key, self._value, self.error = key, value, ""
            return value, False

    def _compute(self, key: tuple[Any, ...], *args: Any) -> None:
        try:
            value = daily_counts(*args)
        except Exception as exc:  # the stale counts keep being served; the page says why
            with self._lock:
                self._failed, self.error = key, f"{type(exc).__name__}: {exc}"
            return
        with self._lock:
            self._key, self._value, self.error = key, value, ""

    def join(self, timeout: float | None = None) -> None:
        """Wait for a background refresh (tests, and a clean shutdown)."""
        refresh = self._refresh
        if refresh is not None:
            refresh.join(timeout)
