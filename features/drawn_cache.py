"""The training draw's feature rows kept on disk a UTC day at a time, so that a retrain whose window
moved on by a day (the nightly job) computes that day, not the whole window again
(`features.dataset.drawn_rows` on a store with stored aggregates).

A row's features are a function of the stored files its windows read, and of nothing that
arrives later: the buckets of its day and of the lookback before it, the GPU presence up to its
day (a GPU's first sample; which GPU an XID event without a uuid belongs to) and the XID events
up to its day (`features.on_demand`: a row is the same to the bit whatever range computes it).
Its label is not: a failure recorded later, a repair, the data moving past the horizon change
it. So the labels, and which rows are drawn (every positive, the negatives below the key's
threshold, in service and not silent), are computed every time from a few bucket columns
(`labels_only`), and only the features come from the cache:

- each day's file holds the features of the day's candidate rows, the rows whose stored key is
  below the threshold of `stored_fraction` (the draw's share rounded up to a power of two, so
  that the nightly share, which follows the label counts, finds the file of the night before)
  and those positive when it was written: a superset of the rows drawn while the labels do not
  turn a row of a higher key positive;
- a draw reads a day from the file of its share, else from a current file of a larger share
  (a superset of its candidates): a retrain's calibration slice is drawn at a larger share
  than its window, and the window's last days are the slice's;
- a day is computed again when its key changed (a bucket, presence or XID file it depends on,
  the spec, the code: `day_key`), or when the draw wants a row the file lacks (a failure
  recorded since made it positive);
- the day holding the data's end is never kept: its rows change as the hour fills.

Files are `DATA/_cache/drawn-<day>-<threshold>.bin`, each written and read as every cache file
is (`features.cache_file`); the days more than `KEPT_DAYS` before the newest one kept of their
share are removed as new ones are written. Draws of more than `LARGEST_SHARE_KEPT` of the
negatives are computed, not kept.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterable, Iterator
from datetime import date, datetime, timedelta

import polars as pl

from features.aggregates import BUCKETS, PRESENCE
from features.cache_file import CacheFile, files_digest
from features.label_rows import label_rows
from features.labels import GPU
from features.newest_cache import code_digest
from features.on_demand import (
    XID_EVENTS,
    OnDemandOptions,
    RowFilter,
    block_length,
    drawn,
    empty_on_demand,
    features_on_demand,
    key_below,
    on_demand_spec,
    stored_fleet_facts,
)
from features.plan import ONE_DAY, day_start, lookback
from features.sample_key import key_threshold
from features.schema import LABEL_COLUMNS
from features.spec import FeatureSpec
from ingest.store import Store

VERSION = 1
KEPT_DAYS = 45
"""Days kept before the newest day kept of the same share: a training window and its calibration
slice (28 days by default) and room for a longer one."""
LARGEST_SHARE_KEPT = 0.125
"""Draws of a larger share of the negatives are computed, not kept: at share 1 (every labelled
row, the nightly held-out window's) a paper day is 333 MB of file, and computing, writing and
joining whole days took the read of 3 days to 132 s and 13.7 GB, against 110 s and 9.4 GB."""
_MAGIC = b"gpufail drawn rows\n"
_ROWS = "rows"
_KEYS = ["ts", GPU]
_NAME = re.compile(r"^drawn-(\d{4}-\d{2}-\d{2})-(\d+)\.bin$")
_PARTITION = re.compile(r"/date=(\d{4}-\d{2}-\d{2})/")


def stored_fraction(negative_fraction: float) -> float:
    """The share of negatives a day's file holds for a draw at `negative_fraction`: the power of
    two at or above it. A retrain's share follows its window's label counts (at most
    `max_negatives_per_positive` negatives per positive: on the paper fleet 2.46% for a
    training window, 2.78% for its calibration slice), so it moves from window to window and
    night to night, and files of the exact share would never be read again; these serve every
    share up to twice smaller, for at most twice the rows."""
    key_threshold(negative_fraction)  # refuses a share outside (0, 1]
    return min(1.0, 2.0 ** math.ceil(math.log2(negative_fraction)))


def kept(negative_fraction: float) -> bool:
    """Whether draws at `negative_fraction` are kept a day at a time (else computed each time)."""
    return stored_fraction(negative_fraction) <= LARGEST_SHARE_KEPT


def day_file(day: date, threshold: int) -> CacheFile:
    return CacheFile(f"drawn-{day.isoformat()}-{threshold}.bin", _MAGIC, VERSION, compression="zstd")


def candidates(negative_fraction: float) -> RowFilter:
    """The rows a day's file holds: those whose stored key is below the draw's threshold,
    whatever their label, and the positives."""
    threshold = key_threshold(negative_fraction)

    def keep(rows: pl.DataFrame) -> pl.Series:
        return (key_below(rows, threshold) | (rows["label"] == 1)).fill_null(False)

    return keep


def drawn_rows_cached(store: Store, start: datetime, end: datetime, negative_fraction: float) -> pl.DataFrame:
    """Every positive and the negatives drawn at `negative_fraction` by the stored key, with
    start <= ts < end, sorted by (ts, gpu_uuid): the rows and values of
    `features_on_demand(store, start, end, rows=drawn(negative_fraction))`, with the features of
    the days whose file is current read from it."""
    spec = on_demand_spec(store)
    if not kept(negative_fraction):
        return features_on_demand(store, start, end, spec=spec, rows=drawn(negative_fraction))
    kept_fraction = stored_fraction(negative_fraction)
    threshold = key_threshold(kept_fraction)
    # The files first, before anything is read: rows computed after are of this state of the
    # store or a later one (files only come and go forwards), never an earlier one.
    listed = {dataset: store.files(dataset) for dataset in (BUCKETS, PRESENCE, XID_EVENTS)}
    labels = label_rows(store, start, end)
    wanted = labels.filter(drawn(negative_fraction)(labels)).with_columns(pl.col(GPU).cast(pl.String))
    facts = stored_fleet_facts(store, spec)
    if wanted.height == 0 or facts is None:
        return empty_on_demand(store, spec)
    by_day = dict(_days_of(wanted))
    days = sorted(by_day)
    newest_whole_day = day_start(facts.data_end).date()  # days before it are complete
    parts: dict[date, pl.DataFrame] = {}
    missing: list[date] = []
    # None for the day holding the data's end: never kept (`CacheFile` neither reads nor writes it).
    keys = {day: day_key(store, spec, listed, day, threshold) if day < newest_whole_day else None for day in days}
    for day in days:
        cached = _kept_rows(store, spec, listed, day, kept_fraction, keys[day], by_day[day])
        if cached is not None:
            parts[day] = _with_labels(cached, by_day[day])
        else:
            missing.append(day)
    # The missing days in runs of consecutive days, each in the time blocks a read of it would
    # compute together (one lookback read per block), a block's rows held at once.
    runs = list(_runs(missing))
    step = block_length(facts, spec, OnDemandOptions(), (runs[0][0], runs[-1][1]) if runs else None)
    for block_start, block_end in _blocks(runs, step):
        computed = features_on_demand(store, block_start, block_end, spec=spec, rows=candidates(kept_fraction))
        for day, rows in _days_of(computed):
            day_file(day, threshold).save(store, keys[day], {}, {_ROWS: rows})
            parts[day] = _with_labels(rows, by_day[day])
    _prune(store)
    return pl.concat([parts[day] for day in days if day in parts], how="vertical")


def _kept_rows(
    store: Store,
    spec: FeatureSpec,
    listed: dict[str, list[str]],
    day: date,
    kept_fraction: float,
    key: str | None,
    wanted: pl.DataFrame,
) -> pl.DataFrame | None:
    """The candidate rows of `day` from the file of the draw's share, else from a current file
    of a larger share (up to `LARGEST_SHARE_KEPT`: its candidates include every row of a
    smaller share), when the file holds every `wanted` row; None when no file does. A
    retrain's calibration slice is drawn at a larger share than its training window (more
    negatives per positive are left in a week than in three), and the window's last days are
    the slice's: a first retrain reads them from the slice's files instead of computing them
    twice."""
    share = kept_fraction
    while key is not None and share <= LARGEST_SHARE_KEPT:
        threshold = key_threshold(share)
        file_key = key if share == kept_fraction else day_key(store, spec, listed, day, threshold)
        cached = day_file(day, threshold).load_table(store, file_key, _ROWS)
        if cached is not None and wanted.join(cached, on=_KEYS, how="anti").height == 0:
            return cached
        share *= 2
    return None


def day_key(store: Store, spec: FeatureSpec, listed: dict[str, list[str]], day: date, threshold: int) -> str | None:
    """What the features of `day`'s candidate rows are a function of: the bucket files of the day
    and of its lookback, the presence and XID event files up to the day (`listed`: per dataset,
    `Store.files`), the spec, the threshold and the code."""
    first = day_start(datetime(day.year, day.month, day.day) - lookback(spec)).date()
    files = {
        BUCKETS: [p for p in listed[BUCKETS] if first <= _partition_day(p) <= day],
        PRESENCE: [p for p in listed[PRESENCE] if _partition_day(p) <= day],
        XID_EVENTS: [p for p in listed[XID_EVENTS] if _partition_day(p) <= day],
    }
    prefix = f"{VERSION}\n{code_digest()}\n{spec.fingerprint}\n{day.isoformat()}\n{threshold}\n"
    return files_digest(store, files, prefix=prefix)


def _partition_day(path: str) -> date:
    match = _PARTITION.search(path)
    if match is None:
        raise ValueError(f"{path}: expected a file in a date=YYYY-MM-DD partition folder")
    return date.fromisoformat(match[1])


def _with_labels(rows: pl.DataFrame, wanted: pl.DataFrame) -> pl.DataFrame:
    """The `wanted` rows (keys and labels, sorted as `rows`) of `rows`, with `wanted`'s labels."""
    return rows.drop(LABEL_COLUMNS).join(wanted, on=_KEYS, how="inner", maintain_order="left")


def _runs(days: list[date]) -> Iterator[tuple[datetime, datetime]]:
    """[start, end) of each run of consecutive `days` (sorted), computed together: a run reads
    its lookback once, where a day at a time would read each day's."""
    run: list[date] = []
    for day in [*days, None]:
        if run and (day is None or day != run[-1] + timedelta(days=1)):
            first = day_start(datetime(run[0].year, run[0].month, run[0].day))
            yield first, first + len(run) * ONE_DAY
            run = []
        if day is not None:
            run.append(day)


def _blocks(runs: Iterable[tuple[datetime, datetime]], step: timedelta) -> Iterator[tuple[datetime, datetime]]:
    """Each run cut into blocks of `step` from its start."""
    for start, end in runs:
        while start < end:
            yield start, min(end, start + step)
            start += step


def _days_of(frame: pl.DataFrame) -> Iterator[tuple[date, pl.DataFrame]]:
    """`frame` (sorted by ts) a UTC day at a time, as slices of it (no copy)."""
    if frame.height == 0:
        return
    days = frame["ts"].dt.date().rle()
    offset = 0
    for length, day in zip(days.struct.field("len").to_list(), days.struct.field("value").to_list(), strict=True):
        yield day, frame.slice(offset, length)
        offset += length


def _prune(store: Store) -> None:
    """Remove the day files more than `KEPT_DAYS` before the newest day kept of their share (a
    window reads its own days)."""
    folder = store.path("_cache")
    if not store.is_local or not os.path.isdir(folder):
        return
    files = [(name, date.fromisoformat(m[1]), int(m[2])) for name in os.listdir(folder) if (m := _NAME.match(name))]
    newest: dict[int, date] = {}
    for _, day, threshold in files:
        newest[threshold] = max(day, newest.get(threshold, day))
    for name, day, threshold in files:
        if day < newest[threshold] - timedelta(days=KEPT_DAYS):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))
