"""The Parquet store: one data root holding hive-partitioned datasets.

Layout under the root (a local folder or any fsspec URL such as `s3://bucket/fleet`):

    gpufail.json                          marks the root and records the schema version
    telemetry/date=2026-01-01/part-<id>.parquet
    xid_events/date=2026-01-01/part-<id>.parquet
    _state/<name>.json                    small bookkeeping files (ingest cursors, ...)

Guarantees:
- Files are written once and never rewritten in place. A write goes to a hidden temporary
  name (`.tmp-...`, which readers ignore) in the destination folder and is then renamed, so a
  write interrupted at any point leaves no visible partial file.
- Appending adds new part files; existing files are untouched.
- Reading a time range opens only the partitions whose date overlaps it, and only the
  requested columns.
- Every file must carry the dataset's schema; a foreign file is reported by path.
"""

from __future__ import annotations

import errno
import json
import uuid
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from ingest.errors import StoreError
from ingest.schema import SCHEMA_VERSION, TIMESTAMP, schema_for

MARKER = "gpufail.json"
# Snappy reads 2-3.5x faster than zstd here (PERFORMANCE.md) and raw data is re-read nightly.
COMPRESSION = "snappy"
ROW_GROUP_SIZE = 1_000_000


class Store:
    """A gpufail data root. Use `Store.create` to start one and `Store.open` to use one."""

    def __init__(self, root: str, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.root = root
        self.fs = fs
        self._path = path.rstrip("/")

    @property
    def is_local(self) -> bool:
        """Whether the root is on the local filesystem (readers then use polars on the files,
        several times faster here than pyarrow's dataset reader)."""
        protocol = self.fs.protocol
        return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, root: str) -> Store:
        """Open an existing data root; refuse anything that is not one."""
        fs, path = fsspec.core.url_to_fs(root)
        marker = f"{path.rstrip('/')}/{MARKER}"
        if not fs.exists(path):
            raise StoreError(
                f"data root {root!r} does not exist; create it with `gpufail simulate` or `gpufail collect`"
            )
        if not fs.exists(marker):
            raise StoreError(
                f"data root {root!r} is not a gpufail dataset: {MARKER} is missing "
                "(expected a folder written by gpufail)"
            )
        try:
            info = json.loads(fs.cat_file(marker))
            version = int(info["schema_version"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(
                f"{root}/{MARKER}: unreadable marker ({exc}); expected JSON with 'schema_version'"
            ) from None
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"data root {root!r} has schema version {version}; this gpufail reads version {SCHEMA_VERSION}"
            )
        return cls(root, fs, path)

    @classmethod
    def create(cls, root: str) -> Store:
        """Open a data root, creating it if the folder is absent or empty."""
        fs, path = fsspec.core.url_to_fs(root)
        path = path.rstrip("/")
        if fs.exists(f"{path}/{MARKER}"):
            return cls.open(root)
        if fs.exists(path) and fs.ls(path):
            raise StoreError(
                f"data root {root!r} exists, is not empty and is not a gpufail dataset; "
                "expected an empty or absent folder"
            )
        fs.makedirs(path, exist_ok=True)
        store = cls(root, fs, path)
        store._write_bytes_atomic(
            f"{path}/{MARKER}", json.dumps({"format": "gpufail", "schema_version": SCHEMA_VERSION}).encode()
        )
        return store

    # -- paths -----------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return "/".join([self._path, *parts])

    def exists(self, dataset: str) -> bool:
        return bool(self.files(dataset))

    def dates(self, dataset: str) -> list[date]:
        """The partition dates present in a dataset, oldest first."""
        base = self.path(dataset)
        if not self.fs.exists(base):
            return []
        found = []
        for entry in self.fs.ls(base, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("date="):
                found.append(date.fromisoformat(name.removeprefix("date=")))
        return sorted(found)

    # -- writing ---------------------------------------------------------------------------

    def write(self, dataset: str, table: pa.Table) -> list[str]:
        """Append rows to a dataset: one new file per UTC date present in `table["ts"]`.

        The table is checked against the dataset's schema first (columns may come in any order;
        types must match or be safely castable), so a bad batch is refused before anything is
        written. Returns the paths written.
        """
        table = conform(table, dataset)
        if table.num_rows == 0:
            return []
        days = pc.strftime(table["ts"], format="%Y-%m-%d")
        written = []
        for day in pc.unique(days).to_pylist():
            part = table.filter(pc.equal(days, day))
            written.append(self._write_part(dataset, day, part))
        return written

    def write_partition(self, dataset: str, day: date, table: pa.Table) -> str:
        """Write one file into `date=day`, for writers that already produce one day at a time."""
        table = conform(table, dataset)
        return self._write_part(dataset, day.isoformat(), table)

    def write_owned(self, dataset: str, day: date, table: pa.Table | Sequence[pa.Table], **parquet_options: Any) -> str:
        """Write one file of a dataset whose schema a later stage owns (features, predictions,
        actions). The owner validates the table; the store gives the same write-once, atomic,
        date-partitioned layout as the raw datasets. `parquet_options` go to
        `pyarrow.parquet.ParquetWriter` (e.g. `use_dictionary`). A sequence of tables (one
        schema) is one file in which each table starts a new row group, so that a reader
        filtering on what sets them apart skips the others by their statistics."""
        return self._write_part(dataset, day.isoformat(), table, **parquet_options)

    def read_owned(self, dataset: str, first_day: date | None = None, last_day: date | None = None) -> pa.Table | None:
        """All rows of an owned dataset within the given days, or None when it has no file."""
        files = self.files(dataset, first_day, last_day)
        if not files:
            return None
        found = ds.dataset(files, format="parquet", filesystem=self.fs)
        if len(files) == 1:
            return found.to_table()
        # A dataset's schema is taken from its first file unless told otherwise, and an owned
        # schema can grow (a newer gpufail adds a column, e.g. predictions' top_features): take
        # every file's columns, so that rows written before the upgrade read with nulls there
        # and the new column is not dropped.
        try:
            schema = pa.unify_schemas([f.physical_schema for f in found.get_fragments()])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise StoreError(f"{self.path(dataset)}: the files disagree on a column's type ({exc})") from None
        return found.replace_schema(schema).to_table()

    def _write_part(self, dataset: str, day: str, table: pa.Table | Sequence[pa.Table], **parquet_options: Any) -> str:
        folder = self.path(dataset, f"date={day}")
        self.fs.makedirs(folder, exist_ok=True)
        final = f"{folder}/part-{uuid.uuid4().hex}.parquet"
        tmp = f"{folder}/.tmp-{uuid.uuid4().hex}.parquet"
        try:
            pieces = [table] if isinstance(table, pa.Table) else list(table)
            options = {"compression": COMPRESSION, **parquet_options}
            with self.fs.open(tmp, "wb") as fh, pq.ParquetWriter(fh, pieces[0].schema, **options) as writer:
                for piece in pieces:
                    writer.write_table(piece, row_group_size=ROW_GROUP_SIZE)
            self.fs.mv(tmp, final)
        except BaseException as exc:
            # Leave nothing behind on any interruption, KeyboardInterrupt included.
            if self.fs.exists(tmp):
                self.fs.rm(tmp)
            if isinstance(exc, OSError):
                raise StoreError(_write_failure(folder, exc)) from exc
            raise
        return final

    def _write_bytes_atomic(self, final: str, data: bytes) -> None:
        folder = final.rsplit("/", 1)[0]
        tmp = f"{folder}/.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as fh:
            fh.write(data)
        self.fs.mv(tmp, final)

    # -- reading ---------------------------------------------------------------------------

    def read(
        self,
        dataset: str,
        start: datetime | None = None,
        end: datetime | None = None,
        columns: list[str] | None = None,
        filter: pc.Expression | None = None,
    ) -> pa.Table:
        """Rows of `dataset` with `start <= ts < end`, only the given columns.

        Partitions outside the date range are never opened, so a range read costs what the
        range holds, not what the dataset holds.
        """
        expected = schema_for(dataset)
        first_day = _utc(start).date() if start is not None else None
        last_day = (_utc(end) - timedelta(microseconds=1)).date() if end is not None else None
        dataset_obj = self.dataset(dataset, first_day, last_day)
        if columns is not None:
            unknown = sorted(set(columns) - set(expected.names))
            if unknown:
                raise StoreError(f"{dataset}: unknown columns {unknown}; the schema has {expected.names}")
        expr = _time_filter(start, end)
        if filter is not None:
            expr = filter if expr is None else expr & filter
        table = dataset_obj.to_table(columns=columns, filter=expr)
        return table.replace_schema_metadata(expected.metadata) if columns is None else table

    def dataset(self, dataset: str, first_day: date | None = None, last_day: date | None = None) -> ds.Dataset:
        """A pyarrow dataset over the files of `dataset` dated within the given days (all when
        omitted), each checked against the dataset's schema."""
        expected = schema_for(dataset)
        files = self.files(dataset, first_day, last_day)
        dataset_obj = ds.dataset(files, schema=expected, format="parquet", filesystem=self.fs)
        for fragment in dataset_obj.get_fragments():
            try:
                physical = fragment.physical_schema
            except (pa.ArrowInvalid, OSError) as exc:
                raise StoreError(f"{fragment.path}: not a readable Parquet file ({exc})") from None
            _check_physical(physical, expected, f"{dataset} file {fragment.path}")
        return dataset_obj

    def files(self, dataset: str, first_day: date | None = None, last_day: date | None = None) -> list[str]:
        """Visible part files, pruned by the date in their partition folder's name.

        Pruning here, before pyarrow sees the files, means files outside the range are never
        opened, not even their footers."""
        files = []
        for day in self.dates(dataset):
            if (first_day and day < first_day) or (last_day and day > last_day):
                continue
            for f in self.fs.ls(self.path(dataset, f"date={day.isoformat()}"), detail=False):
                name = f.rsplit("/", 1)[-1]
                if name.endswith(".parquet") and not name.startswith((".", "_")):
                    files.append(f)
        return sorted(files)

    # -- small state files -----------------------------------------------------------------

    def read_state(self, name: str) -> dict[str, Any] | None:
        path = self.path("_state", f"{name}.json")
        if not self.fs.exists(path):
            return None
        try:
            return json.loads(self.fs.cat_file(path))
        except ValueError as exc:
            raise StoreError(f"{path}: corrupt state file ({exc}); expected JSON") from None

    def write_state(self, name: str, state: dict[str, Any]) -> None:
        folder = self.path("_state")
        self.fs.makedirs(folder, exist_ok=True)
        self._write_bytes_atomic(f"{folder}/{name}.json", json.dumps(state, indent=1, default=str).encode())


def _check_physical(physical: pa.Schema, expected: pa.Schema, where: str) -> None:
    problems = []
    for field in expected:
        if field.name not in physical.names:
            problems.append(f"missing column {field.name!r} ({field.type})")
        elif not physical.field(field.name).type.equals(field.type):
            problems.append(f"column {field.name!r} is {physical.field(field.name).type}, expected {field.type}")
    extra = sorted(set(physical.names) - set(expected.names) - {"date"})
    if extra:
        problems.append(f"unexpected columns {extra}")
    if problems:
        raise StoreError(f"{where} has a foreign schema: " + "; ".join(problems))


def conform(table: pa.Table, dataset: str) -> pa.Table:
    """Reorder and cast `table` to the dataset schema, or explain why it cannot be."""
    expected = schema_for(dataset)
    missing = [f.name for f in expected if f.name not in table.column_names]
    extra = sorted(set(table.column_names) - set(expected.names))
    if missing or extra:
        raise StoreError(f"rows for {dataset!r} do not match its schema: missing {missing}, unexpected {extra}")
    columns = []
    for field in expected:
        column = table[field.name]
        if not column.type.equals(field.type):
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise StoreError(f"{dataset}.{field.name}: cannot use {column.type} as {field.type} ({exc})") from None
        if not field.nullable and column.null_count:
            raise StoreError(f"{dataset}.{field.name}: {column.null_count} null values in a required column")
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=expected)


def _time_filter(start: datetime | None, end: datetime | None) -> pc.Expression | None:
    expr = None
    if start is not None:
        expr = ds.field("ts") >= pa.scalar(_utc(start), TIMESTAMP)
    if end is not None:
        term = ds.field("ts") < pa.scalar(_utc(end), TIMESTAMP)
        expr = term if expr is None else expr & term
    return expr


def _utc(moment: datetime) -> datetime:
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def _write_failure(folder: str, exc: OSError) -> str:
    """The one-line error for a part file that could not be written (disk full, no permission)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    out_of_space = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return (
        f"{folder}: could not write a part file ({reason}); nothing of it was kept and the files "
        f"already there are untouched{'; free space there and run again' if out_of_space else ''}"
    )
