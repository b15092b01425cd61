"""Features of telemetry sent in a request (`POST /v1/predict` with raw telemetry), computed as
the store computes them for the GPUs the store knows.

A request carries a few days of a node's samples and XID events; the store's row of the same
GPU-hour also sees the fleet and the GPU's whole history. Three kinds of feature depend on
those (`FLEET_FACT_FEATURES`), and for a GPU the store knows they are taken from the store's
fleet facts (`features.on_demand.stored_fleet_facts`, the ones its own rows are computed with):

- `gpu_age_h`: from the GPU's first sample in the store (not the request's first);
- the XID features (the hours since the last event of each class, the counts in each window):
  from the store's events of the GPU together with the request's (an event in both counts once);
- `<m>_model_delta_<g>`: against the fleet median of the GPU model at that grid time, from every
  GPU's buckets in the store (not the request's GPUs alone); likewise the fail-slow features
  that compare with the model peers (`sm_clock_model_deficit_<w>`, `fail_slow_score_<w>`:
  `features.fail_slow`), from every GPU's buckets of the fail-slow window.

Everything else is the GPU's own windows or its node's (`<m>_node_delta_<g>`: send a node's
GPUs together) and is computed from the request as the build computes it. For a GPU the store
does not know, or a grid time the store has no buckets of, the features above are the
request's alone, and `PayloadFeatures.payload_only` names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

import polars as pl

from features.aggregates import BUCKETS, read_buckets
from features.build import _presence_from_buckets, failure_episodes, features_from_buckets, iter_features_from_buckets
from features.fail_slow import (
    FAIL_SLOW_MODEL_PREFIXES,
    bucket_columns,
    fail_slow_columns,
    model_clocks,
    with_fleet_model_peers,
)
from features.inputs import prepare_repairs, prepare_xids, utc
from features.labels import GPU, resolve_xid_gpus
from features.peers import PEER_METRICS, model_column, model_deltas, model_medians
from features.plan import FleetFacts
from features.schema import TS_DTYPE
from features.spec import FeatureSpec
from features.windows import grid_suffix, hourly_aggregate
from ingest.store import Store

AGE_FEATURE = "gpu_age_h"


def xid_feature(name: str) -> bool:
    """Whether a feature column is one of the XID features (`features.xids`)."""
    return name.startswith("xid_")


def model_delta_feature(name: str) -> bool:
    """Whether a feature column compares the GPU with its model's fleet median (`features.peers`)."""
    return "_model_delta_" in name


def model_peer_feature(name: str) -> bool:
    """Whether a feature compares the GPU with its model's fleet (`features.peers`' model deltas,
    `features.fail_slow`'s model deficit and the score made with it)."""
    return model_delta_feature(name) or name.startswith(FAIL_SLOW_MODEL_PREFIXES)


def fleet_fact_feature(name: str) -> bool:
    """Whether a feature depends on the fleet or the GPU's history beyond a request's telemetry."""
    return name == AGE_FEATURE or xid_feature(name) or model_peer_feature(name)


@dataclass(frozen=True)
class PayloadFeatures:
    """The feature frame of a request's telemetry and, per GPU, the fleet-fact features of its
    newest row that come from the request alone (empty: all from the store's facts)."""

    frame: pl.DataFrame
    payload_only: dict[str, list[str]] = field(default_factory=dict)
    known: frozenset[str] = frozenset()
    """The GPUs the store knows."""


def payload_features(
    telemetry: pl.DataFrame, xid_events: pl.DataFrame, spec: FeatureSpec, store: Store | None
) -> PayloadFeatures:
    """The feature rows of `telemetry` and `xid_events` (a request's) built with `spec`, with
    the store's fleet facts for the GPUs and grid times it knows (module notes). Without a
    store, or with one that has no aggregates on `spec`'s grid, the request's alone."""
    tel = telemetry.with_columns(pl.col("ts").cast(TS_DTYPE))
    data_end = utc(tel["ts"].max())  # type: ignore[arg-type]
    hourly = hourly_aggregate(tel, spec.grid, max_gap=spec.max_silence)
    facts = _facts(store, spec)
    if store is None or facts is None:
        frame = features_from_buckets(hourly, xid_events, spec, data_end=data_end)
        return PayloadFeatures(frame, _all_payload_only(frame))
    sent = hourly.select(GPU).unique()
    stored_presence = facts.presence.join(sent, on=GPU, how="semi")
    known = frozenset(stored_presence[GPU].to_list())
    presence = _merged_presence(_presence_from_buckets(hourly, spec.grid), stored_presence)
    xid = _merged_xids(xid_events, presence, facts.xid.join(sent, on=GPU, how="semi"))
    repairs = prepare_repairs(facts.repairs)
    # Failure episodes: the store's for the GPUs it knows (its history: a repaired GPU is back in
    # service); the request's own events for the others.
    theirs = facts.episodes.join(sent, on=GPU, how="semi")
    unknown = presence.filter(~pl.col(GPU).is_in(list(known)))
    ours = failure_episodes(
        xid.filter(~pl.col(GPU).is_in(list(known))), unknown, spec, data_end=data_end, repairs=repairs
    )
    episodes = pl.concat([theirs, ours.select(theirs.columns)], how="vertical_relaxed") if ours.height else theirs
    frame = features_from_buckets(
        hourly, xid, spec, data_end=data_end, presence=presence, episodes=episodes, repairs=repairs
    )
    frame, stored_times = _with_fleet_model_deltas(frame, hourly, store, spec)
    frame, slow_times = _with_fleet_fail_slow(frame, store, spec, facts)
    return PayloadFeatures(frame, _payload_only(frame, known, stored_times, slow_times), known)


def _facts(store: Store | None, spec: FeatureSpec) -> FleetFacts | None:
    from features.aggregates import aggregates_spec
    from features.on_demand import stored_fleet_facts

    if store is None or not store.dates(BUCKETS):
        return None
    built = aggregates_spec(store)
    if built is None or (built.grid, built.max_silence) != (spec.grid, spec.max_silence):
        return None
    return stored_fleet_facts(store, spec)


def _merged_presence(sent: pl.DataFrame, stored: pl.DataFrame) -> pl.DataFrame:
    """The request's presence, each known GPU's first sample taken from the store when earlier."""
    first = stored.group_by(GPU).agg(pl.col("first_ts").min().alias("_stored_first"))
    return (
        sent.join(first, on=GPU, how="left")
        .with_columns(pl.min_horizontal("first_ts", "_stored_first").cast(sent.schema["first_ts"]).alias("first_ts"))
        .drop("_stored_first")
    )


def _merged_xids(sent: pl.DataFrame, presence: pl.DataFrame, stored: pl.DataFrame) -> pl.DataFrame:
    """The request's XID events (resolved to GPUs) and the store's of its GPUs, one row per event:
    an event both hold (same GPU, time and code) is the store's."""
    ours = resolve_xid_gpus(prepare_xids(sent), presence)
    if stored.height == 0:
        return ours
    both = pl.concat([stored, ours.select([c for c in stored.columns if c in ours.columns])], how="diagonal_relaxed")
    return both.unique(subset=[GPU, "ts", "xid"], keep="first", maintain_order=True)


def _with_fleet_model_deltas(
    frame: pl.DataFrame, hourly: pl.DataFrame, store: Store, spec: FeatureSpec
) -> tuple[pl.DataFrame, set[datetime]]:
    """`frame` with the GPU-model deltas of each GPU's newest row taken against the fleet
    medians of that grid time (`features.peers.model_medians` over every GPU's buckets in the
    store), where the store has buckets then; and those grid times."""
    sfx = grid_suffix(spec.grid)
    means = [f"{m}_mean{sfx}" for m in PEER_METRICS if f"{m}_mean{sfx}" in hourly.columns]
    if not means or frame.height == 0:
        return frame, set()
    newest = _newest(frame).select(GPU, "ts")
    parts = []
    for ts in sorted(newest["ts"].unique().to_list()):
        names = store.scan(BUCKETS, ts, ts + timedelta(microseconds=1)).collect_schema().names()
        wanted = [GPU, "ts", *(c for c in ("gpu_model",) if c in names), *(m for m in means if m in names)]
        if not set(means) <= set(wanted):
            continue
        fleet = read_buckets(store, ts - timedelta(microseconds=1), ts + timedelta(microseconds=1), columns=wanted)
        fleet = fleet.filter(pl.col("ts") == pl.lit(ts, dtype=TS_DTYPE))
        if fleet.height:
            parts.append(model_medians(fleet.select(GPU, "ts", model_column(fleet), *means), spec.grid))
    if not parts:
        return frame, set()
    medians = pl.concat(parts, how="vertical_relaxed")
    stored_times = {utc(t) for t in medians["ts"].unique().to_list()}
    rows = hourly.join(newest, on=[GPU, "ts"], how="semi").filter(pl.col("ts").is_in(medians["ts"].unique().implode()))
    deltas = model_deltas(rows.select(GPU, "ts", model_column(rows), *means), medians, spec.grid)
    columns = [c for c in deltas.columns if c not in (GPU, "ts")]
    patched = frame.join(deltas.rename({c: f"_fleet_{c}" for c in columns}), on=[GPU, "ts"], how="left")
    stored = pl.col("ts").is_in(medians["ts"].unique().implode())
    return (
        patched.with_columns(
            pl.when(stored).then(pl.col(f"_fleet_{c}")).otherwise(pl.col(c)).cast(frame.schema[c]).alias(c)
            for c in columns
        ).select(frame.columns),
        stored_times,
    )


def _with_fleet_fail_slow(
    frame: pl.DataFrame, store: Store, spec: FeatureSpec, facts: FleetFacts
) -> tuple[pl.DataFrame, set[datetime]]:
    """`frame` with the fail-slow features of each GPU's newest row taken against the fleet's
    model peers of that grid time (`features.fail_slow.model_clocks` of every GPU's buckets of
    the fail-slow window in the store, the rows the store's build compares),
    where the store has buckets then; and those grid times."""
    label, window = spec.fail_slow_label, spec.fail_slow_window
    if label is None or window is None or fail_slow_columns(label)[-1] not in frame.columns or frame.height == 0:
        return frame, set()
    parts = []
    for ts in sorted(_newest(frame)["ts"].unique().to_list()):
        names = store.scan(BUCKETS, ts - window, ts + timedelta(microseconds=1)).collect_schema().names()
        fleet = read_buckets(
            store, ts - window - spec.grid, ts + timedelta(microseconds=1), columns=bucket_columns(names)
        )
        if fleet.filter(pl.col("ts") == pl.lit(ts, dtype=TS_DTYPE)).height == 0:
            continue
        found = iter_features_from_buckets(
            fleet,
            facts.xid.head(0),
            spec,
            **facts.build_inputs(),
            emit_start=ts,
            emit_end=ts + spec.grid,
            fail_slow_clocks_only=True,
        )
        parts.append(next(found))
    if not parts:
        return frame, set()
    medians = model_clocks(parts)
    fleet_wide = with_fleet_model_peers(frame, label, medians)
    stored = pl.col("ts").is_in(medians["ts"].unique().implode())
    names = [c for c in fail_slow_columns(label) if model_peer_feature(c)]
    return (
        frame.with_columns(pl.when(stored).then(fleet_wide[c]).otherwise(pl.col(c)).alias(c) for c in names),
        {utc(t) for t in medians["ts"].unique().to_list()},
    )


def _newest(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.sort(GPU, "ts").group_by(GPU, maintain_order=True).last()


def _all_payload_only(frame: pl.DataFrame) -> dict[str, list[str]]:
    names = [c for c in frame.columns if fleet_fact_feature(c)]
    return {str(u): names for u in frame[GPU].unique().to_list()}


def _payload_only(
    frame: pl.DataFrame, known: frozenset[str], stored_times: set[datetime], slow_times: set[datetime]
) -> dict[str, list[str]]:
    """Per GPU, the fleet-fact features of its newest row computed from the request alone."""
    history = [c for c in frame.columns if c == AGE_FEATURE or xid_feature(c)]
    deltas = [c for c in frame.columns if model_delta_feature(c)]
    slow = [c for c in frame.columns if model_peer_feature(c) and not model_delta_feature(c)]
    out = {}
    for uuid, ts in _newest(frame).select(GPU, "ts").iter_rows():
        names = [] if uuid in known else list(history)
        if utc(ts) not in stored_times:
            names += deltas
        if utc(ts) not in slow_times:
            names += slow
        out[str(uuid)] = names
    return out
