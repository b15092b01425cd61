"""XID history features on the grid: counts per class and for key codes, repeats, bursts, and
time since the last incident of each class. Pure functions of polars frames.

Definitions (window W at grid time t = the buckets in (t - W, t], see `features.windows`):

- `xid_<class>_count_<w>`: incidents of the class (one per `xid_events` row, counted at its
  first line `ts`), for every class of `ingest.xid_catalog.XID_CLASSES`.
- `xid_<code>_count_<w>` for the key codes in `KEY_XIDS`: precursors and application codes
  whose own count carries more than their class's.
- `xid_application_repeats_<w>`: lines of application-class incidents (the sum of
  `repeat_count`), counted at the incident's `last_ts`, when the last repeat was known.
- `xid_application_burst_h_<w>`: grid buckets in the window with at least `BURST_MIN`
  application-class incidents on the GPU (NVSentinel escalates "XID 13 three times in an hour":
  one crash is the user's program, a crash every few minutes on one GPU is the GPU).
- `xid_<class>_since_last_h`: hours from the class's last incident (at or before t) to t,
  capped at `since_cap` (also the value when there was none).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

import numpy as np
import polars as pl

from features.rolling import BucketArrays, KeptRows, gpu_segments, last_valid, trailing_sums, validity_bitmap
from features.schema import window_label
from features.spec import DEFAULT_GRID, DEFAULT_WINDOWS, DEFAULT_XID_SINCE_CAP
from features.windows import (
    ENGINE,
    GPU,
    HOUR_US,
    check_grid,
    grid_time,
    kept_frame,
    select_rows,
)
from ingest.xid_catalog import XID_CLASSES, xid_class_map

# Precursor codes (63 row remap / page retirement, 92 high single-bit ECC rate, 94 contained ECC
# error) and the application codes whose repetition on one GPU is a signal (13, 31, 43, 45).
# Failure codes are left out: rows at or after a failure are not in the frame, so their count
# before it is always 0.
KEY_XIDS: tuple[int, ...] = (13, 31, 43, 45, 63, 92, 94)
BURST_MIN = 3


def xid_features(
    keys: pl.DataFrame,
    xid_events: pl.DataFrame,
    grid: timedelta = DEFAULT_GRID,
    windows: Sequence[timedelta] = DEFAULT_WINDOWS,
    *,
    since_cap: timedelta = DEFAULT_XID_SINCE_CAP,
    classes: Mapping[int, str] | None = None,
    key_xids: Sequence[int] = KEY_XIDS,
    keep: pl.Series | None = None,
    dtype: type[pl.DataType] | pl.DataType = pl.Float64,
) -> pl.DataFrame:
    """XID features (module notes) at the grid times in `keys` (gpu_uuid, ts; a dense grid
    sorted by (gpu_uuid, ts)); the result has the same rows in the same order. Events without a
    `gpu_uuid` are ignored (resolve them first, `features.labels.resolve_xid_gpus`). `keep`
    and `dtype` as in `features.windows.window_features`."""
    sizes = check_grid(grid, windows)
    labels = [window_label(w) for w in windows]
    class_map = dict(xid_class_map() if classes is None else classes)
    cap_h = since_cap.total_seconds() / 3600
    codes = [int(c) for c in key_xids]

    ev = (
        xid_events.lazy()
        .filter(pl.col(GPU).is_not_null())
        .select(
            GPU,
            "ts",
            "repeat_count",
            grid_time(pl.col("ts"), grid).alias("_bucket"),
            grid_time(pl.col("last_ts"), grid).alias("_last_bucket"),
            pl.col("xid").cast(pl.Int64),
            pl.col("xid").replace_strict(class_map, default="other", return_dtype=pl.String).alias("_class"),
        )
    )
    grid_rows = _GridRows(keys, grid)
    # Per grid row: incidents by the incident's first line; repeats by its last line (only then
    # are they known); the latest incident per class, with incidents before a GPU's first grid
    # time moved into its first bucket, so "since last" also sees XIDs older than the grid.
    counts = grid_rows.aggregate(
        ev,
        pl.col("_bucket"),
        [
            *[(pl.col("_class") == c).sum().alias(f"x_{c}") for c in XID_CLASSES],
            *[(pl.col("xid") == code).sum().alias(f"xc_{code}") for code in codes],
        ],
    )
    repeats = grid_rows.aggregate(
        ev.filter(pl.col("_class") == "application"),
        pl.col("_last_bucket"),
        [pl.col("repeat_count").sum().alias("x_app_rep")],
    )
    lasts = grid_rows.aggregate(
        ev,
        pl.max_horizontal("_bucket", "_first"),
        [pl.col("ts").filter(pl.col("_class") == c).max().alias(f"_xl_{c}") for c in XID_CLASSES],
    )
    # Window sums of each per-row quantity at the kept rows: the counts placed on their rows.
    kept = KeptRows(keys[GPU], keep)
    quantities = {name: grid_rows.placed(counts, name) for name in counts.columns if name != _ROW}
    quantities["x_app_rep"] = grid_rows.placed(repeats, "x_app_rep")
    quantities["x_burst"] = (quantities["x_application"] >= BURST_MIN).astype(np.float64)
    placed = BucketArrays(pl.DataFrame(quantities))
    sums = []
    for name in quantities:
        for wl, total in zip(labels, trailing_sums(placed, name, kept, sizes), strict=True):
            sums.append(pl.Series(f"_{name}_{wl}", total))
    latest = [grid_rows.latest(lasts, f"_xl_{c}", kept) for c in XID_CLASSES]
    lf = kept_frame(keys, [GPU, "ts"], keep).with_columns(*latest, *sums).lazy()
    out: list[pl.Expr] = []
    for c in XID_CLASSES:
        out += [pl.col(f"_x_{c}_{wl}").alias(f"xid_{c}_count_{wl}") for wl in labels]
    for code in codes:
        out += [pl.col(f"_xc_{code}_{wl}").alias(f"xid_{code}_count_{wl}") for wl in labels]
    for wl in labels:
        out.append(pl.col(f"_x_app_rep_{wl}").alias(f"xid_application_repeats_{wl}"))
        out.append(pl.col(f"_x_burst_{wl}").alias(f"xid_application_burst_h_{wl}"))
    for c in XID_CLASSES:
        last = pl.col(f"_xl_{c}")
        out.append(
            ((pl.col("ts") - last).dt.total_microseconds() / HOUR_US)
            .clip(upper_bound=cap_h)
            .fill_null(cap_h)
            .alias(f"xid_{c}_since_last_h")
        )
    return select_rows(lf, out, None, dtype)


_ROW = "_row"


class _GridRows:
    """Where per-(GPU, grid time) values go on a dense grid (`keys`: every grid time of each
    GPU from its first to its last, sorted by (gpu_uuid, ts)): its row is the GPU's first row
    plus its grid steps from the GPU's first grid time. A value whose time has no row there is
    dropped, as a join on (gpu_uuid, ts) drops it; joining the grid (every row of a week of the
    fleet) to the incidents hashed every key, for a few thousand incidents."""

    def __init__(self, keys: pl.DataFrame, grid: timedelta) -> None:
        self.keys = keys
        self.grid_us = int(grid / timedelta(microseconds=1))
        runs = gpu_segments(keys[GPU])
        self.runs = pl.DataFrame(
            {
                GPU: keys[GPU].gather(runs.starts),
                "_start": runs.starts,
                "_length": runs.lengths,
                "_first": keys["ts"].gather(runs.starts),
                "_last": keys["ts"].gather(runs.ends - 1),
            }
        )
        spans = (self.runs["_last"] - self.runs["_first"]).dt.total_microseconds()
        if not (spans == (self.runs["_length"] - 1) * self.grid_us).all():
            raise ValueError(
                "xid_features keys: expected a dense grid (every grid time of each GPU from its first "
                "to its last, sorted by (gpu_uuid, ts)); a GPU's rows span more or fewer grid steps than it has"
            )

    def aggregate(self, events: pl.LazyFrame, at: pl.Expr, aggregations: list[pl.Expr]) -> pl.DataFrame:
        """`aggregations` of `events` per grid row of their time `at` (an expression that may
        use `_first`, the GPU's first grid time): `_ROW` and a column per aggregation."""
        steps = (at - pl.col("_first")).dt.total_microseconds() // self.grid_us
        placed = (
            events.join(self.runs.lazy(), on=GPU, how="inner")
            .with_columns(steps.alias("_steps"))
            .filter((pl.col("_steps") >= 0) & (pl.col("_steps") < pl.col("_length")))
            .with_columns((pl.col("_start") + pl.col("_steps")).alias(_ROW))
        )
        return placed.group_by(_ROW).agg(aggregations).collect(engine=ENGINE)

    def placed(self, values: pl.DataFrame, column: str) -> np.ndarray:
        """`column` of `aggregate`'s `values` on every grid row (Float64, 0 where none)."""
        out = np.zeros(self.keys.height, np.float64)
        out[values[_ROW].to_numpy()] = values[column].cast(pl.Float64).to_numpy()
        return out

    def latest(self, values: pl.DataFrame, column: str, kept: KeptRows) -> pl.Series:
        """At each kept row, `column` (a time) of its GPU's last grid row up to it that has
        one (`forward_fill().over(GPU)`, read at the kept rows only); null where none has."""
        present = values.filter(pl.col(column).is_not_null())
        valid = np.zeros(self.keys.height, np.bool_)
        valid[present[_ROW].to_numpy()] = True
        times = np.zeros(self.keys.height, np.int64)
        times[present[_ROW].to_numpy()] = present[column].dt.epoch("us").to_numpy()
        out, found = last_valid(times, validity_bitmap(valid), kept, self.keys.height, np.int64)
        latest = pl.Series(column, out).cast(pl.Datetime("us", "UTC")).cast(values[column].dtype)
        return latest if found.all() else latest.set(pl.Series(~found), None)


NVML_SOURCE = "nvml"
CROSS_SOURCE_TOLERANCE = timedelta(minutes=10)
"""How far apart the NVML and kernel-log copies of one XID may be stamped. The kernel stamps the
line when the driver logs it; the NVML collector stamps the event when it next reads its event
set, up to one collect interval (30 s by default, minutes at most) later."""


def drop_cross_source_duplicates(
    xid_events: pl.DataFrame, tolerance: timedelta = CROSS_SOURCE_TOLERANCE
) -> pl.DataFrame:
    """Drop NVML rows that repeat a kernel-log incident.

    A node collecting both NVML event sets and the kernel log sees each XID twice (and a lost GPU
    as both NVML's GPU_IS_LOST event and the kernel's "fallen off the bus" 79). Counting both
    would double every XID feature on exactly the nodes that collect the most. The kernel-log row
    is kept (it has the pid, process, message and repeat count); an NVML row is dropped when a
    row from another source on the same node, bus id and XID overlaps its span widened by
    `tolerance`. NVML rows with no kernel-log twin (a node without kernel-log access) stay.
    """
    needed = {"source", "node", "pci_bus_id", "xid", "ts", "last_ts"}
    if xid_events.height == 0 or not needed <= set(xid_events.columns):
        return xid_events
    is_nvml = pl.col("source") == NVML_SOURCE
    nvml = xid_events.filter(is_nvml).with_row_index("_nvml_row")
    if nvml.height == 0:
        return xid_events
    keys = ["node", "pci_bus_id", "xid"]
    others = xid_events.filter(~is_nvml).select(
        [*keys, pl.col("ts").alias("_o_ts"), pl.col("last_ts").alias("_o_last")]
    )
    twins = (
        nvml.select(["_nvml_row", *keys, "ts", "last_ts"])
        .join(others, on=keys, how="inner")
        .filter((pl.col("_o_ts") <= pl.col("last_ts") + tolerance) & (pl.col("_o_last") >= pl.col("ts") - tolerance))
        .select("_nvml_row")
        .unique()
    )
    kept_nvml = nvml.join(twins, on="_nvml_row", how="anti").drop("_nvml_row")
    return pl.concat([xid_events.filter(~is_nvml), kept_nvml]).sort("ts", maintain_order=True)
