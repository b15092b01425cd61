"""Every row's labels over a range of a store with stored aggregates, computed once for the readers
of a process that ask for that range or part of it.

A retrain reads the labels of its window several times over: the nightly job the rows its
retrains can reach, then each window's label counts (how many negatives to draw), then which
rows its draw keeps (`features.drawn_cache`), and the same again for the calibration slice.
Each read is a pass over the range's buckets (17.8 s for 21 days of the paper fleet), and the
labels do not depend on the range asked (`features.on_demand`: a row is the same in every
query), so the last range computed is kept, with only the columns these readers use
(`gpu_uuid` as a categorical: about 20 bytes a row), and a range within it is a slice of it.
It is kept for the state of the store it was computed from (the
names and sizes of the bucket and fact files): any new file computes it again.
"""

from __future__ import annotations

import threading
from datetime import datetime

import polars as pl

from features.aggregates import BUCKETS
from features.cache_file import files_digest
from features.labels import GPU
from features.on_demand import FACT_SOURCES, iter_features_on_demand, on_demand_spec
from features.schema import LABEL_COLUMNS, LABEL_DTYPES, TS_DTYPE
from ingest.store import Store

COLUMNS = ("ts", GPU, *LABEL_COLUMNS)
_KEPT: dict[str, tuple[str | None, datetime | None, datetime | None, pl.DataFrame]] = {}
"""Per data root: (the store state's digest, start, end, the rows)."""
_LOCK = threading.Lock()


def label_rows(store: Store, start: datetime | None = None, end: datetime | None = None) -> pl.DataFrame:
    """`COLUMNS` of every row with start <= ts < end (None: from the first, to the last), sorted
    by (ts, gpu_uuid), `gpu_uuid` categorical."""
    spec = on_demand_spec(store)
    # The state is taken before anything is read: rows read after it are of that state or a
    # later one, never kept under a later state than theirs.
    files = {dataset: store.files(dataset) for dataset in (BUCKETS, *FACT_SOURCES)}
    state = files_digest(store, files, prefix=f"{spec.fingerprint}\n")
    with _LOCK:
        kept = _KEPT.get(store.root)
    if kept is not None and state is not None and kept[0] == state and _covers(kept[1], kept[2], start, end):
        return _within(kept[3], start, end)
    parts = [
        part.select(*COLUMNS)
        for part in iter_features_on_demand(store, start, end, spec=spec, labels_only=True, ids=False)
    ]
    rows = (
        by_time_and_gpu(pl.concat(parts, how="vertical"))
        if parts
        else pl.DataFrame(schema={"ts": TS_DTYPE, GPU: pl.Categorical, **{c: LABEL_DTYPES[c] for c in LABEL_COLUMNS}})
    )
    with _LOCK:
        _KEPT[store.root] = (state, start, end, rows)
    return rows


def by_time_and_gpu(rows: pl.DataFrame) -> pl.DataFrame:
    """`rows` sorted by (ts, the uuid's text), `gpu_uuid` made categorical. The sort is on one
    integer per row, the rank of its time among the distinct times times the number of GPUs
    plus the rank of its uuid among the distinct uuids: a range holds a few hundred times and
    tens of thousands of GPUs, and sorting 15M rows of the paper fleet by the timestamp and the
    uuid's text took 14 s, most of a retrain's label reads."""
    times = rows["ts"].unique().sort()
    uuids = rows[GPU].cast(pl.String).unique().sort()
    time_rank = rows["ts"].replace_strict(times, pl.int_range(times.len(), dtype=pl.UInt64, eager=True))
    gpu_rank = rows[GPU].cast(pl.String).replace_strict(uuids, pl.int_range(uuids.len(), dtype=pl.UInt64, eager=True))
    order = (time_rank * uuids.len() + gpu_rank).arg_sort()
    return rows.with_columns(pl.col(GPU).cast(pl.Categorical))[order]


def forget(store: Store) -> None:
    """Let go of the rows kept for `store` (their memory)."""
    with _LOCK:
        _KEPT.pop(store.root, None)


def _covers(
    kept_start: datetime | None, kept_end: datetime | None, start: datetime | None, end: datetime | None
) -> bool:
    starts_before = kept_start is None or (start is not None and kept_start <= start)
    ends_after = kept_end is None or (end is not None and end <= kept_end)
    return starts_before and ends_after


def _within(rows: pl.DataFrame, start: datetime | None, end: datetime | None) -> pl.DataFrame:
    """The rows with start <= ts < end: a slice (the rows are sorted by ts)."""
    ts = rows["ts"]
    first = 0 if start is None else _position(ts, start)
    last = rows.height if end is None else _position(ts, end)
    return rows.slice(first, max(0, last - first))


def _position(ts: pl.Series, moment: datetime) -> int:
    """Where `moment` goes in the sorted `ts`, before any equal time."""
    return int(ts.search_sorted(pl.Series([moment], dtype=TS_DTYPE), side="left")[0])
