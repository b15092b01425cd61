"""The store's feature rows: their readers, and the `features` table's file format and writer.

Every consumer (training, evaluation, scoring, serving) reads feature rows through the readers
here: whole ranges (`read_features`, `scan_features`), the newest grid time
(`read_newest_grid_time`), and the rows a retrain fits on (`drawn_rows`, `rows_at`,
`has_sample_keys`, `label_counts`). Where they come from is decided once per call
(`computed`): a store with stored aggregates (`gpufail features`, `features.aggregates`) has
them computed on demand (`features.on_demand`), for the rows asked only; a store with only the
features table (`gpufail features --materialise`, a store written before the aggregates, a
table written by `write_features`) has them read from it. Both give the same rows
(`tests/features/test_on_demand.py`).

The table's files are hive-partitioned by UTC date, written once and atomically
(`ingest.store`), each two row groups: the rows a retrain draws at up to `PRESAMPLED_FRACTION`
of the negatives first, then the rest (`write_features`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, date, datetime, timedelta

import polars as pl
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from features import label_rows, on_demand
from features.aggregates import BUCKETS, has_aggregates
from features.column_sort import sorted_column_by_column
from features.drawn_cache import drawn_rows_cached
from features.labels import BULK_SHARE, GPU
from features.manifest import DATASET as FEATURES_DATASET
from features.sample_key import PRESAMPLED_FRACTION, SAMPLE_KEY, drawn, key_threshold, sample_keys
from features.schema import (
    FEATURES_SCHEMA_VERSION,
    ID_COLUMNS,
    ID_DTYPES,
    LABEL_COLUMNS,
    LABEL_DTYPES,
    TS_DTYPE,
    validate_features,
)
from ingest.journal import Staging
from ingest.store import Store

# Feature files of different dates written at once (`write_features`).
WRITE_THREADS = min(4, os.cpu_count() or 1)

_KEYS = ["ts", GPU]


def computed(store: Store) -> bool:
    """Whether the store's feature rows are computed on demand from its stored aggregates (it
    has them), rather than read from the features table."""
    return has_aggregates(store)


def features_dataset(store: Store) -> str:
    """The dataset the store's feature rows come from: its files change when the rows do, and a
    file that does not read is one of its files."""
    return BUCKETS if computed(store) else FEATURES_DATASET


def feature_days(store: Store, start: datetime | None = None, end: datetime | None = None) -> list[date]:
    """The UTC days with feature rows (within [start, end) when given), in order."""
    return store.dates(features_dataset(store), start, end)


def _on_demand(
    store: Store,
    start: datetime | None,
    end: datetime | None,
    columns: Sequence[str] | None,
    *,
    rows: on_demand.RowFilter | None = None,
    where: pl.Expr | None = None,
) -> pl.DataFrame:
    """`read_features`' rows computed on demand: `columns` (all but the key when None); the
    identity and label columns alone are computed without any feature."""
    names = None if columns is None else list(dict.fromkeys(["ts", GPU, *columns]))
    if names is not None and set(names) <= set(label_rows.COLUMNS) and where is None and rows is None:
        return label_rows.label_rows(store, start, end).select(names).with_columns(pl.col(GPU).cast(pl.String))
    labels_only = names is not None and set(names) <= {*ID_COLUMNS, *LABEL_COLUMNS} and where is None
    key = where is not None or (names is not None and SAMPLE_KEY in names)
    frame = on_demand.features_on_demand(store, start, end, rows=rows, sample_key=key, labels_only=labels_only)
    if where is not None:
        frame = frame.filter(where)
    return frame.select(names) if names is not None else frame.drop(SAMPLE_KEY, strict=False)


def _metadata() -> dict[bytes, bytes]:
    return {
        b"gpufail.dataset": FEATURES_DATASET.encode(),
        b"gpufail.features_schema_version": str(FEATURES_SCHEMA_VERSION).encode(),
        b"gpufail.presampled_fraction": str(PRESAMPLED_FRACTION).encode(),
    }


def write_features(target: Store | Staging, table: pl.DataFrame, *, threads: int = WRITE_THREADS) -> list[str]:
    """Write a feature frame to the store's `features` dataset: one new file per UTC date of
    `ts`. To a `Staging` of the features journal (a build: the files stay hidden until the
    manifest commits them), or appended to a `Store` (its files visible at once, each whole).
    The frame is validated first. Returns the paths written.

    Each file is two row groups: the rows a retrain draws at up to `PRESAMPLED_FRACTION` of
    the negatives (and every positive) first, then the rest, each group in (gpu_uuid, ts) order
    with statistics on label and `_sample_key`, so that a retrain's filter skips the rest by
    its statistics. Censored rows go by their key as if negative, so that no key in the rest is
    low. The files of different dates are written by `threads` threads at once: pyarrow's
    Parquet writer encodes one file on one core, and encoding is most of writing."""
    validate_features(table)
    if table.height == 0:
        return []
    if not _sorted_by_gpu_then_time(table):
        table = table.sort(GPU, "ts")
    keys = sample_keys(table[GPU], table["ts"])
    rest = pl.Series("_rest", ~drawn(table["label"].fill_null(0).to_numpy(), keys, PRESAMPLED_FRACTION))
    table = table.with_columns(pl.Series(SAMPLE_KEY, keys))
    day = table["ts"].dt.date()
    # Each file's two groups are filtered out of the frame, which keeps its (gpu_uuid, ts) order:
    # a masked copy per group costs about one copy of the frame, where sorting the rows into file
    # order and gathering every column (rechunked first) cost two, the gather a random one. Each
    # thread filters its own date's groups, so no more than `threads` dates are copied at once.
    # Dictionary-encoding only the string columns: trying it on 280 float columns made
    # writing 2.5x slower for no gain.
    dictionary = [c for c in ID_COLUMNS if table.schema[c] == pl.String]
    metadata = _metadata()

    def write_one(one_day: date) -> str:
        on_day = day == one_day
        # Two groups in every file, the first for the drawn rows, even when one is empty.
        groups = [table.filter(on_day & ~rest), table.filter(on_day & rest)]
        pieces = [g.to_arrow(compat_level=pl.CompatLevel.oldest()) for g in groups]
        return target.write_owned(
            FEATURES_DATASET,
            one_day,
            [p.replace_schema_metadata({**(p.schema.metadata or {}), **metadata}) for p in pieces],
            use_dictionary=dictionary,
            # Statistics only where a reader filters (time, GPU, place, the training draw):
            # min/max of 400 float columns cost ~15% of writing and no reader uses them.
            write_statistics=[*ID_COLUMNS, "label", SAMPLE_KEY],
        )

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        futures = [pool.submit(write_one, one_day) for one_day in day.unique().sort()]
        # Every write finishes (each file is whole or absent) before the first error is raised.
        return [f.result() for f in futures]


def _sorted_by_gpu_then_time(frame: pl.DataFrame) -> bool:
    """Whether the rows are in (gpu_uuid, ts) order (a store build's flush always is)."""
    if frame.height < 2:
        return True
    gpu, ts = frame[GPU], frame["ts"]
    earlier_gpu, earlier_ts = gpu.slice(0, frame.height - 1), ts.slice(0, frame.height - 1)
    later_gpu, later_ts = gpu.slice(1), ts.slice(1)
    return bool(((earlier_gpu < later_gpu) | ((earlier_gpu == later_gpu) & (earlier_ts < later_ts))).all())


def feature_files(
    store: Store, first_day: date | None = None, last_day: date | None = None, *, verify: bool = False
) -> list[str]:
    """Part files of the features dataset dated within [first_day, last_day] that readers see
    (the committed ones, `Store.files`); `verify` (for readers of their rows): each file's
    checksum checked first (`Store.verify`)."""
    return store.files(FEATURES_DATASET, first_day, last_day, verify=verify)


def features_shape(store: Store) -> tuple[int, int]:
    """(rows, columns) of the whole features dataset, from the files' Parquet footers: nothing
    but the footers is read, so a caller can tell what reading it all would take."""
    if computed(store):
        # Rows: the buckets, GPU-hours with samples: about the rows (silent hours add rows, a
        # failed GPU's hours until its repair take some away), without computing any.
        buckets = store.files(BUCKETS)
        rows = sum(pq.read_metadata(p, filesystem=store.fs).num_rows for p in buckets) if buckets else 0
        return rows, on_demand.empty_on_demand(store).width
    files = feature_files(store)
    if not files:
        return 0, 0
    dataset = ds.dataset(files, format="parquet", filesystem=store.fs)
    rows = sum(fragment.metadata.num_rows for fragment in dataset.get_fragments())
    return rows, len(dataset.schema)


def read_features(
    store: Store,
    start: datetime | None = None,
    end: datetime | None = None,
    columns: Sequence[str] | None = None,
) -> pl.DataFrame:
    """Feature rows with start <= ts < end (all when omitted), sorted by (ts, gpu_uuid). Only
    the date partitions overlapping the range are opened. A file that does not read is named."""
    if computed(store):
        return _on_demand(store, start, end, columns)
    frame = store.collect(scan_features(store, start, end, columns), FEATURES_DATASET, start, end)
    return sorted_column_by_column(frame, ["ts", GPU])


def scan_features(
    store: Store,
    start: datetime | None = None,
    end: datetime | None = None,
    columns: Sequence[str] | None = None,
    where: pl.Expr | None = None,
) -> pl.LazyFrame:
    """`read_features` as a polars LazyFrame in file order (rows matching `where`, which may
    use the stored training key), for readers that take a range a few grid times at a time (a
    held-out window is 2.2M rows x 420 columns on the paper fleet). Files written before the
    stored training key (SAMPLE_KEY) lack it: a later file's column the first file lacks is
    left out rather than an error. Collect it with `Store.collect` to have a file that does
    not read named. Computed on demand (`computed`), the range is computed when this is called."""
    if computed(store):
        return _on_demand(store, start, end, columns, where=where).lazy()
    frame = store.scan(FEATURES_DATASET, start, end, where=where, schema={**ID_DTYPES, **LABEL_DTYPES})
    if columns is None:
        names = store.collect(frame.head(0), FEATURES_DATASET, start, end).columns
        return frame.select([c for c in names if c != SAMPLE_KEY])
    return frame.select(list(dict.fromkeys(["ts", GPU, *columns])))


def read_newest_grid_time(store: Store) -> pl.DataFrame:
    """The feature rows of the newest grid time (what scoring the fleet as it is now needs),
    sorted by gpu_uuid; empty when there are no features. Only the newest day's files are
    opened, and of them only these rows are decoded past the time column: reading the whole
    day (750k rows x 420 columns on the paper fleet) to keep one hour in 24 was most of the
    nightly scoring step's memory."""
    if computed(store):
        return on_demand.newest_on_demand(store)
    days = store.dates(FEATURES_DATASET)
    if not days:
        return scan_features(store).collect()
    # The newest grid time of the bulk of the fleet: a GPU whose clock ran ahead has rows of
    # its own beyond it (`features.labels.fleet_data_end`), up to days ahead.
    start = datetime.combine(days[-min(len(days), _BULK_DAYS)], datetime.min.time(), tzinfo=UTC)
    span = scan_features(store, start=start)
    per_ts = store.collect(span.group_by("ts").len(), FEATURES_DATASET, start)
    if per_ts.height == 0:
        return store.collect(span.head(0), FEATURES_DATASET, start)
    bulk = per_ts.filter(pl.col("len") >= BULK_SHARE * per_ts["len"].max())  # type: ignore[operator]
    newest = bulk["ts"].max()
    day_start = datetime.combine(newest.date(), datetime.min.time(), tzinfo=UTC)  # type: ignore[union-attr]
    day = scan_features(store, start=day_start, end=day_start + timedelta(days=1))
    rows = store.collect(day.filter(pl.col("ts") == pl.lit(newest, dtype=TS_DTYPE)), FEATURES_DATASET, day_start)
    return sorted_column_by_column(rows, ["ts", GPU])


_BULK_DAYS = 3
"""Days of feature files whose grid times `read_newest_grid_time` weighs."""


# -- the rows a retrain fits on ---------------------------------------------------------------


def has_sample_keys(store: Store, start: datetime, end: datetime) -> bool:
    """Whether [start, end) has feature files and every one of them stores the training key
    (`features.sample_key`), so that `drawn_rows` can read the window; each file's checksum
    is checked first. Files written before the key existed lack it. Computed on demand, every
    row has its key: whether [start, end) has rows."""
    if computed(store):
        return end > start and bool(feature_days(store, start, end))
    files = (
        []
        if end <= start
        else feature_files(store, start.date(), (end - timedelta(microseconds=1)).date(), verify=True)
    )
    return bool(files) and all(SAMPLE_KEY in _column_names(store, f) for f in files)


def _column_names(store: Store, path: str) -> list[str]:
    with store.fs.open(path, "rb") as fh:
        return pq.read_schema(fh).names


def label_counts(store: Store, start: datetime, end: datetime) -> tuple[int, int]:
    """(negatives, positives) with start <= ts < end, from the `label` and `ts` columns alone,
    counted as they are decoded: no gpu_uuid, no sort."""
    if end <= start:
        return 0, 0
    if computed(store):
        labels = label_rows.label_rows(store, start, end)["label"]
        return int((labels == 0).sum()), int((labels == 1).sum())
    window = scan_features(store, start, end, ["label"])
    counts = store.collect(window.group_by("label").len(), FEATURES_DATASET, start, end)
    by_label = dict(zip(counts["label"].to_list(), counts["len"].to_list(), strict=True))
    return int(by_label.get(0, 0)), int(by_label.get(1, 0))


def keep_labels(store: Store, start: datetime, end: datetime) -> None:
    """Compute the labels of start <= ts < end once, for the reads of ranges within it that
    follow (`label_counts`, `drawn_rows`: a retrain's windows and its calibration slice), on a
    store whose rows are computed (`features.label_rows`); nothing on a store of stored rows,
    whose reads of labels are each a scan of a few columns."""
    if computed(store) and start < end:
        label_rows.label_rows(store, start, end)


def drawn_rows(store: Store, start: datetime, end: datetime, negative_fraction: float) -> pl.DataFrame:
    """Every positive and the negatives drawn at `negative_fraction` by the stored key, with
    start <= ts < end, sorted by (ts, gpu_uuid). At a share up to PRESAMPLED_FRACTION the
    reader skips every file's second row group by its statistics, ~90% of the bytes; computed
    on demand, only those rows get features."""
    if computed(store):
        return drawn_rows_cached(store, start, end, negative_fraction)
    keep = (pl.col("label") == 1) | ((pl.col("label") == 0) & (pl.col(SAMPLE_KEY) < key_threshold(negative_fraction)))
    rows = scan_features(store, start, end, where=keep)
    return store.collect(rows, FEATURES_DATASET, start, end).sort(_KEYS)


def rows_at(store: Store, day_start: datetime, wanted: pl.DataFrame) -> pl.DataFrame:
    """The feature rows of one UTC day whose (ts, gpu_uuid) are in `wanted`. The day's files
    are scanned with the keys' hash as the filter, so the reader drops the other rows as it
    decodes (a hash collision only lets a row through to the exact semi-join): ~5x faster than
    reading the day whole and sorting it, which a retrain did for each of its ~22 days (0.6 s
    against 3.3 s for a day of the paper fleet)."""
    day_end = day_start + timedelta(days=1)
    if computed(store):
        return _on_demand(store, day_start, day_end, None, rows=on_demand.at_keys(wanted))
    hashes = wanted.select(pl.struct(_KEYS).hash().alias("_h"))["_h"]
    day = scan_features(store, day_start, day_end, where=pl.struct(_KEYS).hash().is_in(hashes.implode()))
    return store.collect(day, FEATURES_DATASET, day_start, day_end).join(wanted, on=_KEYS, how="semi")
