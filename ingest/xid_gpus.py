"""Which GPU an XID event happened on: its (node, PCI bus id) slot looked up in telemetry.

A kernel-log line names the PCI slot, not the GPU; the GPU in a slot can change (a swap, a
reseat), so an event is matched with the GPU telemetry saw in that slot around the event's time.
pyarrow only: the collector, which maps the XIDs it reads before writing them, is installed
without the dataframe engines.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, time, timedelta
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from ingest.schema import normalise_pci_bus_id
from ingest.store import Store

# Telemetry is read this far around the events, first narrowly, then (only for events with no
# GPU seen before them) widely: see `map_to_gpus`.
TELEMETRY_LOOKBACKS = (timedelta(days=1), timedelta(days=30))
_SPAN_KEYS = ["node", "pci_bus_id", "gpu_index", "gpu_uuid"]


class Span(NamedTuple):
    """A GPU seen in one slot from `first` to `last`."""

    gpu_index: int | None
    gpu_uuid: str | None
    first: datetime
    last: datetime


Slot = tuple[str, str]
"""(node, canonical PCI bus id)."""


def map_to_gpus(store: Store, events: pa.Table, cluster: str) -> pa.Table:
    """Fill `gpu_index` and `gpu_uuid` of `xid_events` rows from the store's telemetry.

    For an event at time t on (node, bus id): the GPU whose observed span on that slot contains
    t, else the one seen last before t, else the first one seen after t. A UUID already on the
    row (from the driver's `GPU at PCI` banner) wins over telemetry's; its index is then the
    index telemetry gives that UUID on the node, if any. Rows with no GPU keep nulls.

    Telemetry is read within a day of the events first; only events that found no GPU seen
    before them read further back (`TELEMETRY_LOOKBACKS`), so a run over a few new minutes of
    logs reads a few days of telemetry, not the fleet's history.
    """
    if events.num_rows == 0 or not store.exists("telemetry"):
        return events
    nodes = events["node"].to_pylist()
    buses = events["pci_bus_id"].to_pylist()
    times = events["ts"].to_pylist()
    best: dict[int, tuple[int, Span]] = {}
    spans: dict[Slot, list[Span]] = {}
    todo = list(range(events.num_rows))
    for lookback in TELEMETRY_LOOKBACKS:
        if not todo:
            break
        start = min(times[i] for i in todo) - lookback
        end = max(times[i] for i in todo) + lookback
        spans = telemetry_spans(store, cluster, sorted({nodes[i] for i in todo}), start, end)
        for row in todo:
            found = pick_gpu(spans.get((nodes[row], buses[row]), []), times[row])
            if found is not None:
                best[row] = found
        todo = [row for row in todo if best.get(row, (2,))[0] >= 2]  # nothing seen before the event
    index_of_uuid = {
        (node, span.gpu_uuid): span.gpu_index
        for (node, _), slot_spans in spans.items()
        for span in sorted(slot_spans, key=lambda s: s.last)  # the latest sighting wins
    }
    uuids = events["gpu_uuid"].to_pylist()
    index_out: list[int | None] = []
    uuid_out: list[str | None] = []
    for row in range(events.num_rows):
        picked = best[row][1] if row in best else None
        uuid = uuids[row] if uuids[row] is not None else picked.gpu_uuid if picked else None
        by_uuid = index_of_uuid.get((nodes[row], uuids[row])) if uuids[row] is not None else None
        index_out.append(by_uuid if by_uuid is not None else picked.gpu_index if picked else None)
        uuid_out.append(uuid)
    for name, values in (("gpu_index", index_out), ("gpu_uuid", uuid_out)):
        field = events.schema.field(name)
        events = events.set_column(events.schema.get_field_index(name), field, pa.array(values, field.type))
    return events


def pick_gpu(candidates: list[Span], ts: datetime) -> tuple[int, Span] | None:
    """The best GPU of a slot for an event at `ts`, with its rank: 0 = its span contains `ts`
    (latest start first), 1 = seen before `ts` (latest last sighting first), 2 = seen after
    `ts` (earliest first). None when the slot has no GPU at all."""
    ranked = []
    for span in candidates:
        if span.first <= ts <= span.last:
            ranked.append((0, ts - span.first, span))
        elif span.last < ts:
            ranked.append((1, ts - span.last, span))
        else:
            ranked.append((2, span.first - ts, span))
    if not ranked:
        return None
    rank, _, span = min(ranked, key=lambda r: (r[0], r[1]))
    return rank, span


def telemetry_spans(
    store: Store, cluster: str, nodes: list[str], start: datetime, end: datetime
) -> dict[Slot, list[Span]]:
    """First and last time each GPU was seen in each slot of `nodes` (telemetry rows of
    `cluster` in [start, end)), by slot.

    Read one daily partition at a time and folded into the running spans, so memory holds one
    day of telemetry plus one entry per GPU and slot, however long the range."""
    folded: dict[tuple[str, str, int | None, str | None], list[datetime]] = {}
    wanted = pa.array(sorted(set(nodes)), pa.string())
    where = (pc.field("cluster") == cluster) & pc.field("node").isin(wanted) & pc.field("pci_bus_id").is_valid()
    canonical: dict[str, str | None] = {}
    for day in store.dates("telemetry", start, end):
        day_start = datetime.combine(day, time(), UTC)
        lo, hi = max(start, day_start), min(end, day_start + timedelta(days=1))
        rows = store.read("telemetry", lo, hi, columns=["ts", *_SPAN_KEYS], filter=where)
        day_spans = rows.group_by(_SPAN_KEYS, use_threads=False).aggregate([("ts", "min"), ("ts", "max")])
        for node, raw_bus, index, uuid, first, last in zip(
            *(day_spans[c].to_pylist() for c in [*_SPAN_KEYS, "ts_min", "ts_max"]), strict=True
        ):
            # Telemetry should already hold the canonical form; normalising the few distinct
            # values costs nothing and makes a lookup with a differently written id impossible
            # to miss. Two spellings of one slot become one span.
            if raw_bus not in canonical:
                canonical[raw_bus] = _normalise_or_none(raw_bus)
            bus = canonical[raw_bus]
            if bus is None:
                continue
            key = (node, bus, index, uuid)
            seen = folded.get(key)
            folded[key] = [first, last] if seen is None else [min(seen[0], first), max(seen[1], last)]
    spans: dict[Slot, list[Span]] = defaultdict(list)
    for (node, bus, index, uuid), (first, last) in folded.items():
        spans[(node, bus)].append(Span(index, uuid, first, last))
    return dict(spans)


def _normalise_or_none(raw: str) -> str | None:
    try:
        return normalise_pci_bus_id(raw)
    except ValueError:
        return None
