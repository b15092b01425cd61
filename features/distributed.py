"""The feature build on a Dask cluster: the `features` dataset of
`features.build.build_features_from_store`, computed in (node group x time block) partitions.

- **Node groups.** Whole nodes, about `partition_nodes` per group, because a GPU's node peer
  features compare it with the other GPUs of its node. Nodes that share a GPU uuid (a board
  moved between nodes) go into one group, so each GPU's whole history is in one partition.
- **Time blocks.** `partition_days` whole UTC days. A partition reads its nodes' raw telemetry
  for the block plus a lookback: the longest window (or the silence cap), one grid step, and
  `max_silence` more for the last sample before each bucket (the baseline of a counter
  increase). Its buckets after `block start - lookback` are then exactly those of an
  all-history build, as the single-machine build's carried trailing window is.
- **Fleet-wide facts** are computed once and shared with every partition: GPU presence (first
  and last sample of each GPU, one task per day partition over the identity columns), the data
  end, failure episodes and the resolved XID events.

Each partition runs the same pure functions as the single-machine build
(`features.windows.hourly_aggregate`, then `features.build.features_from_buckets`, which is
`build_features` from buckets). One feature needs the whole fleet at once:
`<m>_model_delta_<g>`, a GPU's bucket mean minus the median of all GPUs of its model at that
time. A partition computes it over its own GPUs, so per time block the partitions' bucket means
meet in one median task, and each partition replaces its column before it writes. Rows equal
the single-machine build's up to floating-point rounding (window sums start at the partition's
first bucket), which `tests/features/test_distributed.py` checks.

Partitions write their own files (`features.build.write_features`: one per date, atomic
renames), so nothing wide passes through the client. Workers must reach the data root: a
shared folder or an object store URL (`s3://...`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import polars as pl
import pyarrow.compute as pc

from features.build import (
    FeatureBuildSummary,
    FeaturesExistError,
    features_from_buckets,
    nothing_to_build,
    read_xid_events,
    write_features,
)
from features.labels import (
    GPU,
    combine_presence,
    episodes_for,
    gpu_presence,
    resolve_xid_gpus,
)
from features.manifest import FeatureManifest, settle_time
from features.peers import PEER_METRICS, model_medians
from features.schema import FEATURE_DTYPE, TS_DTYPE
from features.shards import node_groups
from features.spec import FeatureSpec
from features.windows import grid_floor, grid_suffix, hourly_aggregate
from ingest.store import Store

_ID_COLS = ["ts", "cluster", "node", "gpu_index", "pci_bus_id", GPU]
_NODE = ["cluster", "node"]


@dataclass(frozen=True)
class _Params:
    """What every partition needs besides its own rows (sent once per task, small)."""

    spec: FeatureSpec
    data_end: datetime
    rows_per_chunk: int

    @property
    def lookback(self) -> timedelta:
        # Same as the single-machine build: the longest window, and a silent GPU's last bucket.
        return max(max(self.spec.windows), self.spec.max_silence + self.spec.grid)


# -- reading ----------------------------------------------------------------------------------


def _read_nodes(store: Store, nodes: pl.DataFrame, start: datetime, end: datetime) -> pl.DataFrame:
    """Raw telemetry of the (cluster, node) pairs `nodes` with start <= ts < end. Local files are
    scanned with polars (several times faster here than pyarrow's dataset reader, see
    `features.build`); other filesystems go through `Store.read` with the node filter pushed
    down."""
    names = nodes["node"].unique().to_list()
    if store.is_local:
        files = store.dataset("telemetry", start.date(), (end - timedelta(microseconds=1)).date()).files
        if not files:
            return pl.DataFrame()
        frame = (
            pl.scan_parquet(files, hive_partitioning=False)
            .filter(
                (pl.col("ts") >= pl.lit(start, dtype=TS_DTYPE))
                & (pl.col("ts") < pl.lit(end, dtype=TS_DTYPE))
                & pl.col("node").is_in(names)
            )
            .collect()
        )
    else:
        table = store.read("telemetry", start, end, filter=pc.field("node").isin(names))
        frame = pl.DataFrame(pl.from_arrow(table))
    return frame.join(nodes, on=_NODE, how="semi")


def _day_presence(store: Store, day: date) -> pl.DataFrame:
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    table = store.read("telemetry", start, start + timedelta(days=1), columns=_ID_COLS)
    return gpu_presence(pl.DataFrame(pl.from_arrow(table)))


# -- one partition ----------------------------------------------------------------------------


def _partition(
    store: Store,
    nodes: pl.DataFrame,
    block: tuple[datetime, datetime],
    params: _Params,
    xid: pl.DataFrame,
    presence: pl.DataFrame,
    episodes: pl.DataFrame,
    repairs: pl.DataFrame | None,
) -> tuple[pl.DataFrame | None, pl.DataFrame | None, int]:
    """The features of `nodes` for grid times in `block` (before the model deltas are made
    fleet-wide), their bucket means for the fleet medians, and the telemetry rows read."""
    start, end = block
    spec = params.spec
    horizon_start = start - params.lookback
    tel = _read_nodes(store, nodes, horizon_start - spec.grid - spec.max_silence, end)
    if tel.height == 0:
        return None, None, 0
    hourly = hourly_aggregate(tel, spec.grid, max_gap=spec.max_silence)
    hourly = hourly.filter(pl.col("ts") > pl.lit(horizon_start, dtype=TS_DTYPE))
    gpus = presence.join(nodes, on=_NODE, how="semi")[GPU].unique()
    frame = features_from_buckets(
        hourly,
        xid.filter(pl.col(GPU).is_in(gpus.implode())),
        spec,
        data_end=params.data_end,
        repairs=repairs,
        presence=presence,
        episodes=episodes,
        emit_start=start,
        emit_end=end,
        rows_per_chunk=params.rows_per_chunk,
    )
    sfx = grid_suffix(spec.grid)
    metrics = [f"{m}_mean{sfx}" for m in PEER_METRICS if f"{m}_mean{sfx}" in hourly.columns]
    # The rows `features.peers` takes its fleet median over: buckets in the block, on the grid
    # before the data end (empty buckets have no mean, and medians skip nulls).
    last = grid_floor(params.data_end, spec.grid)
    means = hourly.filter(
        (pl.col("ts") >= pl.lit(start, dtype=TS_DTYPE))
        & (pl.col("ts") < pl.lit(end, dtype=TS_DTYPE))
        & (pl.col("ts") <= pl.lit(last, dtype=TS_DTYPE))
    ).select(GPU, "ts", _model_column(hourly), *metrics)
    return frame, means, tel.height


def _model_column(frame: pl.DataFrame) -> pl.Expr:
    return pl.col("gpu_model") if "gpu_model" in frame.columns else pl.lit(None, dtype=pl.String).alias("gpu_model")


def _model_medians(parts: Sequence[pl.DataFrame | None], grid: timedelta) -> pl.DataFrame | None:
    """Per (gpu_model, ts): the median bucket mean of each peer metric over the whole fleet
    (`features.peers.model_medians` of every partition's means)."""
    frames = [p for p in parts if p is not None and p.height]
    if not frames:
        return None
    return model_medians(pl.concat(frames, how="vertical_relaxed"), grid)


def _means_of(part: tuple[pl.DataFrame | None, pl.DataFrame | None, int]) -> pl.DataFrame | None:
    return part[1]


def _finish(
    store: Store,
    part: tuple[pl.DataFrame | None, pl.DataFrame | None, int],
    medians: pl.DataFrame | None,
    grid: timedelta,
) -> dict[str, Any]:
    """Make a partition's model deltas fleet-wide, write its files, and say what it wrote."""
    frame, means, rows_read = part
    if frame is None or frame.height == 0:
        return {"rows": 0, "positives": 0, "censored": 0, "gpus": [], "files": [], "rows_read": rows_read}
    if means is not None and medians is not None:
        sfx = grid_suffix(grid)
        deltas = means.join(medians, on=["gpu_model", "ts"], how="left", nulls_equal=True).select(
            GPU,
            "ts",
            *[
                (pl.col(f"{m}_mean{sfx}") - pl.col(f"_model_{m}")).alias(f"{m}_model_delta{sfx}")
                for m in PEER_METRICS
                if f"{m}_mean{sfx}" in means.columns
            ],
        )
        names = [c for c in deltas.columns if c not in (GPU, "ts")]
        order = frame.columns
        frame = (
            frame.drop(names)
            .join(deltas, on=[GPU, "ts"], how="left", maintain_order="left")
            .with_columns(pl.col(c).cast(FEATURE_DTYPE) for c in names)
            .select(order)
        )
    files = write_features(store, frame)
    return {
        "rows": frame.height,
        "positives": int((frame["label"] == 1).sum()),
        "censored": frame["label"].null_count(),
        "gpus": frame[GPU].unique().to_list(),
        "files": files,
        "rows_read": rows_read,
    }


# -- the build --------------------------------------------------------------------------------


def _days(start: datetime, end: datetime) -> list[datetime]:
    return [start + timedelta(days=i) for i in range((end - start) // timedelta(days=1))]


def _day_start(moment: datetime) -> datetime:
    m = moment.astimezone(UTC) if moment.tzinfo else moment.replace(tzinfo=UTC)
    return datetime(m.year, m.month, m.day, tzinfo=UTC)


def _shared_facts(
    client: Any, store: Store, spec: FeatureSpec
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame | None, pl.DataFrame]:
    """Presence (one task per telemetry day), resolved XID events, repairs, failure episodes."""
    days = store.dates("telemetry")
    presence = combine_presence(client.gather(client.map(_day_presence, [store] * len(days), days, pure=False)))
    xid = read_xid_events(store)  # as the single-machine build reads them
    xid = resolve_xid_gpus(xid, presence) if presence.height else xid
    repairs = pl.DataFrame(pl.from_arrow(store.read("repairs"))) if store.exists("repairs") else None
    if presence.height == 0:
        return presence, xid, repairs, pl.DataFrame()
    data_end = presence["last_ts"].max()
    episodes = episodes_for(
        xid,
        presence,
        failure_xids=spec.failure_xids,
        merge_window=spec.merge_window,
        data_end=data_end,  # type: ignore[arg-type]
        lost_after=spec.lost_after,
        repairs=repairs,
    )
    return presence, xid, repairs, episodes


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
    """`features.build.build_features_from_store` on the Dask cluster of `client` (a
    `distributed.Client`): the same spec, the same rows in the `features` dataset, for grid
    times in [start, end) widened to whole UTC days. Days already built are kept and partial
    ones rebuilt, as there (`features.manifest`; the days are recorded once every partition
    has written, with the spec). See the module notes for the partitions."""
    began = time.perf_counter()
    spec = spec or FeatureSpec()
    if partition_days < 1:
        raise ValueError(f"partition_days: expected at least 1, got {partition_days}")
    summary = FeatureBuildSummary()
    presence, xid, repairs, episodes = _shared_facts(client, store, spec)
    if presence.height == 0:
        summary.seconds = time.perf_counter() - began
        return summary
    data_end: datetime = presence["last_ts"].max()  # type: ignore[assignment]
    first_data: datetime = presence["first_ts"].min()  # type: ignore[assignment]
    summary.data_end = data_end

    emit_start = _day_start(max(start, first_data) if start is not None else first_data)
    last = min(end - timedelta(microseconds=1), data_end) if end is not None else data_end
    emit_end = _day_start(last) + timedelta(days=1)
    if emit_end <= emit_start:
        summary.seconds = time.perf_counter() - began
        return summary
    summary.start, summary.end = emit_start, emit_end
    # As the single-machine build: complete days stay, partial ones are rebuilt.
    manifest = FeatureManifest.load(store)
    manifest.use_spec(spec, emit_start, emit_end, overwrite=overwrite)
    plan = manifest.plan(emit_start, emit_end, data_end=data_end, settle=settle_time(spec), overwrite=overwrite)
    manifest.remove(plan.partial)
    summary.leftovers_removed, summary.days_kept = len(plan.partial), len(plan.kept)
    if not plan.runs:
        raise FeaturesExistError(nothing_to_build(manifest, plan, emit_start, emit_end))

    params = _Params(spec=spec, data_end=data_end, rows_per_chunk=rows_per_chunk)
    step = timedelta(days=partition_days)
    blocks = []
    for run_start, run_end in plan.runs:
        block_start = run_start
        while block_start < run_end:
            blocks.append((block_start, min(block_start + step, run_end)))
            block_start += step
    groups = node_groups(presence, partition_nodes)
    shared = [client.scatter(x, broadcast=True) for x in (xid, presence, episodes)]
    repairs_f = client.scatter(repairs, broadcast=True) if repairs is not None else None

    # All tasks are submitted at once; priorities make the workers finish (and write, freeing
    # the wide frames of) one block before they start many of the next.
    results = []
    for b, block in enumerate(blocks):
        parts = [
            client.submit(_partition, store, nodes, block, params, *shared, repairs_f, pure=False, priority=-2 * b)
            for nodes in groups
        ]
        means = [client.submit(_means_of, p, priority=-2 * b) for p in parts]
        medians = client.submit(_model_medians, means, spec.grid, priority=-2 * b + 1)
        results += [
            client.submit(_finish, store, p, medians, spec.grid, pure=False, priority=-2 * b + 1) for p in parts
        ]
    gpus: set[str] = set()
    for done in client.gather(results):
        summary.rows += done["rows"]
        summary.positives += done["positives"]
        summary.censored += done["censored"]
        summary.files_written += done["files"]
        summary.telemetry_rows_read += done["rows_read"]
        gpus.update(done["gpus"])
    summary.blocks = len(blocks) * len(groups)
    # Every partition wrote its files: the days are complete, and the files they replace go.
    built = [d.date() for start_, end_ in plan.runs for d in _days(start_, end_)]
    manifest.complete(built, summary.files_written, data_end)
    replaced = [name for day in built for name in plan.replaced.get(day, [])]
    manifest.remove(replaced)
    summary.files_replaced = len(replaced)
    summary.gpus = len(gpus)
    summary.seconds = time.perf_counter() - began
    return summary
