"""Peer features: how a GPU compares with other GPUs at the same grid time. A GPU hotter than
its neighbours at the same power is a cooling or silicon problem, not a workload; the neighbours
share its job, its rack air and its power feed, so the workload cancels out.

- `<m>_node_delta_<g>`: the GPU's bucket mean minus the median bucket mean of the *other* GPUs
  of its (cluster, node) at the same grid time; null without a reading or without a peer.
- `<m>_model_delta_<g>`: the GPU's bucket mean minus the median bucket mean of all GPUs of its
  `gpu_model` in the frame at the same grid time (the fleet median; a build over a store
  computes it over the whole fleet of that day).

for m in `PEER_METRICS`; `<g>` is the grid label (`1h`).
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import polars as pl

from features.spec import DEFAULT_GRID
from features.windows import ENGINE, GPU, grid_suffix

PEER_METRICS = ("temp_gpu_c", "power_w")


def model_column(frame: pl.DataFrame) -> pl.Expr:
    """The frame's `gpu_model`, or a null one where the telemetry has none (all one model)."""
    return pl.col("gpu_model") if "gpu_model" in frame.columns else pl.lit(None, dtype=pl.String).alias("gpu_model")


def _model_delta(metric: str, sfx: str) -> pl.Expr:
    """`<m>_model_delta_<g>` from the GPU's mean `_p_<m>` and the fleet's median `_model_<m>`."""
    return (pl.col(f"_p_{metric}") - pl.col(f"_model_{metric}")).alias(f"{metric}_model_delta{sfx}")


def model_deltas(means: pl.DataFrame, medians: pl.DataFrame, grid: timedelta = DEFAULT_GRID) -> pl.DataFrame:
    """gpu_uuid, ts and the `<m>_model_delta_<g>` features of the rows of `means` (gpu_uuid,
    ts, gpu_model and bucket means), against fleet medians made elsewhere (`model_medians`):
    for a build whose pieces each see part of the fleet."""
    sfx = grid_suffix(grid)
    metrics = [m for m in PEER_METRICS if f"{m}_mean{sfx}" in means.columns]
    return (
        means.lazy()
        .select(GPU, "ts", model_column(means), *[pl.col(f"{m}_mean{sfx}").alias(f"_p_{m}") for m in metrics])
        .join(medians.lazy(), on=["gpu_model", "ts"], how="left", nulls_equal=True)
        .select(GPU, "ts", *[_model_delta(m, sfx) for m in metrics])
        .collect(engine=ENGINE)
    )


def model_medians(frame: pl.DataFrame, grid: timedelta = DEFAULT_GRID) -> pl.DataFrame:
    """Per (gpu_model, ts): the median bucket mean of each peer metric over the GPUs of `frame`
    (bucket aggregates or a dense grid; a missing bucket's null mean does not count). Columns
    gpu_model, ts, `_model_<m>`. A store build computes it from every GPU's buckets of a day and
    hands it to `peer_features`, so GPUs built in separate shards share one fleet median."""
    sfx = grid_suffix(grid)
    metrics = [m for m in PEER_METRICS if f"{m}_mean{sfx}" in frame.columns]
    return (
        frame.lazy()
        .select(model_column(frame), "ts", *[pl.col(f"{m}_mean{sfx}").alias(f"_p_{m}") for m in metrics])
        .group_by("gpu_model", "ts")
        .agg(pl.col(f"_p_{m}").median().alias(f"_model_{m}") for m in metrics)
        .collect(engine=ENGINE)
    )


def peer_features(
    dense: pl.DataFrame, grid: timedelta = DEFAULT_GRID, *, medians: pl.DataFrame | None = None
) -> pl.DataFrame:
    """The peer features (module notes) for the rows of `dense` (bucket aggregates on the grid,
    from `features.windows.dense_grid`), in its row order: gpu_uuid, ts, then the features.
    `medians` (from `model_medians`) gives the fleet medians when `dense` holds only part of the
    fleet; by default they are taken over `dense`."""
    sfx = grid_suffix(grid)
    metrics = [m for m in PEER_METRICS if f"{m}_mean{sfx}" in dense.columns]
    keys = ["cluster", "node", "ts"]
    base = dense.lazy().select(
        *keys, GPU, model_column(dense), *[pl.col(f"{m}_mean{sfx}").alias(f"_p_{m}") for m in metrics]
    )
    if not metrics:
        return base.select(GPU, "ts").collect(engine=ENGINE)
    # The median of the *other* GPUs of the node at the same time, computed from each node-time's
    # sorted readings (a self-join with every peer was a quarter of a store build's time).
    frame = base.collect(engine=ENGINE)
    group = frame.select(
        pl.when(pl.col("cluster").is_not_null() & pl.col("node").is_not_null())
        .then(pl.struct(*keys).rank("dense"))
        .fill_null(0)
        .cast(pl.Int64)
    ).to_series()
    node_medians = frame.select(GPU, "ts").with_columns(
        pl.Series(f"_node_{m}", median_of_others(group.to_numpy(), frame[f"_p_{m}"].to_numpy()), nan_to_null=True)
        for m in metrics
    )
    fleet = (medians if medians is not None else model_medians(dense, grid)).lazy()
    return (
        pl.concat([frame.lazy(), node_medians.lazy().drop(GPU, "ts")], how="horizontal")
        .join(fleet, on=["gpu_model", "ts"], how="left", maintain_order="left", nulls_equal=True)
        .select(
            GPU,
            "ts",
            *[(pl.col(f"_p_{m}") - pl.col(f"_node_{m}")).alias(f"{m}_node_delta{sfx}") for m in metrics],
            *[_model_delta(m, sfx) for m in metrics],
        )
        .collect(engine=ENGINE)
    )


def median_of_others(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each row, the median of `values` over the *other* rows of its group (`group` 0 = in
    no group). NaN is no reading: it is not a peer, and its own row gets NaN, as does a row
    whose group has no other reading.

    With a group's readings sorted, v[0] <= ... <= v[n-1], the others of the reading at rank r
    are v without v[r]: their k-th smallest is v[k] below r and v[k + 1] from r on, and their
    median is the mean of the ((m - 1) // 2)-th and (m // 2)-th of the m = n - 1 others."""
    n = len(values)
    out = np.full(n, np.nan)
    if n == 0:
        return out
    order = np.lexsort((values, group))  # by group, then value, NaN last within a group
    g, v = group[order], values[order]
    first = np.r_[True, g[1:] != g[:-1]]
    starts = np.flatnonzero(first)
    which = np.cumsum(first) - 1
    start = starts[which]
    readings = np.add.reduceat((~np.isnan(v)).astype(np.int64), starts)[which]
    rank = np.arange(n) - start
    m = readings - 1
    has = (g != 0) & ~np.isnan(v) & (m >= 1)

    def other(k: np.ndarray) -> np.ndarray:
        return v[np.clip(start + k + (k >= rank), 0, n - 1)]

    median = (other((m - 1) // 2) + other(m // 2)) / 2
    out[order] = np.where(has, median, np.nan)
    return out
