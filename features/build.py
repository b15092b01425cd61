"""The pure feature build: a telemetry frame (and XID events) in, the feature frame out
(`build_features`), or from grid buckets already aggregated (`features_from_buckets`,
`iter_features_from_buckets`, which the store runners call: `features.runner`,
`features.distributed`). No I/O here: the features dataset is `features.dataset`, the store's
inputs `features.inputs`, a build over a store `features.plan` and its runners.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from itertools import islice
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from features import rolling
from features.fail_slow import CLOCKS_SCHEMA, bucket_columns, busy_clocks, fail_slow_features, needed_columns
from features.inputs import as_frame, normalise_ts, prepare_repairs, prepare_xids, utc
from features.labels import GPU, episodes_for, fleet_data_end, gpu_presence, label_rows, resolve_xid_gpus
from features.peers import PEER_METRICS, peer_features
from features.runs import gpu_slices
from features.schema import (
    FEATURE_DTYPE,
    ID_COLUMNS,
    ID_DTYPES,
    LABEL_COLUMNS,
    LABEL_DTYPES,
    TS_DTYPE,
    window_label,
)
from features.spec import FeatureSpec
from features.windows import (
    BUCKET_ID_COLUMNS,
    ENGINE,
    dense_grid,
    grid_frame_columns,
    grid_suffix,
    grid_time,
    hourly_aggregate,
    window_features,
)
from features.xids import xid_features
from ingest.schema import metric_catalogue


def _presence_from_buckets(hourly: pl.DataFrame, grid: timedelta) -> pl.DataFrame:
    """`labels.gpu_presence` computed from bucket aggregates (60x fewer rows than samples at
    one sample a minute); a GPU that changes slot inside one bucket is seen in its last slot."""
    keys = ["cluster", "node", "gpu_index", "pci_bus_id", GPU]
    n_col = f"n_samples_{window_label(grid)}"
    return (
        hourly.lazy()
        .with_columns(pl.lit(None, dtype=pl.String).alias(k) for k in keys if k not in hourly.columns)
        .group_by(keys)
        .agg(
            pl.col("first_sample_ts").min().alias("first_ts"),
            pl.col("last_sample_ts").max().alias("last_ts"),
            pl.col(n_col).sum().cast(pl.Int64).alias("n_samples"),
        )
        .sort(GPU, "first_ts")
        .collect(engine=ENGINE)
    )


def failure_episodes(
    xid: pl.DataFrame,
    presence: pl.DataFrame,
    spec: FeatureSpec,
    *,
    data_end: datetime,
    repairs: pl.DataFrame | None,
    failure_events: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """The failure episodes (`labels.episodes_for`) of the XID events resolved to GPUs (`xid`),
    the repair records and the failure events, with the settings of `spec`."""
    return episodes_for(
        xid,
        presence,
        failure_xids=spec.failure_xids,
        merge_window=spec.merge_window,
        data_end=data_end,
        lost_after=spec.lost_after,
        repairs=repairs,
        failure_events=failure_events,
    )


def empty_features(telemetry_columns: Sequence[str], spec: FeatureSpec | None = None) -> pl.DataFrame:
    """A zero-row feature frame with the columns a build with `spec` (default: the default spec)
    over frames with these telemetry columns produces."""
    metric_types = {m.column: pl.from_arrow(pa.array([], type=m.arrow_type)).dtype for m in metric_catalogue()}  # type: ignore[union-attr]
    schema = {c: ID_DTYPES.get(c, metric_types.get(c, pl.Float32())) for c in telemetry_columns}
    schema.setdefault("ts", TS_DTYPE)
    schema.setdefault(GPU, pl.String())
    tel = pl.DataFrame(schema=schema)
    end = datetime(1970, 1, 2, tzinfo=UTC)
    return build_features(
        tel, pl.DataFrame(schema={"ts": TS_DTYPE, GPU: pl.String(), "xid": pl.Int32()}), spec, data_end=end
    )


def build_features(
    telemetry: pl.DataFrame | pa.Table,
    xid_events: pl.DataFrame | pa.Table,
    spec: FeatureSpec | None = None,
    *,
    data_end: datetime | None = None,
    repairs: pl.DataFrame | pa.Table | None = None,
    presence: pl.DataFrame | None = None,
    episodes: pl.DataFrame | None = None,
    emit_start: datetime | None = None,
    emit_end: datetime | None = None,
) -> pl.DataFrame:
    """The feature frame (`features.schema`) for the GPUs in `telemetry`, built in memory with
    the settings of `spec` (default: the default spec).

    One row per (gpu_uuid, grid time t) from the GPU's first bucket up to `data_end` (default:
    the last telemetry timestamp), while the GPU's last sample is at most `spec.max_silence`
    old, and while the GPU is in service (not between a failure episode and its repair).
    Features use only data <= t; labels look at (t, t + horizon] (see `features.windows`,
    `features.labels`).

    `repairs` are operator records (the `repairs` dataset). `presence`, `episodes` let a caller
    that sees only part of the fleet or of the history pass fleet-wide facts: GPU presence
    (`labels.gpu_presence`: first sample, for `gpu_age_h`, and lost-GPU detection) and failure
    episodes. `emit_start` / `emit_end` keep only rows with emit_start <= t < emit_end.
    """
    spec = spec or FeatureSpec()
    tel = normalise_ts(as_frame(telemetry), ["ts"], "telemetry")
    missing = [c for c in ("ts", GPU) if c not in tel.columns]
    if missing:
        raise ValueError(f"telemetry: missing required columns {missing}; got {tel.columns}")
    if data_end is None:
        if tel.height == 0:
            raise ValueError("telemetry is empty and no data_end was given; cannot place the grid")
        data_end = fleet_data_end(gpu_presence(tel))
    assert data_end is not None
    hourly = hourly_aggregate(tel, spec.grid, max_gap=spec.max_silence)
    return features_from_buckets(
        hourly,
        xid_events,
        spec,
        data_end=data_end,
        repairs=repairs,
        presence=presence,
        episodes=episodes,
        emit_start=emit_start,
        emit_end=emit_end,
    )


def features_from_buckets(
    hourly: pl.DataFrame, xid_events: pl.DataFrame | pa.Table, spec: FeatureSpec | None = None, **options: Any
) -> pl.DataFrame:
    """`build_features` from bucket aggregates (`features.windows.hourly_aggregate` output)
    instead of raw samples: the second half of a build, as one frame. `options` are
    `iter_features_from_buckets`' (data_end is required); its parts are concatenated here, so a
    setting is declared once, there."""
    return pl.concat(list(iter_features_from_buckets(hourly, xid_events, spec, **options)), how="vertical")


_SOURCE = "_bucket_row"


def iter_features_from_buckets(
    hourly: pl.DataFrame,
    xid_events: pl.DataFrame | pa.Table,
    spec: FeatureSpec | None = None,
    *,
    data_end: datetime,
    repairs: pl.DataFrame | pa.Table | None = None,
    presence: pl.DataFrame | None = None,
    episodes: pl.DataFrame | None = None,
    emit_start: datetime | None = None,
    emit_end: datetime | None = None,
    rows_per_chunk: int | None = None,
    rows_per_part: int | None = None,
    model_medians: pl.DataFrame | None = None,
    rows: Callable[[pl.DataFrame], pl.Series] | None = None,
    labels_only: bool = False,
    part_threads: int = 1,
    fail_slow_medians: pl.DataFrame | None = None,
    fail_slow_clocks_only: bool = False,
) -> Iterator[pl.DataFrame]:
    """The feature frame (`features.schema`) of the buckets' GPUs, in parts of whole GPUs, each
    a finished feature frame (sorted by (gpu_uuid, ts); at least one part, possibly empty).

    Window and XID features are computed for chunks of whole GPUs of about `rows_per_chunk`
    grid rows at a time (all at once when None), which bounds the memory of their
    intermediate columns; peer features for all GPUs together (the fleet median needs them all).

    With `rows_per_part` set, the wide grid (every bucket statistic on every grid row) exists
    for one part of about that many grid rows at a time: which rows are emitted, their labels
    and the peer features (which need every GPU of a node and of the fleet at once) are decided
    first on a narrow grid of a few columns. A shard of a store build over a fleet of tens of
    thousands of GPUs carries a block of days and the eight before it; its wide grid alone would
    be several GB.

    `model_medians` (`features.peers.model_medians` of the whole fleet) is given when the
    buckets hold only a shard of the fleet; by default the fleet medians are the buckets' own.

    `rows` narrows the rows emitted to those asked for (`features.on_demand`): given the
    candidate rows' gpu_uuid, ts, label and time_to_failure_h, it returns which to keep. The
    window features are then computed at those rows only. `labels_only`: one part of the
    emitted rows' identity columns and labels, without any feature (the buckets need only
    gpu_uuid, ts, last_sample_ts and the identity columns). `part_threads`: parts computed at
    once (`in_order`), each holding its wide columns.

    `fail_slow_medians` (`features.fail_slow.model_clocks` of the whole fleet) is to the
    fail-slow features what `model_medians` is to the peer features; `fail_slow_clocks_only`:
    one frame of what they are taken over instead of features (`features.fail_slow.busy_clocks`
    of the rows in the emitted range), which a build in shards gathers from every shard first."""
    spec = spec or FeatureSpec()
    grid, max_silence = spec.grid, spec.max_silence
    data_end = utc(data_end)
    xid = prepare_xids(as_frame(xid_events))
    fixes = prepare_repairs(repairs)
    if presence is None:
        presence = _presence_from_buckets(hourly, grid)
    xid = resolve_xid_gpus(xid, presence)
    if episodes is None:
        episodes = failure_episodes(xid, presence, spec, data_end=data_end, repairs=fixes)
    first_seen = presence.group_by(GPU).agg(pl.col("first_ts").min())
    # A GPU seen before the frame's first bucket gets grid rows from there on, as in a build
    # over all history (`dense_grid`'s `starts`).
    frame_start = hourly["ts"].min() if hourly.height else None
    starts = (
        None
        if frame_start is None
        else first_seen.select(
            GPU,
            pl.max_horizontal(grid_time(pl.col("first_ts"), grid), pl.lit(frame_start, dtype=TS_DTYPE)).alias("_start"),
        )
    )

    whole = rows_per_part is None and not labels_only
    if whole:
        dense = dense_grid(hourly, grid, data_end=data_end, max_silence=max_silence, starts=starts)
        narrow = dense
    else:
        sfx = grid_suffix(grid)
        wanted = {GPU, "ts", "last_sample_ts", *BUCKET_ID_COLUMNS, *(f"{m}_mean{sfx}" for m in PEER_METRICS)}
        # Each grid row's bucket row (`_SOURCE`, null in an empty bucket): a part's wide grid is
        # then its narrow rows and the other columns gathered by it (`_wide_part`).
        narrow = dense_grid(
            hourly.select(c for c in hourly.columns if c in wanted).with_row_index(_SOURCE),
            grid,
            data_end=data_end,
            max_silence=max_silence,
            starts=starts,
        )
    # Which rows are emitted, and their labels, are decided on narrow columns first, so that the
    # wide feature columns are materialised once, for the emitted rows only.
    ts = narrow["ts"]
    emit = pl.repeat(True, narrow.height, eager=True)
    if emit_start is not None:
        emit &= ts >= utc(emit_start)
    if emit_end is not None:
        emit &= ts < utc(emit_end)
    facts = label_rows(narrow.select(GPU, "ts"), episodes, horizon=spec.horizon, data_end=data_end, repairs=fixes)
    silent = narrow.select((pl.col("ts") - pl.col("last_sample_ts")) > max_silence).to_series()
    keep = emit & facts["in_service"] & ~silent.fill_null(True)
    if rows is not None:
        asked = rows(pl.concat([narrow.select(GPU, "ts"), facts.select(LABEL_COLUMNS)], how="horizontal"))
        keep &= asked.fill_null(False)
    if labels_only:
        ids = narrow.filter(keep).select([c for c in ID_COLUMNS if c in narrow.columns])
        yield pl.concat([ids, facts.filter(keep).drop("in_service")], how="horizontal").select(
            *[
                pl.col(c).cast(ID_DTYPES[c]) if c in ids.columns else pl.lit(None, dtype=ID_DTYPES[c]).alias(c)
                for c in ID_COLUMNS
            ],
            *[pl.col(c).cast(LABEL_DTYPES[c]) for c in LABEL_COLUMNS],
        )
        return
    # The fail-slow features compare a GPU with the others at its grid time (its node's, its
    # model's), whichever rows are kept: computed on the narrow grid over the rows the peer
    # features compare (a failure recorded later changes labels, not another GPU's features),
    # and placed beside them.
    if fail_slow_clocks_only:
        stats = _fail_slow_stats(hourly, narrow, emit, first_seen, spec, whole=whole)
        label = spec.fail_slow_label
        yield (
            busy_clocks(stats, label) if stats is not None and label is not None else pl.DataFrame(schema=CLOCKS_SCHEMA)
        )
        return
    peers = peer_features(narrow.filter(emit), grid, medians=model_medians).filter(keep.filter(emit))
    slow = _fail_slow(hourly, narrow, emit, first_seen, spec, whole=whole, model_medians=fail_slow_medians)
    if slow is not None:
        peers = pl.concat([peers, slow.filter(keep.filter(emit)).drop(GPU, "ts")], how="horizontal")
    facts = facts.filter(keep).drop("in_service")
    if not whole and keep.any():
        # A GPU without a kept row was needed above (its labels, the fleet's peers), not below:
        # a day's 3% draw keeps a row of about half the GPUs.
        with_kept = _gpus_with_a_kept_row(narrow[GPU], keep)
        if not with_kept.all():
            narrow, keep = narrow.filter(with_kept), keep.filter(with_kept)
    # Kept rows before each grid row: where a part's rows start in `peers` and `facts`.
    kept_before = keep.cast(pl.Int64).cum_sum() - keep.cast(pl.Int64)

    parts = [(0, narrow.height)] if whole else gpu_slices(narrow[GPU], rows_per_part)
    # The window kernels read the bucket columns where they are, through each grid row's bucket
    # (`_wide_part`): the parts share the shard's buckets.
    buckets = None if whole else rolling.BucketArrays(hourly)
    # The parts with a kept row (the last one when none has: a part is always yielded).
    computed = [i for i, (offset, length) in enumerate(parts) if keep.slice(offset, length).any()] or [len(parts) - 1]

    def part_rows(i: int) -> pl.DataFrame:
        offset, length = parts[i]
        part_keep = keep.slice(offset, length)
        part_dense, source = (dense, None) if whole else _wide_part(hourly, narrow.slice(offset, length), spec.grid)
        first = int(kept_before[offset]) if length else 0
        n_kept = int(part_keep.sum())
        return _assemble(
            part_dense,
            part_keep,
            peers.slice(first, n_kept),
            facts.slice(first, n_kept),
            xid,
            first_seen,
            spec,
            rows_per_chunk=rows_per_chunk,
            buckets=buckets,
            source=source,
        )

    yield from in_order(part_rows, computed, threads=part_threads)


def _fail_slow(
    hourly: pl.DataFrame,
    narrow: pl.DataFrame,
    rows: pl.Series,
    first_seen: pl.DataFrame,
    spec: FeatureSpec,
    *,
    whole: bool,
    model_medians: pl.DataFrame | None,
) -> pl.DataFrame | None:
    """gpu_uuid, ts and the fail-slow features (`features.fail_slow`) of the spec's window at
    the rows of the grid `narrow` that `rows` selects, compared among those rows (the model
    peers' medians are `model_medians` when given: `features.fail_slow.model_clocks` of the
    whole fleet); None when the spec computes none or the buckets lack their telemetry."""
    stats = _fail_slow_stats(hourly, narrow, rows, first_seen, spec, whole=whole)
    label = spec.fail_slow_label
    if stats is None or label is None:
        return None
    values = fail_slow_features(stats, label, model_medians=model_medians)
    return stats.select(GPU, "ts").with_columns(
        pl.Series(name, values[name].to_numpy(), dtype=pl.Float64, nan_to_null=True).cast(FEATURE_DTYPE)
        for name in values.columns
    )


def _fail_slow_stats(
    hourly: pl.DataFrame,
    narrow: pl.DataFrame,
    rows: pl.Series,
    first_seen: pl.DataFrame,
    spec: FeatureSpec,
    *,
    whole: bool,
) -> pl.DataFrame | None:
    """The inputs of the fail-slow features (`features.fail_slow.needed_columns`) at the rows of
    `narrow` that `rows` selects, None without them. The window statistics are
    `window_features`' own, of the fail-slow metrics and window alone, of the features' type (the
    values the features frame holds): on `narrow` when it is the whole dense grid (`whole`), else
    read from the buckets through each grid row's bucket."""
    label = spec.fail_slow_label
    if label is None or spec.fail_slow_window is None:
        return None

    def wanted(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.select(bucket_columns(frame.columns))

    buckets: rolling.BucketArrays | None = None
    source: np.ndarray | None = None
    if whole:
        frame = wanted(narrow)
    else:
        frame, source = _wide_part(hourly, narrow, spec.grid)
        buckets = rolling.BucketArrays(wanted(hourly))
    stats = window_features(
        frame,
        spec.grid,
        (spec.fail_slow_window,),
        first_seen=first_seen,
        keep=rows,
        dtype=FEATURE_DTYPE,
        buckets=buckets,
        source=source,
    )
    ids = narrow.filter(rows).select(c for c in ("cluster", "node", "gpu_model") if c in narrow.columns)
    inputs = pl.concat([stats, ids], how="horizontal")
    return inputs if all(c in inputs.columns for c in needed_columns(label)) else None


def in_order(compute: Callable[[int], pl.DataFrame], items: Sequence[int], *, threads: int) -> Iterator[pl.DataFrame]:
    """`compute(i)` of each item, yielded in the items' order, `threads` computed at once on
    threads of their own (polars and the compiled kernels release the GIL; one part's Python
    glue and single-threaded kernels leave a core idle). No more than `threads` results are
    held before they are yielded, so memory grows with `threads` parts, not with all of them."""
    if threads <= 1 or len(items) <= 1:
        for i in items:
            yield compute(i)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="features-part") as pool:
        running: deque[Future[pl.DataFrame]] = deque()
        upcoming = iter(items)
        try:
            for i in islice(upcoming, threads):
                running.append(pool.submit(compute, i))
            while running:
                done = running.popleft().result()
                following = next(upcoming, None)
                if following is not None:
                    running.append(pool.submit(compute, following))
                yield done
        finally:
            # A reader that stops early (or an error) leaves no part being computed for nothing.
            for future in running:
                future.cancel()


def _gpus_with_a_kept_row(gpus: pl.Series, keep: pl.Series) -> pl.Series:
    """Per row of a grid sorted by GPU, whether its GPU has a row that `keep` keeps."""
    run = gpus.rle_id().to_numpy()
    kept_per_gpu = np.bincount(run, weights=keep.cast(pl.Float64).to_numpy()) > 0
    return pl.Series(kept_per_gpu[run])


def _wide_part(hourly: pl.DataFrame, narrow: pl.DataFrame, grid: timedelta) -> tuple[pl.DataFrame, np.ndarray]:
    """The dense grid (`dense_grid`) of the buckets of the GPUs of `narrow`, a slice of whole
    GPUs of the narrow grid, and per grid row the row of `hourly` it came from (-1 for an empty
    bucket). Its rows and the columns it carries forward are the narrow grid's (both
    depend on each GPU's own buckets alone); the few columns `window_features` reads from the
    grid frame (`grid_frame_columns`) are gathered by that row, null in an empty bucket, and its
    kernels read the others from the buckets through it. Filtering the buckets of a part and
    joining them to its grid again took most of a read of the newest hour; gathering every column
    onto the grid took a fifth of it."""
    source = narrow[_SOURCE]
    other = [c for c in grid_frame_columns(grid) if c in hourly.columns and c not in narrow.columns]
    gathered = hourly.select(other).select(pl.all().gather(source))  # one column per thread
    frame = pl.concat([narrow.drop(_SOURCE), gathered], how="horizontal")
    rows = source.cast(pl.Int64).fill_null(-1).to_numpy()
    return frame.select(c for c in hourly.columns if c in frame.columns), rows


def _assemble(
    dense: pl.DataFrame,
    keep: pl.Series,
    peers: pl.DataFrame,
    facts: pl.DataFrame,
    xid: pl.DataFrame,
    first_seen: pl.DataFrame,
    spec: FeatureSpec,
    *,
    rows_per_chunk: int | None,
    buckets: rolling.BucketArrays | None = None,
    source: np.ndarray | None = None,
) -> pl.DataFrame:
    """The feature frame of the kept rows of `dense` (whole GPUs): window and XID features in
    chunks of whole GPUs, beside the identity columns, the peer features and the labels.
    `buckets`, `source`: where the window kernels read their columns (`window_features`)."""
    pieces: list[pl.DataFrame] = []
    for offset, length in gpu_slices(dense[GPU], rows_per_chunk):
        part, part_keep = dense.slice(offset, length), keep.slice(offset, length)
        keys = part.select(GPU, "ts")
        wf = window_features(
            part,
            spec.grid,
            spec.windows,
            first_seen=first_seen,
            keep=part_keep,
            dtype=FEATURE_DTYPE,
            buckets=buckets,
            source=None if source is None else source[offset : offset + length],
        )
        chunk_xid = xid.join(keys.select(GPU).unique(), on=GPU, how="semi")
        xf = xid_features(
            keys,
            chunk_xid,
            spec.grid,
            spec.windows,
            since_cap=spec.xid_since_cap,
            keep=part_keep,
            dtype=FEATURE_DTYPE,
        )
        pieces.append(pl.concat([wf, xf.drop(GPU, "ts")], how="horizontal"))
    features = pl.concat(pieces, how="vertical") if len(pieces) > 1 else pieces[0]
    ids = dense.filter(keep).select([c for c in ID_COLUMNS if c in dense.columns])
    # The parts have the rows of `dense` in its order (checked: a silent misalignment would be the
    # worst kind of bug), so they are placed side by side.
    for frame in (features, peers):
        if not frame.select(GPU, "ts").equals(ids.select(GPU, "ts")):
            raise AssertionError("feature frames are not aligned with the grid; this is a bug in features")
    if facts.height != ids.height:
        raise AssertionError("labels are not aligned with the grid; this is a bug in features")
    frame = pl.concat(
        [ids, features.drop(GPU, "ts"), peers.drop(GPU, "ts"), facts],
        how="horizontal",
    )
    names = [c for c in frame.columns if c not in ID_COLUMNS and c not in LABEL_COLUMNS]
    return frame.select(
        *[
            pl.col(c).cast(ID_DTYPES[c]) if c in frame.columns else pl.lit(None, dtype=ID_DTYPES[c]).alias(c)
            for c in ID_COLUMNS
        ],
        *[pl.col(c).cast(FEATURE_DTYPE) for c in names],
        *[pl.col(c).cast(LABEL_DTYPES[c]) for c in LABEL_COLUMNS],
    )  # sorted by (gpu_uuid, ts): the order of the dense grid
