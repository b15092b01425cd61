"""Feature rows computed when asked, from the stored aggregates (`features.aggregates`).

One function serves every reader (`features_on_demand`, or `iter_features_on_demand` a part at a
time): the rows with start <= ts < end, optionally only those a `rows` predicate keeps (the
training draw, given (ts, gpu_uuid) keys). It runs the features build's own second half,
`features.build.iter_features_from_buckets`, on the stored buckets of the range and the
`lookback` before it, with the fleet facts the build uses (`features.plan.fleet_facts`: GPU
presence, XID events resolved to GPUs, repairs, failure episodes), so a row equals the row a
materialised build (`features.runner`) writes for it. A window's value depends on the buckets of
the window alone, to the last bit (`features.rolling`), so a range reads only its own buckets and
the lookback before it, and a row is the same in every query that computes it.

Memory stays bounded as in the build: the range is computed in time blocks of `block_days` days
from its start, each block's fleet in shards of whole nodes when its buckets exceed
`max_buckets_in_memory` (the fleet median per GPU model is computed from every GPU's bucket means
first), and the wide columns for parts of whole GPUs (`rows_per_part`).

Only the rows asked for get window features: the emitted rows, their labels and the peer
features are decided on a narrow grid first, and the running sums are read at the kept rows
(`features.rolling`), so the newest hour of a fleet costs one pass over its last week of
buckets, and a 10% draw of a month a pass over the month.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, timedelta

import polars as pl

from features import facts_cache, newest_cache
from features.aggregates import BUCKETS, MANIFEST, PRESENCE, aggregates_spec, read_buckets, read_presence
from features.build import iter_features_from_buckets
from features.column_sort import sorted_column_by_column
from features.fail_slow import bucket_columns, model_clocks
from features.inputs import utc
from features.labels import GPU
from features.peers import PEER_METRICS, model_column, model_medians
from features.plan import ONE_DAY, FleetFacts, day_start, fleet_facts, lookback
from features.sample_key import SAMPLE_KEY, key_threshold, sample_keys
from features.schema import ID_COLUMNS, LABEL_COLUMNS, TS_DTYPE
from features.shards import NODE, SHARD, shard_count, shard_map
from features.spec import FeatureSpec
from features.windows import BUCKET_ID_COLUMNS, aggregated_metrics, grid_floor, grid_suffix
from ingest.errors import InputError
from ingest.schema import telemetry_schema
from ingest.store import Store

RowFilter = Callable[[pl.DataFrame], pl.Series]
"""Given candidate rows (gpu_uuid, ts, label, time_to_failure_h), which of them to compute."""


@dataclass(frozen=True, kw_only=True)
class OnDemandOptions:
    """How features are computed on demand: memory bounds only, never a value."""

    block_days: int | None = None
    """Days computed together: their lookback is read once per block. None: the longest
    whole days whose buckets, lookback included, the whole fleet holds within
    `max_buckets_in_memory` (the range's files are then read once, without shards); when not
    even a day fits, three lookbacks long, read in shards (`block_length`)."""
    max_buckets_in_memory: int = 2_000_000
    """Buckets (a block and its lookback) of one shard of whole nodes held at once. A shard
    decodes only the row groups of its nodes (the bucket files are in node order,
    `features.aggregates`), so more shards cost little: on the paper fleet, a day's draw took
    the same 24 s with 2M as with 4M, and peaked at 4.9 GB instead of 8.1."""
    rows_per_chunk: int = 250_000
    rows_per_part: int | None = 500_000
    part_threads: int = 2
    """Parts of whole GPUs computed at once, on threads (`features.build.in_order`); each holds
    its wide columns."""

    def __post_init__(self) -> None:
        if self.block_days is not None and self.block_days < 1:
            raise ValueError(f"block_days: expected at least 1, got {self.block_days}")


def drawn(negative_fraction: float) -> RowFilter:
    """The training draw: every positive, and the negatives whose stored key
    (`features.sample_key`) is below the threshold of `negative_fraction`."""
    threshold = key_threshold(negative_fraction)

    def keep(rows: pl.DataFrame) -> pl.Series:
        label = rows["label"]
        return ((label == 1) | ((label == 0) & key_below(rows, threshold))).fill_null(False)

    return keep


def key_below(rows: pl.DataFrame, threshold: int) -> pl.Series:
    """Whether each row's stored training key (`features.sample_key`) is below `threshold`."""
    return pl.Series(sample_keys(rows[GPU], rows["ts"])).cast(pl.Int64) < threshold


def labelled() -> RowFilter:
    """Rows with a label (censored rows left out)."""
    return lambda rows: rows["label"].is_not_null()


def at_keys(wanted: pl.DataFrame) -> RowFilter:
    """The rows whose (ts, gpu_uuid) are in `wanted`."""
    marked = wanted.select(GPU, pl.col("ts").cast(TS_DTYPE)).unique().with_columns(pl.lit(True).alias("_wanted"))

    def keep(rows: pl.DataFrame) -> pl.Series:
        found = rows.select(GPU, "ts").join(marked, on=[GPU, "ts"], how="left", maintain_order="left")
        return found["_wanted"].fill_null(False)

    return keep


# -- fleet facts, once per state of the small datasets ---------------------------------------

XID_EVENTS = "xid_events"
FACT_SOURCES = (PRESENCE, XID_EVENTS, "repairs", "failure_events")
"""The datasets the fleet facts are computed from."""
_FACTS: dict[tuple[object, ...], FleetFacts] = {}
_FACTS_LOCK = threading.Lock()
_FACTS_KEPT = 4


def stored_fleet_facts(store: Store, spec: FeatureSpec) -> FleetFacts | None:
    """`features.plan.fleet_facts` from the stored presence (None: nothing stored). Kept for the
    files they come from (files are written once and replaced, never changed, so the same files
    give the same facts): in memory, and on disk for the next process (`features.facts_cache`)."""
    files = {d: store.files(d) for d in FACT_SOURCES}
    key = (store.root, spec.fingerprint, *(tuple(f) for f in files.values()))
    with _FACTS_LOCK:
        if key in _FACTS:
            return _FACTS[key]
    disk_key = facts_cache.facts_key(store, spec, files)
    facts = facts_cache.load_facts(store, disk_key)
    if facts is None:
        presence = read_presence(store)
        if presence.height == 0:
            return None
        facts = fleet_facts(store, spec, presence)
        facts_cache.save_facts(store, disk_key, facts)
    with _FACTS_LOCK:
        while len(_FACTS) >= _FACTS_KEPT:
            _FACTS.pop(next(iter(_FACTS)))
        _FACTS[key] = facts
    return facts


def missing_days(store: Store) -> list[date]:
    """The days of telemetry before the newest built day that the stored aggregates have not
    built (days after it are not built yet: the features are those of the data as it was)."""
    built = {date.fromisoformat(d) for d in (store.read_state(MANIFEST) or {}).get("days", {})}
    newest = max(built, default=None)
    return [d for d in store.dates("telemetry") if newest is not None and d < newest and d not in built]


def on_demand_spec(store: Store) -> FeatureSpec:
    """The spec the stored aggregates were built with; an `InputError` when there are none, or
    when they miss days of the telemetry before their newest (the fleet facts need every day's
    presence: a GPU's age, its failures)."""
    spec = aggregates_spec(store)
    if spec is None:
        raise InputError(
            f"{store.root}: no stored aggregates to compute features from; run `gpufail features "
            f"--data {store.root}` first"
        )
    missing = missing_days(store)
    if missing:
        raise InputError(
            f"{store.path(BUCKETS)}: the stored aggregates lack {len(missing)} days of telemetry "
            f"({missing[0]}..{missing[-1]}); run `gpufail features --data {store.root}` to build them"
        )
    return spec


def iter_features_on_demand(
    store: Store,
    start: datetime | None = None,
    end: datetime | None = None,
    *,
    spec: FeatureSpec | None = None,
    rows: RowFilter | None = None,
    sample_key: bool = False,
    labels_only: bool = False,
    ids: bool = True,
    options: OnDemandOptions | None = None,
) -> Iterator[pl.DataFrame]:
    """The feature rows (`features.schema`) with start <= ts < end (default: all the data) that
    `rows` keeps (default: all), computed from the stored aggregates, in parts of whole GPUs of
    one time block (each sorted by (gpu_uuid, ts)); with `sample_key`, each row's stored training
    key (`features.sample_key.SAMPLE_KEY`) too. `spec`: the spec to compute with (default: the
    one the aggregates were built with; its grid and silence must be theirs). `labels_only`: the
    rows' identity columns and labels alone, from a few columns of the buckets; without `ids`,
    the identity columns other than gpu_uuid and ts are null (and not read: the readers that
    count or draw rows by their labels need none of them)."""
    recorded = on_demand_spec(store)
    spec = spec or recorded
    if (spec.grid, spec.max_silence) != (recorded.grid, recorded.max_silence):
        raise InputError(
            f"{store.path(BUCKETS)}: the stored aggregates are on grid {recorded.grid} with silence "
            f"{recorded.max_silence}; features with grid {spec.grid} and silence {spec.max_silence} need "
            "them rebuilt (gpufail features --overwrite)"
        )
    options = options or OnDemandOptions()
    facts = stored_fleet_facts(store, spec)
    if facts is None:
        return
    first = day_start(facts.first_data)
    last = grid_floor(facts.data_end, spec.grid) + timedelta(microseconds=1)
    begin = max(utc(start), first) if start is not None else first
    finish = min(utc(end), last) if end is not None else last
    if begin >= finish:
        return
    back = lookback(spec)
    step = block_length(facts, spec, options, (begin, finish))
    # Blocks bound memory only: a row's value depends on the buckets of its windows alone
    # (`features.rolling`), so any block, and any range, gives it to the last bit.
    block_start = begin
    while block_start < finish:
        block = (block_start, min(finish, block_start + step))
        if labels_only:
            parts = _labels(store, spec, facts, block, back, rows, options, ids=ids)
        else:
            parts = _block(store, spec, facts, block, back, rows, options)
        for part in parts:
            if sample_key:
                part = part.with_columns(pl.Series(SAMPLE_KEY, sample_keys(part[GPU], part["ts"])))
            yield part
        block_start = block[1]


def block_length(
    facts: FleetFacts, spec: FeatureSpec, options: OnDemandOptions, span: tuple[datetime, datetime] | None = None
) -> timedelta:
    """How long the time blocks of a computation of `span` (None: the whole history) are
    (`OnDemandOptions.block_days`): as many days as the buckets of the GPUs reporting in it
    fit the budget. A fleet too large to hold even a day and its lookback is read in shards
    of whole nodes (each reads only its nodes' row groups), in blocks of three lookbacks: a
    block computes its lookback's rows again, so a block as long as the lookback computed
    every row twice. The paper fleet's 21-day draw at 10% took 114-125 s in one 21-day block
    against 153 s in blocks of 7 days, back to back, at a 0.5 GB higher peak (the block's rows
    are held at once)."""
    if options.block_days is not None:
        return options.block_days * ONE_DAY
    back = lookback(spec)
    present = facts.presence if span is None else reporting(facts, spec, span[0] - back, span[1])
    gpus = max(1, present[GPU].n_unique())
    fits = (options.max_buckets_in_memory // gpus) * spec.grid - back
    if fits >= ONE_DAY:
        return (fits // ONE_DAY) * ONE_DAY
    return max(ONE_DAY, 3 * -(-back // ONE_DAY) * ONE_DAY)


def features_on_demand(
    store: Store,
    start: datetime | None = None,
    end: datetime | None = None,
    *,
    spec: FeatureSpec | None = None,
    rows: RowFilter | None = None,
    sample_key: bool = False,
    labels_only: bool = False,
    ids: bool = True,
    options: OnDemandOptions | None = None,
) -> pl.DataFrame:
    """`iter_features_on_demand` as one frame sorted by (ts, gpu_uuid) (`read_features`' order)."""
    parts = list(
        iter_features_on_demand(
            store,
            start,
            end,
            spec=spec,
            rows=rows,
            sample_key=sample_key,
            labels_only=labels_only,
            ids=ids,
            options=options,
        )
    )
    if not parts:
        frame = empty_on_demand(store, spec)
        if labels_only:
            frame = frame.select(*ID_COLUMNS, *LABEL_COLUMNS)
        return frame.with_columns(pl.lit(None, dtype=pl.UInt32).alias(SAMPLE_KEY)) if sample_key else frame
    frame = pl.concat(parts, how="vertical")
    parts.clear()  # the frame's columns are then their only holders, let go of one by one as sorted
    return sorted_column_by_column(frame, ["ts", GPU])


def empty_on_demand(store: Store, spec: FeatureSpec | None = None) -> pl.DataFrame:
    """A zero-row frame with the columns on-demand rows of this store have: those of a build over
    the telemetry columns the buckets were aggregated from."""
    from features.build import empty_features

    spec = spec or on_demand_spec(store)
    names = store.scan(BUCKETS).collect_schema().names() if store.dates(BUCKETS) else []
    kinds = aggregated_metrics(names, spec.grid)
    columns = [c for c in ID_COLUMNS if c in names] + [m for ms in kinds.values() for m in ms]
    return empty_features(columns or telemetry_schema().names, spec)


def newest_on_demand(store: Store, *, spec: FeatureSpec | None = None) -> pl.DataFrame:
    """The rows of the newest grid time that has rows (what scoring the fleet now needs): the
    last grid time at or before the data end, or, when every GPU is out of service or silent
    there, the one before (up to the longest lookback). Kept on disk for the next process that
    asks while the store has not changed (`features.newest_cache`)."""
    recorded = spec or on_demand_spec(store)
    key = newest_cache.rows_key(store, recorded, FACT_SOURCES)
    cached = newest_cache.load_rows(store, key)
    if cached is not None:
        return cached
    rows = _newest_computed(store, recorded, spec)
    if rows.height:
        newest_cache.save_rows(store, key, rows)
    return rows


def _newest_computed(store: Store, recorded: FeatureSpec, spec: FeatureSpec | None) -> pl.DataFrame:
    """`newest_on_demand`'s rows, computed (`recorded`: the spec in use; `spec`: as asked)."""
    facts = stored_fleet_facts(store, recorded)
    if facts is None:
        return empty_on_demand(store, spec)
    newest = grid_floor(facts.data_end, recorded.grid)
    rows = features_on_demand(store, newest, newest + timedelta(microseconds=1), spec=spec)
    if rows.height:
        return rows
    # No row there: the latest grid time with rows is found from the labels alone (a few bucket
    # columns, one pass over the lookback) rather than by computing every earlier hour in turn.
    span = features_on_demand(store, newest - lookback(recorded), newest, spec=spec, labels_only=True, ids=False)
    if span.height == 0:
        return empty_on_demand(store, spec)
    last: datetime = span["ts"].max()  # type: ignore[assignment]
    return features_on_demand(store, last, last + timedelta(microseconds=1), spec=spec)


_LABEL_KEY_COLUMNS = [GPU, "ts", "last_sample_ts"]
"""The bucket columns a row's labels need."""
_LABEL_BUCKET_COLUMNS = [*_LABEL_KEY_COLUMNS, *BUCKET_ID_COLUMNS]


def _labels(
    store: Store,
    spec: FeatureSpec,
    facts: FleetFacts,
    block: tuple[datetime, datetime],
    back: timedelta,
    rows: RowFilter | None,
    options: OnDemandOptions,
    *,
    ids: bool = True,
) -> Iterator[pl.DataFrame]:
    """The identity columns (without `ids`: gpu_uuid and ts alone, the others null) and labels
    of the rows of one time block, from a few columns of its buckets and those of its lookback,
    shard by shard (a label is its GPU's alone)."""
    start, end = block
    names = set(store.scan(BUCKETS, start - back, end).collect_schema().names())
    wanted = _LABEL_BUCKET_COLUMNS if ids else _LABEL_KEY_COLUMNS
    columns = [c for c in wanted if c in names]
    # The same budget of buckets as the features: the labels' grid holds every grid row of its
    # GPUs, so a large fleet's block at once took more than twice the memory, and no less time.
    shards = _node_shards(facts, spec, block, back, options.max_buckets_in_memory)
    for hourly in _shards_of(store, shards, block, back, columns=columns):
        yield from iter_features_from_buckets(
            hourly,
            facts.xid.head(0),
            spec,
            **facts.build_inputs(),
            emit_start=start,
            emit_end=end,
            rows=rows,
            labels_only=True,
        )


def reporting(facts: FleetFacts, spec: FeatureSpec, start: datetime, end: datetime) -> pl.DataFrame:
    """The presence of the GPUs with a bucket in [start, end): those a read of that range holds.
    Counting the GPUs of the whole history instead would weigh the paper fleet's 4,400 replaced
    GPUs against the budget of a read of the newest hour: four shards instead of three."""
    return facts.presence.filter(
        (pl.col("last_ts") > pl.lit(start - spec.grid, dtype=TS_DTYPE))
        & (pl.col("first_ts") < pl.lit(end, dtype=TS_DTYPE))
    )


def _node_shards(
    facts: FleetFacts, spec: FeatureSpec, block: tuple[datetime, datetime], back: timedelta, max_buckets: int
) -> pl.DataFrame:
    """`features.shards.shard_map` of the GPUs that report in one time block or its lookback."""
    start, end = block
    present = reporting(facts, spec, start - back, end)
    return shard_map(present, gpu_buckets=(end - start + back) // spec.grid, max_buckets=max_buckets)


def _shards_of(
    store: Store,
    shards: pl.DataFrame,
    block: tuple[datetime, datetime],
    back: timedelta,
    *,
    columns: list[str] | None = None,
) -> Iterator[pl.DataFrame]:
    """The buckets (`columns`) of one time block and its lookback, shard by shard of `shards`
    (`_node_shards`; the whole fleet at once when there is one)."""
    start, end = block
    count = shard_count(shards)
    # The reader filters on the node's name (a filter on (cluster, node) pairs was slower than
    # the join); only where a name is a node in two clusters does a shard need the exact join
    # after it, a copy of all its buckets.
    names_unique = shards["node"].n_unique() == shards.height
    for shard in range(count):
        where = None
        nodes = None
        if count > 1:
            nodes = shards.filter(pl.col(SHARD) == shard).select(NODE)
            where = pl.col("node").is_in(nodes["node"].unique().implode())
        exact = nodes if nodes is not None and not names_unique else None
        # The join needs the node's cluster and name, read for it where `columns` lack them.
        added = [c for c in NODE if exact is not None and columns is not None and c not in columns]
        hourly = read_buckets(
            store, start - back, end, columns=None if columns is None else [*columns, *added], where=where
        )
        if exact is not None:
            hourly = hourly.join(exact, on=NODE, how="semi", nulls_equal=True).drop(added)
        if hourly.height:
            yield hourly


def _block(
    store: Store,
    spec: FeatureSpec,
    facts: FleetFacts,
    block: tuple[datetime, datetime],
    back: timedelta,
    rows: RowFilter | None,
    options: OnDemandOptions,
) -> Iterator[pl.DataFrame]:
    """The parts of the rows of one time block: the block's buckets from its lookback on,
    shard by shard."""
    start, end = block
    shards = _node_shards(facts, spec, block, back, options.max_buckets_in_memory)
    count = shard_count(shards)
    medians = None
    if count > 1:
        # Every GPU's bucket means in the block: the fleet median per GPU model of each time.
        sfx = grid_suffix(spec.grid)
        names = store.scan(BUCKETS, start, end).collect_schema().names()
        means = [f"{m}_mean{sfx}" for m in PEER_METRICS if f"{m}_mean{sfx}" in names]
        wanted = [GPU, "ts", *(c for c in ("gpu_model",) if c in names), *means]
        fleet = read_buckets(store, start - timedelta(microseconds=1), end, columns=wanted)
        medians = (
            model_medians(fleet.select(GPU, "ts", model_column(fleet), *means), spec.grid) if fleet.height else None
        )
    # The incidents a row of the block can see: its windows' (up to the lookback) and, for the
    # hours since the last one, the cap's; the rest of the history changes no value.
    seen = max(spec.xid_since_cap, back) + spec.grid
    recent = facts.xid.filter(pl.col("last_ts") >= pl.lit(start - seen, dtype=TS_DTYPE))
    slow = None
    if count > 1 and spec.fail_slow_label is not None:
        # The fail-slow model peers are the fleet's too: every shard's busy clocks first, read
        # from the few bucket columns they need.
        columns = bucket_columns(store.scan(BUCKETS, start - back, end).collect_schema().names())
        clocks = [
            next(
                iter_features_from_buckets(
                    hourly,
                    recent.join(hourly.select(GPU).unique(), on=GPU, how="semi"),
                    spec,
                    **facts.build_inputs(),
                    emit_start=start,
                    emit_end=end,
                    rows_per_part=options.rows_per_part,
                    fail_slow_clocks_only=True,
                )
            )
            for hourly in _shards_of(store, shards, block, back, columns=columns)
        ]
        slow = model_clocks(clocks)
    for hourly in _shards_of(store, shards, block, back):
        if count == 1:
            within = pl.col("ts").is_between(pl.lit(start, dtype=TS_DTYPE), pl.lit(end, dtype=TS_DTYPE))
            in_block = hourly.filter(within)
            medians = model_medians(in_block, spec.grid) if in_block.height else None
        xid = recent if count == 1 else recent.join(hourly.select(GPU).unique(), on=GPU, how="semi")
        for part in iter_features_from_buckets(
            hourly,
            xid,
            spec,
            **facts.build_inputs(),
            emit_start=start,
            emit_end=end,
            rows_per_chunk=options.rows_per_chunk,
            rows_per_part=options.rows_per_part,
            model_medians=medians,
            fail_slow_medians=slow,
            rows=rows,
            part_threads=options.part_threads,
        ):
            if part.height:
                yield part
