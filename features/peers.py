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

import polars as pl

from features.windows import DEFAULT_GRID, ENGINE, GPU, grid_suffix

PEER_METRICS = ("temp_gpu_c", "power_w")


def peer_features(dense: pl.DataFrame, grid: timedelta = DEFAULT_GRID) -> pl.DataFrame:
    """The peer features (module notes) for the rows of `dense` (bucket aggregates on the grid,
    from `features.windows.dense_grid`), in its row order: gpu_uuid, ts, then the features."""
    sfx = grid_suffix(grid)
    metrics = [m for m in PEER_METRICS if f"{m}_mean{sfx}" in dense.columns]
    keys = ["cluster", "node", "ts"]
    has_model = "gpu_model" in dense.columns
    model = pl.col("gpu_model") if has_model else pl.lit(None, dtype=pl.String).alias("gpu_model")
    base = dense.lazy().select(*keys, GPU, model, *[pl.col(f"{m}_mean{sfx}").alias(f"_p_{m}") for m in metrics])
    if not metrics:
        return base.select(GPU, "ts").collect(engine=ENGINE)
    peers = base.select(*keys, pl.col(GPU).alias("_peer"), *[pl.col(f"_p_{m}").alias(f"_q_{m}") for m in metrics])
    node_medians = (
        base.select(*keys, GPU)
        .join(peers, on=keys, how="inner")
        .filter(pl.col(GPU) != pl.col("_peer"))
        .group_by(GPU, "ts")
        .agg(pl.col(f"_q_{m}").median().alias(f"_node_{m}") for m in metrics)
    )
    model_medians = base.group_by("gpu_model", "ts").agg(
        pl.col(f"_p_{m}").median().alias(f"_model_{m}") for m in metrics
    )
    return (
        base.join(node_medians, on=[GPU, "ts"], how="left", maintain_order="left")
        .join(model_medians, on=["gpu_model", "ts"], how="left", maintain_order="left", nulls_equal=True)
        .select(
            GPU,
            "ts",
            *[(pl.col(f"_p_{m}") - pl.col(f"_node_{m}")).alias(f"{m}_node_delta{sfx}") for m in metrics],
            *[(pl.col(f"_p_{m}") - pl.col(f"_model_{m}")).alias(f"{m}_model_delta{sfx}") for m in metrics],
        )
        .collect(engine=ENGINE)
    )
