"""The Parquet store: one data root holding hive-partitioned datasets.

Layout under the root (a local folder or any fsspec URL such as `s3://bucket/fleet`; fsspec is
imported only for a URL or a write, so reading a local root does without it):

    gpufail.json                          marks the root and records the schema version
    telemetry/date=2026-01-01/part-<id>.parquet
    xid_events/date=2026-01-01/part-<id>.parquet
    _state/<name>.json                    small bookkeeping files (ingest cursors, ...)

Guarantees:
- Files are written once and never rewritten in place. A write goes to a hidden temporary
  name (`.tmp-...`, which readers ignore) in the destination folder and is then renamed, so a
  write interrupted at any point leaves no visible partial file.
- Appending adds new part files; existing files are untouched.
- Every writer that keeps state commits its files, the files they replace and its state in
  one step (`Store.journal`, see `ingest.journal`), so a rerun after a crash at any point
  neither loses nor repeats rows, and readers see only what was committed (`files`).
- One read path (`scan`, a polars LazyFrame for a time range, columns and a filter, whatever
  the filesystem): reading a time range opens only the partitions whose date overlaps it, and
  only the requested columns.
- Every file must carry the dataset's schema; a foreign file is reported by path.
- Every file carries a checksum: Parquet page checksums inside (verified whenever pyarrow reads
  it through the store: remote stores are always read that way), and a CRC-32 of the whole file
  in its name (`part-<id>-crc32-<hex>.parquet`), verified once per process before a local file
  is handed to a reader (polars, which local readers use for speed, verifies no checksum; and
  page checksums leave the footer unprotected). A flipped bit or a truncated file is then an
  error naming the file and what to do about it (`remedy`, by dataset), never rows. Files
  written before checksums existed are read as before.
- Every OSError of the store (read-only file system, no space, no permission) becomes a
  one-line `StoreError` naming the path and what to do, at the store: callers need no handler.
"""

from __future__ import annotations

import errno
import json
import os
import re
import uuid
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from functools import cache
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from ingest.errors import StoreError
from ingest.schema import SCHEMA_VERSION, TIMESTAMP, optional_columns, schema_for

if TYPE_CHECKING:
    from typing import BinaryIO

    import polars as pl  # imported where used: a collector may be installed without it
    import pyarrow.compute as pc  # imported where used: a tenth of a second of `gpufail at-risk`
    import pyarrow.dataset as ds
    from fsspec import AbstractFileSystem

    from ingest.journal import Journal  # which imports this module

MARKER = "gpufail.json"
# Snappy reads 2-3.5x faster than zstd for ~10% more bytes, and raw data is re-read nightly.
COMPRESSION = "snappy"
ROW_GROUP_SIZE = 1_000_000
# A part file's name ends in the CRC-32 of its bytes (`Store._verify`).
_CHECKSUMMED = re.compile(r"-crc32-([0-9a-f]{8})\.parquet$")
# Written files carry page checksums; reads through pyarrow check them.


def _datasets() -> Any:
    """`pyarrow.dataset`, imported on first use: importing it loads pandas, a second of a
    command that reads one small file (`gpufail at-risk`)."""
    import pyarrow.dataset

    return pyarrow.dataset


@cache
def _verified_parquet() -> Any:
    ds = _datasets()
    return ds.ParquetFileFormat(
        default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True)
    )


_HASH_CHUNK = 4 << 20
# (path, size, mtime) of the local files this process has verified: a file is hashed once per
# process, whichever Store object (or Dask task's copy of one) reads it. Part files are never
# rewritten in place, so a file with another size or mtime is checked again.
_VERIFIED: set[tuple[str, int, int]] = set()
# (path, size, mtime, schema) of the local files this process has found to have the columns of
# that schema (`Store._check_schemas`), as `_VERIFIED` for checksums.
_SCHEMA_CHECKED: set[tuple[str, int, int, int]] = set()
# Files `Store.verify_all` checks at once: reading and hashing overlap even on one core.
_VERIFY_THREADS = max(2, min(4, os.cpu_count() or 1))
# Files whose schemas `Store._check_schemas` reads at once: a file's footer, which its fragment
# keeps, is about 0.1 MB for telemetry, and a day of a 1,000-node fleet's collectors is 288,000
# files.
_SCHEMA_BATCH = 1000
# Listings of a dataset taken again when a writer committed while they were taken (`files`).
_LIST_TRIES = 3


class Store:
    """A gpufail data root. Use `Store.create` to start one and `Store.open` to use one."""

    def __init__(self, root: str, fs: AbstractFileSystem | None, path: str) -> None:
        """`fs`: the root's filesystem, None for a local folder (`fs` makes it on first use)."""
        self.root = root
        self._fs = fs
        self._path = path.rstrip("/")

    @property
    def fs(self) -> AbstractFileSystem:
        """The root's fsspec filesystem, which writers use. A local root's is made on first use:
        its readers go to the files directly (`names_in`, `read_bytes`, `open_file`)."""
        if self._fs is None:
            from fsspec.implementations.local import LocalFileSystem

            self._fs = LocalFileSystem()
        return self._fs

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A store sent to another process (a Dask worker of the feature build) brings the root's
        # metric catalogue with it: the worker reads telemetry with the user's metric columns.
        self.__dict__.update(state)
        from ingest.user_metrics import use_recorded_metrics

        use_recorded_metrics(self)

    @property
    def is_local(self) -> bool:
        """Whether the root is on the local filesystem (readers then use polars on the files,
        several times faster here than pyarrow's dataset reader)."""
        if self._fs is None:
            return True
        protocol = self._fs.protocol
        return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    def open(cls, root: str) -> Store:
        """Open an existing data root; refuse anything that is not one."""
        store = cls(root, *filesystem_of(root))
        path, marker = store.path(), store.path(MARKER)
        with guarded("open the data root", path):
            if not store.exists_at(path):
                raise StoreError(
                    f"data root {root!r} does not exist; create it with `gpufail simulate` or `gpufail collect`"
                )
            if not store.exists_at(marker):
                raise StoreError(
                    f"data root {root!r} is not a gpufail dataset: {MARKER} is missing "
                    "(expected a folder written by gpufail)"
                )
            text = store.read_bytes(marker)
        try:
            info = json.loads(text)
            version = int(info["schema_version"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(
                f"{root}/{MARKER}: unreadable marker ({exc}); expected JSON with 'schema_version'"
            ) from None
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"data root {root!r} has schema version {version}; this gpufail reads version {SCHEMA_VERSION}"
            )
        from ingest.user_metrics import use_recorded_metrics

        use_recorded_metrics(store)
        return store

    @classmethod
    def create(cls, root: str) -> Store:
        """Open a data root, creating it if the folder is absent or empty."""
        store = cls(root, *filesystem_of(root))
        path = store.path()
        with guarded("create the data root", path):
            if store.exists_at(f"{path}/{MARKER}"):
                return cls.open(root)
            entries = store.names_in(path) if store.exists_at(path) else []
            fs = store.fs
            for name in entries:
                # A create killed before its marker's rename left the marker half written.
                if name.startswith(temporary_prefix(MARKER)):
                    fs.rm(f"{path}/{name}")
            if any(not name.startswith(temporary_prefix(MARKER)) for name in entries):
                raise StoreError(
                    f"data root {root!r} exists, is not empty and is not a gpufail dataset; "
                    "expected an empty or absent folder"
                )
            fs.makedirs(path, exist_ok=True)
        store.write_bytes_atomic(
            f"{path}/{MARKER}", json.dumps({"format": "gpufail", "schema_version": SCHEMA_VERSION}).encode()
        )
        return store

    @classmethod
    @contextmanager
    def for_import(cls, root: str) -> Iterator[tuple[Store, bool]]:
        """The data root an import writes to, and whether this call created it (it was absent or
        empty, `create`). If the import fails, a root created here is removed again, marker
        and all: a failed first import leaves nothing behind to be mistaken for a dataset."""
        probe = cls(root, *filesystem_of(root))
        path = probe.path()
        with guarded("open the data root", path):
            absent = not probe.exists_at(path)
            existed = not absent and probe.exists_at(f"{path}/{MARKER}")
        store = cls.create(root)
        fs = store.fs
        try:
            yield store, not existed
        except BaseException:
            if not existed:
                with guarded("remove the data root the failed import created", path):
                    if absent:
                        fs.rm(path, recursive=True)
                    else:
                        for entry in fs.ls(path, detail=False):
                            fs.rm(entry, recursive=True)
            raise

    # -- paths -----------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return "/".join([self._path, *parts])

    # -- reading a file or a folder listing: a local root's directly, another through fsspec --

    def exists_at(self, path: str) -> bool:
        """Whether `path` (a file or folder of the root) exists."""
        return os.path.exists(path) if self.is_local else bool(self.fs.exists(path))

    def names_in(self, folder: str) -> list[str]:
        """The names of every entry in `folder`, hidden ones included (fsspec's `ls` of it)."""
        if not self.is_local:
            return [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(folder, detail=False)]
        try:
            return os.listdir(folder)
        except NotADirectoryError:
            return [folder.rsplit("/", 1)[-1]]  # as fsspec lists a file: itself

    def read_bytes(self, path: str) -> bytes:
        """The bytes of the file at `path`."""
        if not self.is_local:
            return bytes(self.fs.cat_file(path))
        with open(path, "rb") as fh:
            return fh.read()

    def open_file(self, path: str) -> BinaryIO:
        """The file at `path`, open for reading (a context manager)."""
        return open(path, "rb") if self.is_local else self.fs.open(path, "rb")  # type: ignore[return-value]

    def exists(self, dataset: str) -> bool:
        return bool(self.files(dataset))

    def dates(self, dataset: str, start: datetime | None = None, end: datetime | None = None) -> list[date]:
        """The dates of a dataset's partitions that hold files readers see, oldest first (a
        partition may hold only hidden files: a write in flight, or one a crash cut short),
        within the days a [start, end) range touches when given."""
        return sorted({_day_of(path) for path in self.files(dataset, *_day_range(start, end))})

    def partitions(self, dataset: str) -> list[tuple[str, list[str]]]:
        """(folder, the names of every file in it) of each date partition of a dataset, hidden
        files included: for writers tidying what they left (`ingest.journal`)."""
        return [(folder, names) for _, folder, names in self._partitions(dataset, None, None)]

    def _partitions(
        self, dataset: str, first_day: date | None, last_day: date | None
    ) -> list[tuple[date, str, list[str]]]:
        base = self.path(dataset)
        with guarded("list the dataset", base):
            if not self.exists_at(base):
                return []
            entries = self.names_in(base)
        found = []
        for name in entries:
            if not name.startswith("date="):
                continue
            day = date.fromisoformat(name.removeprefix("date="))
            if (first_day and day < first_day) or (last_day and day > last_day):
                continue
            folder = f"{base}/{name}"
            with guarded("list the partition", folder):
                names = self.names_in(folder)
            found.append((day, folder, names))
        return sorted(found)

    # -- writing ---------------------------------------------------------------------------

    def write(self, dataset: str, table: pa.Table) -> list[str]:
        """Append rows to a dataset: one new file per UTC date present in `table["ts"]`.

        The table is checked against the dataset's schema first (columns may come in any order;
        types must match or be safely castable), so a bad batch is refused before anything is
        written. Returns the paths written.

        The files are one commit of the journal `append-<dataset>` (`ingest.journal`): readers
        see all of them or, after a kill, none, and the next append to the dataset deletes what
        a killed one left. Appends to one dataset take turns (its journal's lock).
        """
        table = conform(table, dataset)
        with self.journal(f"append-{dataset}", [dataset], wait_s=APPEND_WAIT_S, durable=False) as journal:
            return journal.commit(tables={dataset: table})

    def write_partition(self, dataset: str, day: date, table: pa.Table) -> str:
        """Write one file into `date=day`, for writers that already produce one day at a time
        (committed as `write` commits)."""
        table = conform(table, dataset)
        with self.journal(f"append-{dataset}", [dataset], wait_s=APPEND_WAIT_S, durable=False) as journal:
            staged = journal.staging().write_part_of_day(dataset, day, table)
            return journal.commit(staged=[staged])[0]

    def write_owned(self, dataset: str, day: date, table: pa.Table | Sequence[pa.Table], **parquet_options: Any) -> str:
        """Write one file of a dataset whose schema a later stage owns (features, predictions,
        actions). The owner validates the table; the store gives the same write-once, atomic,
        date-partitioned layout as the raw datasets. `parquet_options` go to
        `pyarrow.parquet.ParquetWriter` (e.g. `use_dictionary`). A sequence of tables (one
        schema) is one file in which each table starts a new row group, so that a reader
        filtering on what sets them apart skips the others by their statistics."""
        return self.write_part(dataset, day.isoformat(), table, **parquet_options)

    def read_owned(self, dataset: str, first_day: date | None = None, last_day: date | None = None) -> pa.Table | None:
        """All rows of an owned dataset within the given days, or None when it has no file."""
        files = self.files(dataset, first_day, last_day, verify=True)
        if not files:
            return None
        found = _datasets().dataset(files, format=_verified_parquet(), filesystem=self.fs)
        if len(files) == 1:
            return self._scan(found, found.to_table)
        # A dataset's schema is taken from its first file unless told otherwise, and an owned
        # schema can grow (a newer gpufail adds a column, e.g. predictions' top_features): take
        # every file's columns, so that rows written before the upgrade read with nulls there
        # and the new column is not dropped.
        try:
            schema = pa.unify_schemas([_physical_schema(f) for f in found.get_fragments()])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise StoreError(f"{self.path(dataset)}: the files disagree on a column's type ({exc})") from None
        found = found.replace_schema(schema)
        return self._scan(found, found.to_table)

    def write_part(
        self,
        dataset: str,
        day: str,
        table: pa.Table | Sequence[pa.Table],
        *,
        hidden_prefix: str = "",
        durable: bool = False,
        **parquet_options: Any,
    ) -> str:
        """Write one part file of `date=day`: to a temporary name, then renamed to
        `<hidden_prefix>part-<id>-crc32-<crc>.parquet` (a prefix starting with "." keeps it from
        readers until its writer says otherwise: see `ingest.journal`). `durable`: the file's
        bytes are on disk before it gets its name (a local store only)."""
        folder = self.path(dataset, f"date={day}")
        part_id = uuid.uuid4().hex
        tmp = f"{folder}/{hidden_prefix or '.'}tmp-{part_id}.parquet"
        try:
            self.fs.makedirs(folder, exist_ok=True)
            pieces = [table] if isinstance(table, pa.Table) else list(table)
            options = {"compression": COMPRESSION, "write_page_checksum": True, **parquet_options}
            with self.fs.open(tmp, "wb") as fh:
                sink = _Crc32Sink(fh)
                with pq.ParquetWriter(sink, pieces[0].schema, **options) as writer:
                    for piece in pieces:
                        writer.write_table(piece, row_group_size=ROW_GROUP_SIZE)
                if durable and self.is_local:
                    fh.flush()
                    os.fsync(fh.fileno())
            final = f"{folder}/{hidden_prefix}part-{part_id}-crc32-{sink.crc:08x}.parquet"
            self.fs.mv(tmp, final)
        except BaseException as exc:
            # Leave nothing behind on any interruption, KeyboardInterrupt included.
            remove_quietly(self.fs, tmp)
            if isinstance(exc, OSError):
                raise StoreError(_write_failure(folder, exc)) from exc
            raise
        return final

    def write_bytes_atomic(self, final: str, data: bytes, *, durable: bool = False) -> None:
        """Replace `final` with `data` in one rename. `durable`: on a local store, the bytes and
        then the rename are on disk when this returns (a power cut keeps the old or the new)."""
        folder, name = final.rsplit("/", 1)
        tmp = f"{folder}/{temporary_prefix(name)}{uuid.uuid4().hex}"
        try:
            with self.fs.open(tmp, "wb") as fh:
                fh.write(data)
                if durable and self.is_local:
                    fh.flush()
                    os.fsync(fh.fileno())
            self.fs.mv(tmp, final)
        except BaseException as exc:
            remove_quietly(self.fs, tmp)
            if isinstance(exc, OSError):
                raise StoreError(describe_os_error(exc, "write", final)) from exc
            raise
        if durable:
            self.sync_folder(folder)

    def sync_folder(self, folder: str) -> None:
        """Make the names in a local folder (files created or renamed there) survive a power cut."""
        if not self.is_local:
            return
        with guarded("sync", folder):
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

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
        dataset_obj = self.dataset(dataset, *_day_range(start, end))
        if columns is not None:
            unknown = sorted(set(columns) - set(expected.names))
            if unknown:
                raise StoreError(f"{dataset}: unknown columns {unknown}; the schema has {expected.names}")
        expr = _time_filter(start, end)
        if filter is not None:
            expr = filter if expr is None else expr & filter
        table = self._scan(dataset_obj, lambda: dataset_obj.to_table(columns=columns, filter=expr))
        return table.replace_schema_metadata(expected.metadata) if columns is None else table

    def dataset(self, dataset: str, first_day: date | None = None, last_day: date | None = None) -> ds.Dataset:
        """A pyarrow dataset over the files of `dataset` dated within the given days (all when
        omitted), each checked against the dataset's schema and its checksum (`verify`)."""
        expected = schema_for(dataset)
        files = self.files(dataset, first_day, last_day, verify=True)
        self._check_schemas(dataset, files, expected)
        return _datasets().dataset(files, schema=expected, format=_verified_parquet(), filesystem=self.fs)

    def files(
        self, dataset: str, first_day: date | None = None, last_day: date | None = None, *, verify: bool = False
    ) -> list[str]:
        """The part files readers see, pruned by the date in their partition folder's name.

        Pruning here, before pyarrow sees the files, means files outside the range are never
        opened, not even their footers. What readers see is what the writers' journals have
        committed (`ingest.journal`): a committed file still under its hidden name counts, a
        file a commit removed does not, and a file no commit named is not there. `verify`:
        check each file's checksum first (`verify`), for callers about to read them."""
        from ingest.journal import commit_view, markers_unchanged

        for _ in range(_LIST_TRIES):
            view = commit_view(self)
            listing = self._partitions(dataset, first_day, last_day)
            if markers_unchanged(self, view):
                break  # else a writer committed or finished while the folders were listed
        files = []
        base = self.path() + "/"
        for _, folder, names in listing:
            files += [f"{folder}/{name}" for name in view.visible(folder.removeprefix(base), names)]
        files.sort()
        if verify:
            self.verify_all(files)
        return files

    def verify_all(self, paths: Sequence[str]) -> None:
        """`verify` each of `paths`, two or more at a time: the CRC and the reads release the
        GIL, so the checks of a week of bucket files take half as long on two cores. The first
        corrupt file in `paths`' order is the error."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(_VERIFY_THREADS, thread_name_prefix="gpufail-verify") as pool:
            list(pool.map(self.verify, paths))

    def verify(self, path: str) -> None:
        """Refuse a part file whose bytes are not those written: the CRC-32 in its name
        (`write_part`) is compared with the file's, on a local store, once per process.
        Remote files are checked page by page as pyarrow reads them (`_verified_parquet()`)
        rather than downloaded twice; object stores keep checksums of their own."""
        match = _CHECKSUMMED.search(path)
        if match is None or not self.is_local:
            return
        with guarded("read", path):
            stat = os.stat(path)
            key = (path, stat.st_size, stat.st_mtime_ns)
            if key in _VERIFIED:
                return
            crc = 0
            with open(path, "rb") as fh:
                while chunk := fh.read(_HASH_CHUNK):
                    crc = zlib.crc32(chunk, crc)
        if f"{crc:08x}" != match[1]:
            raise StoreError(
                f"{path}: corrupt file (CRC-32 {crc:08x}, written as {match[1]}); its rows are not used. "
                f"{_capitalised(remedy(path))}"
            )
        _VERIFIED.add(key)

    def scan(
        self,
        dataset: str,
        start: datetime | None = None,
        end: datetime | None = None,
        columns: Sequence[str] | None = None,
        where: pl.Expr | None = None,
        *,
        schema: Mapping[str, Any] | None = None,
        files: Sequence[str] | None = None,
    ) -> pl.LazyFrame:
        """Rows of `dataset` with `start <= ts < end` (each bound optional) and `where`, only
        `columns` (all when None), as a polars LazyFrame: the one read path of the store.

        Only the files readers see (`files`) of the partitions whose date overlaps the range
        are read, each checked first: its checksum (`verify`), and for a dataset with a store
        schema its columns (a foreign file is named). A local store is scanned by polars (several
        times faster here than pyarrow's dataset reader); another filesystem through pyarrow,
        which checks each page's checksum as it reads. A dataset whose schema a later stage owns
        (features, ...) may have files without a column that newer files have: the first file's
        columns are read. `schema`: the columns of the frame when no file is in range (a store
        schema's dataset has its own). `files`: these files of the dataset instead of those the
        range lists (compaction reads exactly the files it replaces). A file that cannot be
        decoded fails the frame's `collect`; `collect` names it."""
        import polars as pl

        expected = _store_schema(dataset)
        if expected is not None and columns is not None:
            unknown = sorted(set(columns) - set(expected.names))
            if unknown:
                raise StoreError(f"{dataset}: unknown columns {unknown}; the schema has {expected.names}")
        if files is None:
            files = self.files(dataset, *_day_range(start, end), verify=True)
        else:
            files = list(files)
            self.verify_all(files)
        if not files:
            empty = pl.DataFrame(expected.empty_table()) if expected is not None else pl.DataFrame(schema=schema)
            frame = empty.lazy()
        elif self.is_local:
            if expected is not None:
                self._check_schemas(dataset, files, expected)
            if optional_columns(dataset):
                # Older files lack a metric declared later: read it as nulls, by the store schema
                # (without one polars takes the first file's columns and drops the others' extra ones).
                frame = pl.scan_parquet(
                    files,
                    hive_partitioning=False,
                    extra_columns="ignore",
                    schema=pl.from_arrow(expected.empty_table()).schema,  # type: ignore[union-attr]
                    missing_columns="insert",
                )
            else:
                frame = pl.scan_parquet(files, hive_partitioning=False, extra_columns="ignore")
        else:
            frame = pl.scan_pyarrow_dataset(self._pyarrow_dataset(dataset, files, expected))
        ts = pl.Datetime("us", "UTC")
        if start is not None:
            frame = frame.filter(pl.col("ts") >= pl.lit(_utc(start), dtype=ts))
        if end is not None:
            frame = frame.filter(pl.col("ts") < pl.lit(_utc(end), dtype=ts))
        if where is not None:
            frame = frame.filter(where)
        return frame if columns is None else frame.select(list(columns))

    def collect(
        self, frame: pl.LazyFrame, dataset: str, start: datetime | None = None, end: datetime | None = None
    ) -> pl.DataFrame:
        """`frame.collect()` for a frame of `scan(dataset, start, end, ...)`: a file that cannot
        be decoded is named, with what to do about it, in a one-line `StoreError` (polars' own
        message names no file)."""
        import polars as pl

        try:
            return frame.collect()
        except (pl.exceptions.PolarsError, pa.ArrowException, OSError) as exc:
            message = self.unreadable(dataset, *_day_range(start, end))
            if message is None:
                raise
            raise StoreError(message) from exc

    def unreadable(self, dataset: str, first_day: date | None = None, last_day: date | None = None) -> str | None:
        """The one-line message for the first file of `dataset` dated within the days that does
        not read whole (footer and every page, checksums verified), naming it and what to do;
        None when every file reads. Reads every file: for error messages only."""
        for path in self.files(dataset, first_day, last_day):
            try:
                self.verify(path)
                with self.open_file(path) as fh:
                    pq.ParquetFile(fh, page_checksum_verification=True).read()
            except StoreError as exc:
                return str(exc)
            except (pa.ArrowException, OSError, ValueError) as exc:
                return unreadable_message(path, f"{type(exc).__name__}: {_one_line(exc)}")
        return None

    def _check_schemas(self, dataset: str, files: list[str], expected: pa.Schema) -> None:
        """Refuse a file of `dataset` whose columns are not the dataset's schema, by path."""
        optional = optional_columns(dataset)
        # A local file is checked once per process against a schema, like its checksum (`verify`).
        schema_key = hash((expected, optional))  # once: a schema's hash walks its fields
        keys = {path: _file_key(path, schema_key) for path in files} if self.is_local else {}
        todo = [path for path in files if keys.get(path) not in _SCHEMA_CHECKED]
        if not todo:
            return
        # Files of one writer share their columns: each distinct set is checked once (a day of a
        # large fleet's collectors is hundreds of thousands of files).
        passed: set[pa.Schema] = set()
        for first in range(0, len(todo), _SCHEMA_BATCH):
            batch = todo[first : first + _SCHEMA_BATCH]
            found = _datasets().dataset(batch, schema=expected, format=_verified_parquet(), filesystem=self.fs)
            for fragment in found.get_fragments():
                physical = _physical_schema(fragment)
                if physical not in passed:
                    _check_physical(physical, expected, f"{dataset} file {fragment.path}", optional)
                    passed.add(physical)
                if fragment.path in keys:
                    _SCHEMA_CHECKED.add(keys[fragment.path])

    def _pyarrow_dataset(self, dataset: str, files: list[str], expected: pa.Schema | None) -> ds.Dataset:
        if expected is not None:
            self._check_schemas(dataset, files, expected)
            return _datasets().dataset(files, schema=expected, format=_verified_parquet(), filesystem=self.fs)
        found = _datasets().dataset(files, format=_verified_parquet(), filesystem=self.fs)
        # The first file's columns, as polars reads a local store.
        return found.replace_schema(_physical_schema(next(iter(found.get_fragments()))))

    def _scan(self, dataset_obj: ds.Dataset, read: Any) -> pa.Table:
        """`read()` of a dataset; a file that cannot be decoded (a corrupt page, a failed page
        checksum, an I/O error) is named in a one-line error. Only on failure is each file read
        alone to find which one it was."""
        try:
            return read()
        except (OSError, pa.ArrowException) as exc:
            for fragment in dataset_obj.get_fragments():
                try:
                    fragment.to_table()
                except (OSError, pa.ArrowException) as bad:
                    raise StoreError(unreadable_message(fragment.path, _one_line(bad))) from None
            raise StoreError(f"{self.root}: could not read the files ({_one_line(exc)})") from None

    # -- small state files -----------------------------------------------------------------

    def read_state(self, name: str) -> dict[str, Any] | None:
        """The state `name` as its writer last committed it (None when there is none)."""
        from ingest.journal import state_without_commit

        return state_without_commit(self.read_state_raw(name))

    def write_state(self, name: str, state: dict[str, Any], *, durable: bool = False) -> None:
        folder = self.path("_state")
        with guarded("create", folder):
            self.fs.makedirs(folder, exist_ok=True)
        data = json.dumps(state, indent=1, default=str).encode()
        self.write_bytes_atomic(f"{folder}/{name}.json", data, durable=durable)

    def read_state_raw(self, name: str) -> dict[str, Any] | None:
        """The state file as written, with a journal's commit record (`COMMIT_KEY`)."""
        path = self.path("_state", f"{name}.json")
        with guarded("read", path):
            if not self.exists_at(path):
                return None
            text = self.read_bytes(path)
        try:
            state = json.loads(text)
        except ValueError as exc:
            raise StoreError(f"{path}: corrupt state file ({exc}); expected JSON") from None
        if not isinstance(state, dict):
            raise StoreError(f"{path}: corrupt state file; expected a JSON object")
        return state

    def journal(self, name: str, datasets: Sequence[str], **options: Any) -> Journal:
        """Commit files of `datasets` together with the state `name` (`ingest.journal`, which
        describes the `options`); use as a context manager (it holds a lock)."""
        from ingest.journal import Journal

        return Journal(self, name, datasets, **options)


def filesystem_of(root: str) -> tuple[AbstractFileSystem | None, str]:
    """The filesystem and path of a data root: fsspec's for a URL (`s3://...`, `file://...`, a
    chained `a::b`); for a local folder None (`Store.fs`) and the absolute path fsspec gives it."""
    if "://" in root or "::" in root or root.startswith(("file:", "local:", "data:")):
        import fsspec

        fs, path = fsspec.core.url_to_fs(root)
        return fs, path
    return None, _absolute(root)


def _absolute(path: str) -> str:
    """`path` absolute as fsspec's local filesystem writes it (not normalised: `a/../b` stays),
    so that a local root names its files as before (a test compares the two)."""
    if path.startswith("~"):
        path = os.path.expanduser(path)
    elif not path.startswith("/"):
        path = f"{os.getcwd()}/{'' if path == '.' else path.removeprefix('./')}"
    return path.rstrip("/") or "/"


def temporary_prefix(name: str) -> str:
    """How the temporary files of `write_bytes_atomic(.../name)` begin (hidden from readers;
    the owner of `name` may delete those a crash left)."""
    return f".tmp-{name}-"


# The key of a state file that holds a journal's last commit (`ingest.journal`).
COMMIT_KEY = "_commit"
APPEND_WAIT_S = 600.0
"""How long an append (`Store.write`) waits for another append to the same dataset."""


@contextmanager
def guarded(action: str, path: str) -> Iterator[None]:
    """Turn an OSError raised inside into a one-line `StoreError` naming the path."""
    try:
        yield
    except OSError as exc:
        raise StoreError(describe_os_error(exc, action, path)) from exc


def describe_os_error(exc: OSError, action: str, path: str) -> str:
    """The one-line message for an OSError of the store: path, action, reason, what to do."""
    reason = exc.strerror or _one_line(exc) or type(exc).__name__
    where = exc.filename if isinstance(exc.filename, str) and exc.filename else path
    hint = _HINTS.get(exc.errno or 0, "")
    return f"{where}: could not {action} ({reason}){hint}"


_HINTS = {
    errno.EROFS: "; the data root is on a read-only file system: remount it writable or give another --data",
    errno.ENOSPC: "; free space there and run again",
    errno.EDQUOT: "; free space there (disk quota) and run again",
    errno.EACCES: "; gpufail needs read and write access to the data root",
    errno.EPERM: "; gpufail needs read and write access to the data root",
}


class _Crc32Sink:
    """A write-only file that passes bytes on and keeps their CRC-32 (the file's checksum,
    without reading it back)."""

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self.crc = 0

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self._fh.write(data)  # type: ignore[no-any-return]

    def flush(self) -> None:
        self._fh.flush()

    @property
    def closed(self) -> bool:
        return bool(self._fh.closed)


def _physical_schema(fragment: ds.Fragment) -> pa.Schema:
    try:
        return fragment.physical_schema
    except (OSError, pa.ArrowException) as exc:
        raise StoreError(unreadable_message(fragment.path, _one_line(exc))) from None


def _file_key(path: str, schema: int) -> tuple[str, int, int, int]:
    """What identifies a local part file's contents (never rewritten in place) for a schema
    (its hash)."""
    with guarded("read", path):
        stat = os.stat(path)
    return (path, stat.st_size, stat.st_mtime_ns, schema)


def remove_quietly(fs: AbstractFileSystem, path: str) -> None:
    """Best-effort cleanup on a failure path: the failure being reported matters more."""
    try:
        if fs.exists(path):
            fs.rm(path)
    except OSError:
        pass


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def split_by_day(table: pa.Table) -> Iterator[tuple[str, pa.Table]]:
    """(YYYY-MM-DD, rows) for each UTC date of `table["ts"]`, in order of first appearance."""
    if table.num_rows == 0:
        return
    import pyarrow.compute as pc

    days = pc.strftime(table["ts"], format="%Y-%m-%d")
    for day in pc.unique(days).to_pylist():
        yield day, table.filter(pc.equal(days, day))


def _check_physical(
    physical: pa.Schema, expected: pa.Schema, where: str, optional: frozenset[str] = frozenset()
) -> None:
    problems = []
    for field in expected:
        if field.name not in physical.names:
            if field.name in optional:
                continue
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
    import pyarrow.compute as pc

    expr = None
    if start is not None:
        expr = pc.field("ts") >= pa.scalar(_utc(start), TIMESTAMP)
    if end is not None:
        term = pc.field("ts") < pa.scalar(_utc(end), TIMESTAMP)
        expr = term if expr is None else expr & term
    return expr


def _utc(moment: datetime) -> datetime:
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def _write_failure(folder: str, exc: OSError) -> str:
    """The one-line error for a part file that could not be written (disk full, no permission)."""
    reason = exc.strerror or _one_line(exc) or type(exc).__name__
    return (
        f"{folder}: could not write a part file ({reason}); nothing of it was kept and the files "
        f"already there are untouched{_HINTS.get(exc.errno or 0, '')}"
    )


def _day_range(start: datetime | None, end: datetime | None) -> tuple[date | None, date | None]:
    """The first and last UTC day a [start, end) range touches (None: unbounded)."""
    first_day = _utc(start).date() if start is not None else None
    last_day = (_utc(end) - timedelta(microseconds=1)).date() if end is not None else None
    return first_day, last_day


def _store_schema(dataset: str) -> pa.Schema | None:
    """The store's schema of a raw dataset; None for a dataset a later stage owns."""
    try:
        return schema_for(dataset)
    except ValueError:
        return None


def _day_of(path: str) -> date:
    return date.fromisoformat(path.rsplit("/date=", 1)[1].split("/", 1)[0])


# What a file of each dataset is called in a message, and what to do when one is corrupt (a
# dataset not listed is raw data: its source can be ingested again).
_NOUNS = {
    "features": "feature file",
    "buckets": "bucket aggregates file",
    "bucket_presence": "bucket presence file",
    "predictions": "predictions file",
    "actions": "audit file",
}


def _dataset_of(path: str) -> str:
    """The dataset of a part file's path (`.../<dataset>/date=.../<file>`), else ''."""
    return path.rsplit("/date=", 1)[0].rsplit("/", 1)[-1] if "/date=" in path else ""


def remedy(path: str) -> str:
    """What to do about a corrupt or unreadable file of the store, by its dataset."""
    dataset = _dataset_of(path)
    if dataset == "features":
        day = _day_of(path)
        return (
            f"rebuild its day with gpufail features --materialise --start {day} --end {day + timedelta(days=1)} "
            "--overwrite"
        )
    if dataset in ("buckets", "bucket_presence"):
        day = _day_of(path)
        return f"rebuild its day with gpufail features --start {day} --end {day + timedelta(days=1)} --overwrite"
    if dataset == "predictions":
        return "move it away, then run `gpufail score` again"
    if dataset == "actions":
        return "restore it from a copy of the data root, or move it away (its decisions are then not in the audit log)"
    return "restore it from a copy of the data root, or remove it and ingest its source again"


def unreadable_message(path: str, why: str) -> str:
    """The one-line error for a file of the store that does not decode: what it is, why, and
    what to do (`remedy`)."""
    return f"{path}: not a readable {_NOUNS.get(_dataset_of(path), 'Parquet file')} ({why}); {remedy(path)}"


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]
