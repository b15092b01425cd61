"""Tiny hand-made frames for the features tests (unit tests on in-memory data)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl

from features.schema import TS_DTYPE

# A grid time (midnight UTC): the hourly bucket labelled T0 + k h holds (T0 + (k-1) h, T0 + k h].
T0 = datetime(2026, 3, 2, tzinfo=UTC)
H = timedelta(hours=1)
MIN = timedelta(minutes=1)
US = timedelta(microseconds=1)


def at(hours: float = 0.0, minutes: float = 0.0, seconds: float = 0.0) -> datetime:
    return T0 + timedelta(hours=hours, minutes=minutes, seconds=seconds)


def samples(
    times: Sequence[datetime],
    *,
    gpu: str = "GPU-a",
    node: str = "n0",
    cluster: str = "c0",
    gpu_index: int = 0,
    pci_bus_id: str | None = None,
    gpu_model: str = "H100",
    driver: str = "550.54",
    **metrics: Any,
) -> pl.DataFrame:
    """Telemetry rows of one GPU at `times`; each metric is a scalar or a list (one per time).
    Gauges are Float32 and counters/flags Int64, as in `ingest.schema`."""
    n = len(times)
    cols: dict[str, Any] = {
        "ts": pl.Series(list(times), dtype=TS_DTYPE),
        "cluster": [cluster] * n,
        "node": [node] * n,
        "gpu_index": pl.Series([gpu_index] * n, dtype=pl.Int16),
        "gpu_uuid": [gpu] * n,
        "pci_bus_id": [pci_bus_id or f"0000:{0x10 + gpu_index:02x}:00"] * n,
        "gpu_model": [gpu_model] * n,
        "driver": [driver] * n,
    }
    for name, value in metrics.items():
        values = list(value) if isinstance(value, list | tuple) else [value] * n
        dtype = pl.Int64 if name.endswith(("_total", "_pending", "_failure", "_reasons")) else pl.Float32
        cols[name] = pl.Series(values, dtype=dtype)
    return pl.DataFrame(cols)


def every(start: datetime, end: datetime, step: timedelta = MIN) -> list[datetime]:
    """start, start + step, ... while <= end."""
    out = []
    t = start
    while t <= end:
        out.append(t)
        t += step
    return out


def xids(rows: Sequence[dict[str, Any]]) -> pl.DataFrame:
    """XID events; each row needs ts, gpu_uuid, xid; defaults: last_ts = ts, repeat_count 1,
    cluster c0, node n0, pci_bus_id 0000:10:00, gpu_index 0."""
    full = []
    for r in rows:
        full.append(
            {
                "ts": r["ts"],
                "last_ts": r.get("last_ts", r["ts"]),
                "cluster": r.get("cluster", "c0"),
                "node": r.get("node", "n0"),
                "pci_bus_id": r.get("pci_bus_id", "0000:10:00"),
                "gpu_index": r.get("gpu_index", 0),
                "gpu_uuid": r.get("gpu_uuid"),
                "xid": r["xid"],
                "repeat_count": r.get("repeat_count", 1),
            }
        )
    schema = {
        "ts": TS_DTYPE,
        "last_ts": TS_DTYPE,
        "cluster": pl.String,
        "node": pl.String,
        "pci_bus_id": pl.String,
        "gpu_index": pl.Int16,
        "gpu_uuid": pl.String,
        "xid": pl.Int32,
        "repeat_count": pl.Int32,
    }
    return pl.DataFrame(full, schema=schema, orient="row") if full else pl.DataFrame(schema=schema)


NO_XIDS = xids([])


def store_of(folder: Any, fleet: tuple[pl.DataFrame, pl.DataFrame]) -> Any:
    """A new data root under `folder`/data holding a (telemetry, xid_events) fleet."""
    from ingest.store import Store

    tel, events = fleet
    store = Store.create(str(folder / "data"))
    store.write("telemetry", tel.to_arrow())
    store.write("xid_events", events.to_arrow())
    return store
