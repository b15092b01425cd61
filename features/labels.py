"""Failure episodes and labels: which GPU failed when, and what each grid row should predict.

A *failure episode* is when a GPU stops being usable. Two sources, XIDs first:

1. Failure XIDs (`failure_episodes`): `xid_events` rows whose code is in the configured
   `failure_xids` (default `ingest.xid_catalog.default_failure_xids()`). Events of one GPU are
   chained into one episode while each starts within `merge_window` of the previous one's last
   line (`last_ts`); the episode starts at its first event.
2. Lost GPUs (`lost_gpu_episodes`): a GPU whose telemetry stops for good - no sample in the last
   `lost_after` before the data end - while another GPU of the same node keeps reporting for
   more than `lost_after` after it stopped. The episode starts just after (1 us) the GPU's last
   sample, which the GPU was alive to send. This
   catches GPUs that fall off the bus without an Xid line, and GPUs pulled for replacement.
   A whole node going silent is not counted: that is a node (or collector) outage, and a GPU
   that failed with it is found by its XID. A failure XID logged within `lost_after` after the
   last sample explains the silence, and its episode is used instead (a GPU often stops
   answering NVML minutes to hours before the driver logs the Xid; the rows of that silence are
   kept, labelled positive, as telemetry collapse is itself a precursor).

3. Repair records (`repair_episodes`, the `repairs` dataset: an operator replaced, reseated or
   reset a GPU): a repair of a GPU that was in service (no failure episode since its previous
   repair) is evidence of a failure the first two sources missed. That episode starts just after
   the GPU's last sample, or at the repair time if the GPU kept reporting until then.

4. Failure events (`event_episodes`, the `failure_events` dataset): failure records a fleet
   imported (tickets, source `record`) and failures its scheduler saw (`slurm`: NODE_FAIL job
   ends, nodes set DOWN; `kubernetes`: nodes NotReady). Each starts an episode at its time. An
   event that names no GPU (a scheduler sees nodes) stands for every GPU of the node that was
   reporting then (seen at or before it, and within `merge_window` before it): gpufail acts on
   nodes, and a node that failed is a node the next run should have drained. An event is the
   same failure as a failure-XID episode of its GPU - or, for a node-wide event, of any GPU of
   its node - that starts within `merge_window` of it: the XID episode stays (XIDs date a
   failure best, and a node failure explained by one GPU's XID does not blame its other GPUs),
   and the event is dropped. Events of one GPU within `merge_window` of each other are one.
   Failure events come before lost GPUs (an event within `lost_after` of the silence explains
   it, as an XID does) and repair records (a repair after a recorded failure closes it).
   An event with a known `end` (the node came back) returns its GPUs to service then
   (`service_returns`); one without waits for a repair record, as after a failure XID.

Labels (`attach_labels`):
- after a failure episode starts, the GPU is out of service until a repair record that returns
  it (action `reseat`, `reset`, anything but `replace`) at or after the start: rows in between
  are dropped. A replacement has a new uuid and starts fresh (the old uuid stays out for good,
  as does a GPU without a repair record);
- label(t) = 1 if the next episode start T after t is in (t, t + horizon], and
  `time_to_failure_h` = (T - t) in hours;
- otherwise label(t) = null when t + horizon > data_end (censored: we cannot know), else 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Literal

import polars as pl

from features.schema import TS_DTYPE
from features.spec import DEFAULT_HORIZON, DEFAULT_LOST_AFTER, DEFAULT_MERGE_WINDOW
from features.windows import ENGINE

GPU = "gpu_uuid"
HOUR_US = 3_600_000_000

EPISODE_SCHEMA = {
    GPU: pl.String(),
    "start": TS_DTYPE,
    "end": TS_DTYPE,
    "source": pl.String(),  # "xid" | "lost" | "repair" | a failure event's: "record", "slurm", "kubernetes"
    "xids": pl.List(pl.Int32()),
    "n_events": pl.Int32(),
}


def gpu_presence(
    telemetry: pl.DataFrame | pl.LazyFrame, *, engine: Literal["in-memory", "streaming"] = ENGINE
) -> pl.DataFrame:
    """Where and when each GPU reported: one row per (cluster, node, gpu_index, pci_bus_id,
    gpu_uuid) with `first_ts`, `last_ts` and `n_samples`. Small; the input of XID-to-GPU
    resolution and of lost-GPU detection. Presences of several time ranges combine with
    `combine_presence`."""
    lf = telemetry.lazy()
    names = lf.collect_schema().names()
    keys = ["cluster", "node", "gpu_index", "pci_bus_id", GPU]
    lf = lf.with_columns(pl.lit(None, dtype=pl.String).alias(k) for k in keys if k not in names)
    return (
        lf.group_by(keys)
        .agg(
            pl.col("ts").min().alias("first_ts"),
            pl.col("ts").max().alias("last_ts"),
            pl.len().cast(pl.Int64).alias("n_samples"),
        )
        .collect(engine=engine)
        .sort(GPU, "first_ts")
    )


def combine_presence(parts: Iterable[pl.DataFrame]) -> pl.DataFrame:
    """Merge presences computed over different time ranges (e.g. one per day partition)."""
    frames = [p for p in parts if p.height]
    if not frames:
        return gpu_presence(pl.DataFrame(schema={"ts": TS_DTYPE, GPU: pl.String()}))
    keys = ["cluster", "node", "gpu_index", "pci_bus_id", GPU]
    return (
        pl.concat(frames, how="vertical_relaxed")
        .group_by(keys)
        .agg(pl.col("first_ts").min(), pl.col("last_ts").max(), pl.col("n_samples").sum())
        .sort(GPU, "first_ts")
    )


def resolve_xid_gpus(xid_events: pl.DataFrame, presence: pl.DataFrame) -> pl.DataFrame:
    """Fill a missing `gpu_uuid` on XID events from telemetry: the GPU most recently seen first
    (at or before the event) in the same (cluster, node, pci_bus_id), else in the same
    (cluster, node, gpu_index). Kernel-log lines name the PCI bus, not the uuid, and a GPU that
    falls off the bus can no longer be asked for its uuid. Events that stay unresolved keep a
    null `gpu_uuid` (they cannot be attributed, so they make neither features nor labels)."""
    if xid_events.height == 0 or xid_events[GPU].null_count() == 0:
        return xid_events
    columns = xid_events.columns
    known = xid_events.filter(pl.col(GPU).is_not_null())
    todo = xid_events.filter(pl.col(GPU).is_null()).with_row_index("_row").sort("ts")
    resolved = []
    for key in ("pci_bus_id", "gpu_index"):
        if todo.height == 0:
            break
        slots = (
            presence.filter(pl.col(key).is_not_null())
            .group_by("cluster", "node", key, GPU)
            .agg(pl.col("first_ts").min())
            .select("cluster", "node", pl.col(key).cast(todo.schema[key]), pl.col(GPU).alias("_uuid"), "first_ts")
            .sort("first_ts")
        )
        hit = todo.filter(pl.col(key).is_not_null()).join_asof(
            slots,
            left_on="ts",
            right_on="first_ts",
            by=["cluster", "node", key],
            strategy="backward",
            check_sortedness=False,
        )
        hit = hit.filter(pl.col("_uuid").is_not_null())
        resolved.append(hit.with_columns(pl.col("_uuid").alias(GPU)).select(["_row", *columns]))
        todo = todo.join(hit.select("_row"), on="_row", how="anti").sort("ts")
    parts = [known, *(r.drop("_row") for r in resolved), todo.drop("_row")]
    return pl.concat([p.select(columns) for p in parts], how="vertical_relaxed").sort("ts")


def failure_episodes(
    xid_events: pl.DataFrame,
    failure_xids: Iterable[int],
    merge_window: timedelta = DEFAULT_MERGE_WINDOW,
) -> pl.DataFrame:
    """One row per failure episode (see the module notes): gpu_uuid, start, end, source="xid",
    xids (distinct codes, sorted), n_events. Non-failure XIDs never start an episode."""
    codes = sorted({int(x) for x in failure_xids})
    ev = (
        xid_events.lazy()
        .filter(pl.col("xid").is_in(codes) & pl.col(GPU).is_not_null())
        .select(GPU, "ts", pl.col("last_ts").fill_null(pl.col("ts")), pl.col("xid").cast(pl.Int32))
        .sort(GPU, "ts")
    )
    prev_end = pl.col("last_ts").cum_max().shift(1).over(GPU)
    return (
        ev.with_columns((prev_end.is_null() | ((pl.col("ts") - prev_end) > merge_window)).cum_sum().alias("_episode"))
        .group_by(GPU, "_episode")
        .agg(
            pl.col("ts").min().alias("start"),
            pl.col("last_ts").max().alias("end"),
            pl.lit("xid").alias("source"),
            pl.col("xid").unique().sort().alias("xids"),
            pl.len().cast(pl.Int32).alias("n_events"),
        )
        .select(list(EPISODE_SCHEMA))
        .sort(GPU, "start")
        .collect(engine=ENGINE)
        .cast(EPISODE_SCHEMA)  # type: ignore[arg-type]
    )


# A GPU's clock may run this far ahead of the bulk of the fleet before its samples count as
# ahead of the fleet's data end: collectors flush at different times, minutes apart.
CLOCK_TOLERANCE = timedelta(hours=2)
# The share of the fleet's GPUs whose last samples make its data end: a node whose clock ran a
# day ahead (8 GPUs of a 64-GPU fleet) is not the fleet, nor are GPUs that stopped reporting.
BULK_SHARE = 0.25
# The fleet is the GPUs that reported within this long before the newest sample: GPUs retired
# months ago do not hold the data end back after the fleet shrank.
FLEET_RECENCY = timedelta(days=7)


def fleet_data_end(presence: pl.DataFrame) -> datetime:
    """The end of the fleet's data, the fleet's "now": the newest last sample of a GPU that is
    no more than `CLOCK_TOLERANCE` ahead of the last samples of `BULK_SHARE` of the fleet (the
    GPUs seen within `FLEET_RECENCY` of the newest sample).

    The newest sample of all would let one GPU whose clock runs ahead (a node's clock, a bad
    import) move the fleet's end: the other GPUs would look silent (and lost), and the newest
    grid time scored would hold that GPU alone. A clock more than `FLEET_RECENCY` ahead is not
    told from a fleet that shrank to it; the importers refuse data a day past the wall clock
    (`ingest.time_bounds`). `presence` from `gpu_presence`, not empty."""
    last = presence.group_by(GPU).agg(pl.col("last_ts").max())["last_ts"].sort(descending=True)
    fleet = last.filter(last >= last[0] - FLEET_RECENCY)
    bulk = fleet[max(1, math.ceil(BULK_SHARE * fleet.len())) - 1]
    return last.filter(last <= bulk + CLOCK_TOLERANCE)[0]  # type: ignore[no-any-return]


def within_data(events: pl.DataFrame, data_end: datetime) -> pl.DataFrame:
    """`events` (with a `ts`) no later than `CLOCK_TOLERANCE` past the fleet's `data_end`."""
    return events.filter(pl.col("ts") <= pl.lit(data_end + CLOCK_TOLERANCE, dtype=TS_DTYPE))


def lost_gpu_episodes(
    presence: pl.DataFrame,
    data_end: datetime,
    lost_after: timedelta = DEFAULT_LOST_AFTER,
) -> pl.DataFrame:
    """GPUs that stopped reporting for good while their node kept reporting (module notes).
    `presence` from `gpu_presence`; `data_end` is the end of the observed data."""
    per_gpu = presence.group_by(GPU).agg(
        pl.col("last_ts").max(),
        pl.col("cluster").sort_by("last_ts").last(),
        pl.col("node").sort_by("last_ts").last(),
    )
    end = pl.lit(data_end, dtype=TS_DTYPE)
    # A GPU reporting past the data end has a clock ahead of the fleet's (`fleet_data_end`):
    # its samples there do not show its node alive after another GPU went silent.
    node_last = per_gpu.select(
        "cluster", "node", pl.col(GPU).alias("_other"), pl.min_horizontal("last_ts", end).alias("_other_last")
    )
    candidates = per_gpu.filter(pl.col("last_ts") < end - lost_after)
    alive_after = (
        candidates.join(node_last, on=["cluster", "node"], how="inner")
        .filter((pl.col("_other") != pl.col(GPU)) & (pl.col("_other_last") > pl.col("last_ts") + lost_after))
        .select(GPU)
        .unique()
    )
    return (
        candidates.join(alive_after, on=GPU, how="semi")
        .select(
            GPU,
            # It was alive at its last sample, so it failed just after it.
            (pl.col("last_ts") + timedelta(microseconds=1)).alias("start"),
            pl.col("last_ts").alias("end"),
            pl.lit("lost").alias("source"),
            pl.lit([], dtype=pl.List(pl.Int32)).alias("xids"),
            pl.lit(0, dtype=pl.Int32).alias("n_events"),
        )
        .sort(GPU, "start")
        .cast(EPISODE_SCHEMA)  # type: ignore[arg-type]
    )


def episodes_for(
    xid_events: pl.DataFrame,
    presence: pl.DataFrame,
    *,
    failure_xids: Iterable[int],
    merge_window: timedelta = DEFAULT_MERGE_WINDOW,
    data_end: datetime,
    lost_after: timedelta | None = DEFAULT_LOST_AFTER,
    repairs: pl.DataFrame | None = None,
    failure_events: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """All failure episodes: failure XIDs (events resolved to GPUs first), failure events
    (`failure_events`, the dataset of that name; module notes, source 4), lost GPUs
    (`lost_after=None` turns those off) and repairs of GPUs in service (`repairs`, the
    `repairs` dataset; none when omitted). Sorted by (gpu_uuid, start)."""
    known = failure_episodes(resolve_xid_gpus(xid_events, presence), failure_xids, merge_window)
    if failure_events is not None and failure_events.height:
        known = pl.concat([known, event_episodes(failure_events, known, presence, merge_window)])
    if lost_after is not None:
        known = pl.concat([known, _unexplained_lost(presence, known, data_end, lost_after)])
    known = known.sort(GPU, "start")
    if repairs is not None and repairs.height:
        known = pl.concat([known, repair_episodes(repairs, known, presence)]).sort(GPU, "start")
    return known


def _unexplained_lost(
    presence: pl.DataFrame, known: pl.DataFrame, data_end: datetime, lost_after: timedelta
) -> pl.DataFrame:
    lost = lost_gpu_episodes(presence, data_end, lost_after)
    # A failure XID (or failure event) within `lost_after` of the GPU's last sample explains the
    # silence and dates the failure: those sources come first.
    explained = lost.join(known.select(GPU, pl.col("start").alias("_known")), on=GPU, how="inner").filter(
        pl.col("_known") <= pl.col("start") + lost_after
    )
    return lost.join(explained.select(GPU).unique(), on=GPU, how="anti")


def _repair_times(repairs: pl.DataFrame | None, *, returns_only: bool = False) -> pl.DataFrame:
    """(gpu_uuid, repaired) sorted: when each GPU was repaired. With `returns_only`, only the
    repairs that return the same GPU to service: a replaced GPU leaves the slot for good."""
    if repairs is None or repairs.height == 0:
        return pl.DataFrame(schema={GPU: pl.String(), "repaired": TS_DTYPE})
    if returns_only and "action" in repairs.columns:
        repairs = repairs.filter(pl.col("action").is_null() | (pl.col("action") != "replace"))
    return (
        repairs.select(pl.col("old_gpu_uuid").alias(GPU), pl.col("ts").cast(TS_DTYPE).alias("repaired"))
        .drop_nulls()
        .sort("repaired")
    )


def repair_episodes(repairs: pl.DataFrame, episodes: pl.DataFrame, presence: pl.DataFrame) -> pl.DataFrame:
    """Failure episodes implied by repair records of GPUs that were in service when repaired
    (module notes, source 3). `episodes` are those already known (XIDs, lost GPUs); `presence`
    from `gpu_presence` dates the failure at the GPU's last sample."""
    fixes = _repair_times(repairs).with_columns(
        pl.col("repaired").shift(1).over(GPU, order_by="repaired").alias("_previous_repair")
    )
    known = episodes.select(GPU, pl.col("start").alias("_episode")).sort("_episode")
    last_seen = presence.group_by(GPU).agg(pl.col("last_ts").max().alias("_last_ts"))
    found = (
        fixes.join_asof(
            known, left_on="repaired", right_on="_episode", by=GPU, strategy="backward", check_sortedness=False
        )
        # Out of service already: the repair closes a known episode.
        .filter(
            pl.col("_episode").is_null()
            | (pl.col("_previous_repair").is_not_null() & (pl.col("_previous_repair") >= pl.col("_episode")))
        )
        .join(last_seen, on=GPU, how="left")
    )
    start = (
        pl.when(pl.col("_last_ts").is_not_null() & (pl.col("_last_ts") < pl.col("repaired")))
        .then(pl.col("_last_ts") + timedelta(microseconds=1))
        .otherwise(pl.col("repaired"))
    )
    return (
        found.select(
            GPU,
            start.alias("start"),
            pl.col("repaired").alias("end"),
            pl.lit("repair").alias("source"),
            pl.lit([], dtype=pl.List(pl.Int32)).alias("xids"),
            pl.lit(0, dtype=pl.Int32).alias("n_events"),
        )
        .cast(EPISODE_SCHEMA)  # type: ignore[arg-type]
        .sort(GPU, "start")
    )


def attach_labels(
    rows: pl.DataFrame,
    episodes: pl.DataFrame,
    *,
    horizon: timedelta = DEFAULT_HORIZON,
    data_end: datetime,
    repairs: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """Drop the rows where the GPU is out of service (from an episode start until a repair
    record returns it, `repairs` with `ts`, `old_gpu_uuid` and `action`) and add `label` (Int8,
    nullable) and `time_to_failure_h` (Float32) to `rows` (which need `gpu_uuid` and `ts`); see
    the module notes for the rules. Row order is kept."""
    facts = label_rows(rows.select(GPU, "ts"), episodes, horizon=horizon, data_end=data_end, repairs=repairs)
    rows = rows.with_columns(facts["label"], facts["time_to_failure_h"])
    keep = facts["in_service"]
    return rows if keep.all() else rows.filter(keep)


def label_rows(
    keys: pl.DataFrame,
    episodes: pl.DataFrame,
    *,
    horizon: timedelta = DEFAULT_HORIZON,
    data_end: datetime,
    repairs: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """For each (gpu_uuid, ts) row of `keys`, in its order: `in_service` (Boolean; false where
    the GPU is out of service, module notes), `label` and `time_to_failure_h`."""
    starts = episodes.select(GPU, pl.col("start").cast(TS_DTYPE)).unique().sort("start")
    fixes = _repair_times(repairs, returns_only=True)
    # The as-of joins run only for the GPUs that ever failed; the others are in service with no
    # failure ahead.
    keys = keys.select(GPU, "ts").with_row_index("_row")
    touched = keys.join(starts.select(GPU).unique(), on=GPU, how="semi").sort("ts")
    touched = touched.join_asof(
        starts.rename({"start": "_last_start"}),
        left_on="ts",
        right_on="_last_start",
        by=GPU,
        strategy="backward",
        check_sortedness=False,
    )
    touched = touched.join_asof(
        starts.rename({"start": "_next_start"}),
        left_on="ts",
        right_on="_next_start",
        by=GPU,
        strategy="forward",
        allow_exact_matches=False,
        check_sortedness=False,
    )
    touched = touched.join_asof(
        fixes.rename({"repaired": "_repaired"}),
        left_on="ts",
        right_on="_repaired",
        by=GPU,
        strategy="backward",
        check_sortedness=False,
    ).select("_row", "_last_start", "_next_start", "_repaired")
    keys = keys.join(touched, on="_row", how="left", maintain_order="left")
    out_of_service = pl.col("_last_start").is_not_null() & (
        pl.col("_repaired").is_null() | (pl.col("_repaired") < pl.col("_last_start"))
    )
    ttf_us = (pl.col("_next_start") - pl.col("ts")).dt.total_microseconds()
    horizon_us = int(horizon.total_seconds() * 1_000_000)
    within = pl.col("_next_start").is_not_null() & (ttf_us <= horizon_us)
    end = pl.lit(data_end, dtype=TS_DTYPE)
    return keys.select(
        (~out_of_service).alias("in_service"),
        pl.when(within)
        .then(pl.lit(1, dtype=pl.Int8))
        .when(pl.col("ts") + horizon > end)
        .then(pl.lit(None, dtype=pl.Int8))
        .otherwise(pl.lit(0, dtype=pl.Int8))
        .alias("label"),
        pl.when(within).then(ttf_us / HOUR_US).cast(pl.Float32).alias("time_to_failure_h"),
    )


EVENT_SOURCES = ("record", "slurm", "kubernetes")
"""Episode sources that come from the `failure_events` dataset."""


def _event_gpus(events: pl.DataFrame, presence: pl.DataFrame, tolerance: timedelta) -> pl.DataFrame:
    """The events with one row per GPU they stand for (`_event` numbers the event): those that
    name a GPU as they are, the others joined to the GPUs of their node (and slot, if given)
    that were reporting then."""
    events = events.with_row_index("_event")
    named = events.filter(pl.col(GPU).is_not_null())
    open_ = events.filter(pl.col(GPU).is_null()).drop(GPU)
    slots = presence.select(
        pl.col("cluster").alias("_cluster"), "node", pl.col("gpu_index").alias("_slot"), GPU, "first_ts", "last_ts"
    )
    joined = open_.join(slots, on="node", how="inner").filter(
        (pl.col("cluster").is_null() | pl.col("_cluster").is_null() | (pl.col("cluster") == pl.col("_cluster")))
        & (pl.col("gpu_index").is_null() | (pl.col("gpu_index") == pl.col("_slot")))
        & (pl.col("first_ts") <= pl.col("ts"))
        & (pl.col("last_ts") >= pl.col("ts") - tolerance)
    )
    joined = joined.select(named.columns)
    return pl.concat([named, joined], how="vertical_relaxed").unique(["_event", GPU]).sort(GPU, "ts")


def event_episodes(
    events: pl.DataFrame, known: pl.DataFrame, presence: pl.DataFrame, tolerance: timedelta
) -> pl.DataFrame:
    """Failure episodes from failure events (module notes, source 4): `events` with `ts`,
    `node`, `source` and optionally `cluster`, `gpu_index`, `gpu_uuid`, `end`, `xid`; `known`
    the failure-XID episodes; `presence` from `gpu_presence`."""
    optional = {"cluster": pl.String(), "gpu_index": pl.Int16(), GPU: pl.String(), "end": TS_DTYPE, "xid": pl.Int32()}
    events = events.with_columns(pl.lit(None, dtype=t).alias(c) for c, t in optional.items() if c not in events.columns)
    events = events.with_columns(
        pl.col("ts").cast(TS_DTYPE), pl.col("end").cast(TS_DTYPE), pl.col("gpu_index").cast(pl.Int16)
    )
    per_gpu = _event_gpus(events, presence, tolerance)
    starts = known.select(GPU, pl.col("start").cast(TS_DTYPE).alias("_known")).sort("_known")
    # The same failure as a known episode of the GPU: within `tolerance` either way.
    near = per_gpu.sort("ts").join_asof(
        starts, left_on="ts", right_on="_known", by=GPU, strategy="nearest", tolerance=tolerance, check_sortedness=False
    )
    explained = near.filter(pl.col("_known").is_not_null()).select("_event").unique()
    kept = per_gpu.join(explained, on="_event", how="anti").sort(GPU, "ts")
    # Events of one GPU within `tolerance` of the previous one are the same failure.
    gap = pl.col("ts") - pl.col("ts").shift(1).over(GPU)
    kept = kept.filter(gap.is_null() | (gap > tolerance))
    return (
        kept.select(
            GPU,
            pl.col("ts").alias("start"),
            pl.max_horizontal("ts", "end").alias("end"),
            "source",
            pl.when(pl.col("xid").is_null())
            .then(pl.lit([], dtype=pl.List(pl.Int32)))
            .otherwise(pl.concat_list(pl.col("xid").cast(pl.Int32)))
            .alias("xids"),
            pl.lit(1, dtype=pl.Int32).alias("n_events"),
        )
        .cast(EPISODE_SCHEMA)  # type: ignore[arg-type]
        .sort(GPU, "start")
    )


def service_returns(episodes: pl.DataFrame) -> pl.DataFrame:
    """Repair records (`repairs` columns `ts`, `old_gpu_uuid`, `action`) for the failure-event
    episodes whose event said when the node was back: the GPU returns to service then."""
    back = episodes.filter(pl.col("source").is_in(EVENT_SOURCES) & (pl.col("end") > pl.col("start")))
    return back.select(pl.col("end").alias("ts"), pl.col(GPU).alias("old_gpu_uuid"), pl.lit("reset").alias("action"))


def with_returns(repairs: pl.DataFrame | None, episodes: pl.DataFrame) -> pl.DataFrame | None:
    """`repairs` and the `service_returns` of `episodes`, for `label_rows`."""
    returns = service_returns(episodes)
    if returns.height == 0:
        return repairs
    if repairs is None:
        return returns
    return pl.concat([repairs.select("ts", "old_gpu_uuid", "action"), returns], how="vertical_relaxed")


def positives_by_source(frame: pl.DataFrame, episodes: pl.DataFrame) -> dict[str, int]:
    """How many positive rows of a labelled feature frame each episode source explains (the
    episode a positive row predicts starts `time_to_failure_h` after it)."""
    positive = frame.filter(pl.col("label") == 1)
    if positive.height == 0:
        return {}
    ahead_us = (pl.col("time_to_failure_h").cast(pl.Float64) * HOUR_US).round().cast(pl.Int64)
    rows = positive.select(GPU, (pl.col("ts") + pl.duration(microseconds=ahead_us)).alias("_start")).sort("_start")
    starts = episodes.select(GPU, pl.col("start").cast(TS_DTYPE).alias("_start"), "source").sort("_start")
    # Float32 hours carry the start to well within a second over any horizon.
    hit = rows.join_asof(
        starts, on="_start", by=GPU, strategy="nearest", tolerance=timedelta(seconds=1), check_sortedness=False
    )
    return {str(s): int(n) for s, n in hit.group_by("source").len().iter_rows() if s is not None}
