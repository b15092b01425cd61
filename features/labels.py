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
    "source": pl.String(),  # "xid" | "lost" | "repair"
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
    node_last = per_gpu.select("cluster", "node", pl.col(GPU).alias("_other"), pl.col("last_ts").alias("_other_last"))
    end = pl.lit(data_end, dtype=TS_DTYPE)
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
) -> pl.DataFrame:
    """All failure episodes: failure XIDs (events resolved to GPUs first), lost GPUs
    (`lost_after=None` turns those off) and repairs of GPUs in service (`repairs`, the
    `repairs` dataset; none when omitted). Sorted by (gpu_uuid, start)."""
    known = _xid_and_lost_episodes(xid_events, presence, failure_xids, merge_window, data_end, lost_after)
    if repairs is None or repairs.height == 0:
        return known
    return pl.concat([known, repair_episodes(repairs, known, presence)]).sort(GPU, "start")


def _xid_and_lost_episodes(
    xid_events: pl.DataFrame,
    presence: pl.DataFrame,
    failure_xids: Iterable[int],
    merge_window: timedelta,
    data_end: datetime,
    lost_after: timedelta | None,
) -> pl.DataFrame:
    xid_eps = failure_episodes(resolve_xid_gpus(xid_events, presence), failure_xids, merge_window)
    if lost_after is None:
        return xid_eps
    lost = lost_gpu_episodes(presence, data_end, lost_after)
    # A failure XID logged within `lost_after` of the GPU's last sample explains the silence
    # and dates the failure: XIDs are the primary source.
    explained = lost.join(xid_eps.select(GPU, pl.col("start").alias("_xid_start")), on=GPU, how="inner").filter(
        pl.col("_xid_start") <= pl.col("start") + lost_after
    )
    lost = lost.join(explained.select(GPU).unique(), on=GPU, how="anti")
    return pl.concat([xid_eps, lost]).sort(GPU, "start")


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
