"""The feature builds on a Dask cluster: the stored aggregates of `features.aggregates`
(`build_aggregates_distributed`, at the end of this module), and the `features` table of
`features.runner.build_features_from_store` (`build_features_distributed`), computed in
(node group x time block) partitions: the same plan (`features.plan`: fleet facts, emit range,
lookback, the exists check, finish), run on Dask.

- **Node groups.** Whole nodes, about `partition_nodes` per group, because a GPU's node peer
  features compare it with the other GPUs of its node. Nodes that share a GPU uuid (a board
  moved between nodes) go into one group, so each GPU's whole history is in one partition.
- **Time blocks.** `partition_days` whole UTC days. A partition reads its nodes' raw telemetry
  for the block plus a lookback: the longest window (or the silence cap), one grid step, and
  `max_silence` more for the last sample before each bucket (the baseline of a counter
  increase). Its buckets after `block start - lookback` are then exactly those of an
  all-history build, as the single-machine build's carried trailing window is.
- **Fleet-wide facts** (`features.plan.fleet_facts`) are computed once and shared with every
  partition; GPU presence (first and last sample of each GPU) is found with one task per day
  partition over the identity columns.

Each partition runs the same pure functions as the single-machine build
(`features.windows.hourly_aggregate`, then `features.build.features_from_buckets`, which is
`build_features` from buckets). One feature needs the whole fleet at once:
`<m>_model_delta_<g>`, a GPU's bucket mean minus the median of all GPUs of its model at that
time. A partition computes it over its own GPUs, so per time block the partitions' bucket means
meet in one median task, and each partition replaces its column (`features.peers.model_deltas`)
before it writes. Rows equal the single-machine build's up to floating-point rounding (window
sums start at the partition's first bucket), which `tests/features/test_distributed.py` checks.

Partitions write their own files (`features.dataset.write_features`: one per date, hidden until
the build commits them all with the manifest, `features.manifest`), so nothing wide passes
through the client. Workers must reach the data root: a shared folder or an object store URL
(`s3://...`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import polars as pl

from features.aggregates import AggregatesSummary, count_built_rows, open_aggregates, plan_aggregates, write_day
from features.build import features_from_buckets, iter_features_from_buckets
from features.dataset import write_features
from features.fail_slow import fail_slow_columns, model_clocks, with_fleet_model_peers
from features.inputs import read_day_presence, read_nodes
from features.labels import GPU, combine_presence
from features.manifest import open_manifest
from features.peers import PEER_METRICS, model_column, model_deltas, model_medians
from features.plan import (
    FeatureBuildSummary,
    FleetFacts,
    Written,
    days_in,
    finish_days,
    lookback,
    plan_store_build,
    silent_sources,
)
from features.schema import FEATURE_DTYPE, TS_DTYPE
from features.shards import node_groups
from features.spec import FeatureSpec
from features.windows import grid_floor, grid_suffix, hourly_aggregate
from ingest.journal import Staging
from ingest.store import Store

_NODE = ["cluster", "node"]


@dataclass(frozen=True)
class _Params:
    """What every partition needs besides its own rows (sent once per task, small)."""

    spec: FeatureSpec
    rows_per_chunk: int


# -- one partition ----------------------------------------------------------------------------


_Part = tuple[pl.DataFrame | None, pl.DataFrame | None, int, pl.DataFrame | None]
"""A partition's features, bucket means, telemetry rows read and busy clocks (`_partition`)."""


def _partition(
    store: Store, nodes: pl.DataFrame, block: tuple[datetime, datetime], params: _Params, facts: FleetFacts
) -> _Part:
    """The features of `nodes` for grid times in `block` (before the model deltas and the
    fail-slow model peers are made fleet-wide), their bucket means for the fleet medians, the
    telemetry rows read, and the busy clocks the fail-slow model medians are taken over
    (`features.fail_slow.busy_clocks` of its grid rows in the block, as in a build at once)."""
    start, end = block
    spec = params.spec
    horizon_start = start - lookback(spec)
    tel = read_nodes(store, nodes, horizon_start - spec.grid - spec.max_silence, end)
    if tel.height == 0:
        return None, None, 0, None
    hourly = hourly_aggregate(tel, spec.grid, max_gap=spec.max_silence)
    hourly = hourly.filter(pl.col("ts") > pl.lit(horizon_start, dtype=TS_DTYPE))
    gpus = facts.presence.join(nodes, on=_NODE, how="semi")[GPU].unique()
    frame = features_from_buckets(
        hourly,
        facts.xid.filter(pl.col(GPU).is_in(gpus.implode())),
        spec,
        **facts.build_inputs(),
        emit_start=start,
        emit_end=end,
        rows_per_chunk=params.rows_per_chunk,
    )
    sfx = grid_suffix(spec.grid)
    metrics = [f"{m}_mean{sfx}" for m in PEER_METRICS if f"{m}_mean{sfx}" in hourly.columns]
    # The rows `features.peers` takes its fleet median over: buckets in the block, on the grid
    # before the data end (empty buckets have no mean, and medians skip nulls).
    last = grid_floor(facts.data_end, spec.grid)
    means = hourly.filter(
        (pl.col("ts") >= pl.lit(start, dtype=TS_DTYPE))
        & (pl.col("ts") < pl.lit(end, dtype=TS_DTYPE))
        & (pl.col("ts") <= pl.lit(last, dtype=TS_DTYPE))
    ).select(GPU, "ts", model_column(hourly), *metrics)
    clocks = None
    if spec.fail_slow_label is not None and fail_slow_columns(spec.fail_slow_label)[-1] in frame.columns:
        clocks = next(
            iter_features_from_buckets(
                hourly, facts.xid.head(0), spec, **facts.build_inputs(), emit_start=start, emit_end=end,
                fail_slow_clocks_only=True,
            )
        )  # fmt: skip
    return frame, means, tel.height, clocks


def _model_medians(parts: Sequence[pl.DataFrame | None], grid: timedelta) -> pl.DataFrame | None:
    """Per (gpu_model, ts): the median bucket mean of each peer metric over the whole fleet
    (`features.peers.model_medians` of every partition's means)."""
    frames = [p for p in parts if p is not None and p.height]
    if not frames:
        return None
    return model_medians(pl.concat(frames, how="vertical_relaxed"), grid)


def _means_of(part: _Part) -> pl.DataFrame | None:
    return part[1]


def _clocks_of(part: _Part) -> pl.DataFrame | None:
    return part[3]


def _fail_slow_medians(clocks: Sequence[pl.DataFrame | None]) -> pl.DataFrame | None:
    """The fail-slow model peers' medians of the whole fleet (`features.fail_slow.model_clocks`)."""
    found = [c for c in clocks if c is not None]
    return model_clocks(found) if found else None


def _finish(
    staging: Staging,
    part: _Part,
    medians: pl.DataFrame | None,
    slow: pl.DataFrame | None,
    spec: FeatureSpec,
    facts: FleetFacts,
) -> tuple[Written, int]:
    """Make a partition's model deltas and fail-slow model peers fleet-wide, write its files
    (hidden until the build commits them), and say what it wrote, and how many telemetry rows
    it read."""
    frame, means, rows_read, _ = part
    grid = spec.grid
    written = Written()
    if frame is None or frame.height == 0:
        return written, rows_read
    label = spec.fail_slow_label
    if slow is not None and label is not None:
        # The partition holds whole nodes: its node peers were all there, its model peers not.
        frame = with_fleet_model_peers(frame, label, slow)
    if means is not None and medians is not None:
        deltas = model_deltas(means, medians, grid)
        names = [c for c in deltas.columns if c not in (GPU, "ts")]
        order = frame.columns
        frame = (
            frame.drop(names)
            .join(deltas, on=[GPU, "ts"], how="left", maintain_order="left")
            .with_columns(pl.col(c).cast(FEATURE_DTYPE) for c in names)
            .select(order)
        )
    written.add(frame, facts.episodes)
    written.files = write_features(staging, frame)
    return written, rows_read


# -- the build --------------------------------------------------------------------------------


def _presence(client: Any, store: Store) -> pl.DataFrame:
    """GPU presence over all telemetry, one task per telemetry day."""
    days = store.dates("telemetry")
    return combine_presence(client.gather(client.map(read_day_presence, [store] * len(days), days, pure=False)))


def build_features_distributed(
    client: Any,
    store: Store,
    spec: FeatureSpec | None = None,
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    partition_nodes: int = 64,
    partition_days: int = 14,
    rows_per_chunk: int = 250_000,
    overwrite: bool = False,
) -> FeatureBuildSummary:
    """`features.runner.build_features_from_store` on the Dask cluster of `client` (a
    `distributed.Client`): the same spec, the same rows in the `features` dataset, for grid
    times in [start, end) widened to whole UTC days. Days already built are kept and partial
    ones rebuilt, as there (`features.manifest`; the days are recorded once every partition
    has written, with the spec). See the module notes for the partitions."""
    began = time.perf_counter()
    spec = spec or FeatureSpec()
    if partition_days < 1:
        raise ValueError(f"partition_days: expected at least 1, got {partition_days}")
    summary = FeatureBuildSummary()
    presence = _presence(client, store)
    # As the single-machine build: the same plan, complete days stay, partial ones are rebuilt.
    with open_manifest(store) as manifest:
        build = plan_store_build(store, manifest, spec, presence, summary, start=start, end=end, overwrite=overwrite)
        if build is None:
            return summary.timed(began)
        facts, plan = build.facts, build.plan
        params = _Params(spec=spec, rows_per_chunk=rows_per_chunk)
        step = timedelta(days=partition_days)
        blocks = []
        for run_start, run_end in plan.runs:
            block_start = run_start
            while block_start < run_end:
                blocks.append((block_start, min(block_start + step, run_end)))
                block_start += step
        groups = node_groups(presence, partition_nodes)
        staging = manifest.staging()  # the partitions' files stay hidden until the manifest's commit
        shared = client.scatter(facts, broadcast=True)

        # All tasks are submitted at once; priorities make the workers finish (and write, freeing
        # the wide frames of) one block before they start many of the next.
        results = []
        for b, block in enumerate(blocks):
            parts = [
                client.submit(_partition, store, nodes, block, params, shared, pure=False, priority=-2 * b)
                for nodes in groups
            ]
            means = [client.submit(_means_of, p, priority=-2 * b) for p in parts]
            medians = client.submit(_model_medians, means, spec.grid, priority=-2 * b + 1)
            clocks = [client.submit(_clocks_of, p, priority=-2 * b) for p in parts]
            slow = client.submit(_fail_slow_medians, clocks, priority=-2 * b + 1)
            results += [
                client.submit(_finish, staging, p, medians, slow, spec, shared, pure=False, priority=-2 * b + 1)
                for p in parts
            ]
        gpus: set[str] = set()
        files: list[str] = []
        for written, rows_read in client.gather(results):
            written.add_to(summary, gpus)
            files += written.files
            summary.telemetry_rows_read += rows_read
        summary.blocks = len(blocks) * len(groups)
        # Every partition wrote its files: the days are complete, and the files they replace go,
        # in one commit.
        built = [d.date() for run_start, run_end in plan.runs for d in days_in(run_start, run_end)]
        finish_days(manifest, plan, built, files, facts.data_end, summary)
        summary.warnings += silent_sources(facts, summary)
    return summary.timed(began, gpus)


# -- the stored aggregates --------------------------------------------------------------------


def _aggregate_partition(
    store: Store, nodes: pl.DataFrame, block: tuple[datetime, datetime], spec: FeatureSpec, staging: Staging
) -> tuple[list[str], int, int]:
    """The buckets of `nodes` labelled within `block`, one file per day (hidden until the build
    commits them); the files, the buckets and the telemetry rows read. Read from `max_silence`
    and one grid step before the block, so that its first buckets' counter increases and sample
    spacings have the sample before them, as the single-machine build's stream gives them."""
    start, end = block
    tel = read_nodes(store, nodes, start - spec.grid - spec.max_silence, end)
    if tel.height == 0:
        return [], 0, 0
    hourly = hourly_aggregate(tel, spec.grid, max_gap=spec.max_silence).filter(
        pl.col("ts").is_between(pl.lit(start, dtype=TS_DTYPE), pl.lit(end, dtype=TS_DTYPE), closed="left")
    )
    files: list[str] = []
    dated = hourly.with_columns(pl.col("ts").dt.date().alias("_day"))
    for (day,), buckets in dated.partition_by("_day", as_dict=True, include_key=False).items():
        files += write_day(staging, datetime.combine(day, datetime.min.time(), tzinfo=UTC), buckets, pl.DataFrame())
    return files, hourly.height, tel.height


def _presence_of_day(store: Store, day: date, staging: Staging) -> list[str]:
    """One day's GPU presence file (hidden until the build commits it)."""
    presence = read_day_presence(store, day)
    return write_day(staging, datetime.combine(day, datetime.min.time(), tzinfo=UTC), pl.DataFrame(), presence)


def build_aggregates_distributed(
    client: Any,
    store: Store,
    spec: FeatureSpec | None = None,
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    partition_nodes: int = 64,
    partition_days: int = 14,
    overwrite: bool = False,
) -> AggregatesSummary:
    """`features.aggregates.build_aggregates` on the Dask cluster of `client`: the same plan and
    the same buckets and presence, computed in (node group x block of `partition_days`)
    partitions that write their own files (a day's buckets are then a file per node group),
    committed together once every partition has written."""
    began = time.perf_counter()
    spec = spec or FeatureSpec()
    if partition_days < 1:
        raise ValueError(f"partition_days: expected at least 1, got {partition_days}")
    summary = AggregatesSummary()
    with open_aggregates(store) as manifest:
        planned = plan_aggregates(store, manifest, spec, summary, start=start, end=end, overwrite=overwrite)
        if planned is None:
            return summary.timed(began)
        plan = planned.plan
        groups = node_groups(_presence(client, store), partition_nodes)
        staging = manifest.staging()
        step = timedelta(days=partition_days)
        blocks = [
            (b, min(b + step, run_end))
            for run_start, run_end in plan.runs
            for b in (run_start + i * step for i in range(-(-(run_end - run_start) // step)))
        ]
        parts = [
            client.submit(_aggregate_partition, store, nodes, block, spec, staging, pure=False)
            for block in blocks
            for nodes in groups
        ]
        have = set(store.dates("telemetry"))
        built = [d.date() for run_start, run_end in plan.runs for d in days_in(run_start, run_end)]
        presences = [client.submit(_presence_of_day, store, d, staging, pure=False) for d in built if d in have]
        written: list[str] = []
        for files, buckets, rows_read in client.gather(parts):
            written += files
            summary.buckets += buckets
            summary.telemetry_rows_read += rows_read
        for files in client.gather(presences):
            written += files
        summary.blocks = len(parts)
        replaced = [name for day in built for name in plan.replaced.get(day, [])]
        manifest.complete(built, written, planned.data_end, replaced=replaced)
        summary.files_written += [staging.visible(p) for p in written]
        summary.files_replaced += len(replaced)
        gpus = count_built_rows(store, spec, plan.runs, summary)
    return summary.timed(began, gpus)
