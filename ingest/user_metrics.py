"""The user's own metrics, recorded in the data root so that every later command on it knows them.

A fleet's telemetry often has columns gpufail does not collect (a vendor's counters, DCGM
profiling fields, another device's attributes). The configuration declares them
(`[metrics.<name>]`, `gpufail.config.MetricSettings`); an importer records them here, in
`_state/metrics.json`, before it writes rows that carry them; `Store.open` puts the recorded ones
into the process's metric catalogue (`ingest.schema.use_user_metrics`). From then on they are
telemetry columns like gpufail's own: stored, range-checked, and turned into window features by
kind.

A name, once recorded, keeps its kind, unit and type: a redefinition is refused in one line, since
rows already stored were read in the old meaning. Its valid range and description may change (they
say how to check or describe new readings, not what stored ones mean). Telemetry files written
before a metric was declared lack its column and read it as missing (`ingest.schema.optional_columns`).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ingest.errors import InputError, StoreError
from ingest.journal import lock_path
from ingest.locking import exclusive_lock
from ingest.schema import Metric, MetricKind, use_user_metrics
from ingest.store import guarded

if TYPE_CHECKING:
    from ingest.store import Store

STATE_NAME = "metrics"
KINDS: tuple[MetricKind, ...] = ("gauge", "counter", "flag", "bitmask")

ARROW_TYPE_OF_KIND: dict[str, pa.DataType] = {
    "gauge": pa.float64(),
    "counter": pa.int64(),
    "flag": pa.int64(),
    "bitmask": pa.int64(),
}
"""Gauges are stored as float64; counters, flags and bitmasks as int64 (as gpufail's own)."""


def user_metric(
    name: str,
    kind: MetricKind,
    unit: str,
    *,
    valid_min: float | None = None,
    valid_max: float | None = None,
    description: str = "",
    dcgm_field: str | None = None,
) -> Metric:
    """A user metric as a catalogue entry. `dcgm_field`: the dcgm-exporter field name
    (`DCGM_FI_PROF_SM_ACTIVE`) whose samples `gpufail ingest dcgm-exporter` stores in it."""
    return Metric(
        column=name,
        kind=kind,
        arrow_type=ARROW_TYPE_OF_KIND[kind],
        unit=unit,
        nvml_field="",
        dcgm_field_id=-1,
        description=description or f"{name} (your metric, {unit})",
        valid_min=valid_min,
        valid_max=valid_max,
        user=True,
        dcgm_field=dcgm_field,
    )


def _to_json(metric: Metric) -> dict[str, Any]:
    return {
        "name": metric.column,
        "kind": metric.kind,
        "unit": metric.unit,
        "valid_min": metric.valid_min,
        "valid_max": metric.valid_max,
        "description": metric.description,
        "dcgm_field": metric.dcgm_field,
    }


def _from_json(entry: Any, where: str) -> Metric:
    try:
        if entry["kind"] not in KINDS:
            raise ValueError(f"unknown kind {entry['kind']!r}")
        return user_metric(
            str(entry["name"]),
            entry["kind"],
            str(entry["unit"]),
            valid_min=entry.get("valid_min"),
            valid_max=entry.get("valid_max"),
            description=str(entry.get("description") or ""),
            dcgm_field=entry.get("dcgm_field"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"{where}: unreadable metric entry {entry!r} ({exc}); expected name, kind and unit") from None


def recorded_metrics(store: Store) -> tuple[Metric, ...]:
    """The user metrics the data root records (none for a root that has none)."""
    state = store.read_state_raw(STATE_NAME)
    if state is None:
        return ()
    where = store.path("_state", f"{STATE_NAME}.json")
    entries = state.get("metrics")
    if not isinstance(entries, list):
        raise StoreError(f"{where}: corrupt metric record; expected a 'metrics' list")
    return tuple(_from_json(entry, where) for entry in entries)


def use_recorded_metrics(store: Store) -> None:
    """Make the root's recorded metrics the user's part of this process's catalogue."""
    use_user_metrics(recorded_metrics(store))


def record_metrics(store: Store, declared: tuple[Metric, ...]) -> tuple[Metric, ...]:
    """Add the `declared` metrics to the root's record and use the result; refuse, in one
    line naming the metric, a name the root already records with another kind or unit.
    Returns the metrics now recorded. Called by an importer before it writes rows.

    A write holds the record's lock (read, merge and write again under it): two imports
    declaring different metrics at once must both end up recorded, not the second overwriting
    the first. Nothing new to record takes no lock and writes nothing, so a read-only data root
    still works for everything it already records."""
    recorded = recorded_metrics(store)
    result = _merged(store, recorded, declared)
    if result == recorded:
        use_user_metrics(result)
        return result
    path = lock_path(store, STATE_NAME)
    with ExitStack() as held:
        with guarded("create the lock file", str(path)):
            lock = exclusive_lock(path, f"metric record of {store.root}", wait_s=RECORD_LOCK_WAIT_S, error=StoreError)
            held.enter_context(lock)
        # Read again under the lock: another import may have recorded a metric meanwhile.
        result = _merged(store, recorded_metrics(store), declared)
        use_user_metrics(result)  # refuses a clash with gpufail's own columns before anything is written
        store.write_state(STATE_NAME, {"metrics": [_to_json(m) for m in result]}, durable=True)
        return result


RECORD_LOCK_WAIT_S = 60.0
"""How long an import waits for another one updating the metric record (a read and a small write)."""


def _merged(store: Store, recorded: tuple[Metric, ...], declared: tuple[Metric, ...]) -> tuple[Metric, ...]:
    """The record with `declared` added (a known name's range and description replaced)."""
    merged = {m.column: m for m in recorded}
    for metric in declared:
        old = merged.get(metric.column)
        if old is not None and (old.kind, old.unit) != (metric.kind, metric.unit):
            raise InputError(
                f"[metrics.{metric.column}]: the data root {store.root} records it as a {old.kind} in "
                f"{old.unit!r}, the configuration says a {metric.kind} in {metric.unit!r}; stored readings "
                "keep their meaning, so give the new one another name (or use another data root)"
            )
        merged[metric.column] = metric
    return tuple(merged.values())
