"""The newest grid time's feature rows kept on disk, so that the next process to ask for them (a
serving replica starting after `gpufail score`, a second replica, a scoring run after the
server) reads them instead of computing them again (`features.on_demand.newest_on_demand`).

On the paper fleet those rows (31k GPUs x 420 columns) take a pass over a week of stored
aggregates: tens of seconds and several GB, in every process that loads them, for rows that
are the same in each. They are a function of the stored files they are computed from (the
buckets, and the datasets of the fleet facts), of the spec and of the code that computes them:
that is the key (`rows_key`). One file, `DATA/_cache/newest_rows.bin`, holds the rows of one key,
written and read as every cache file is (`features.cache_file`). Any new file in the store (the
next hour's aggregates, a new XID event) is a new key: the rows are computed again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
from pathlib import Path

import polars as pl

from features.aggregates import BUCKETS
from features.cache_file import CacheFile, files_digest
from features.spec import FeatureSpec
from ingest.store import Store

VERSION = 1
ROWS_FILE = CacheFile("newest_rows.bin", b"gpufail newest rows\n", VERSION)
_ROWS = "rows"
_LIBRARIES = ("polars", "numpy", "numba")
"""Libraries whose versions the rows' values depend on (their arithmetic, their kernels)."""


@functools.cache
def code_digest() -> str:
    """A digest of the source of the code the rows are computed with: the `features` package and
    the store's reader (`ingest`'s top-level modules), and the versions of `_LIBRARIES`. Any
    edit, a deployment of another version included, makes cached rows stale."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sorted([*(root / "features").glob("*.py"), *(root / "ingest").glob("*.py")]):
        digest.update(f"{path.relative_to(root)}\n".encode())
        digest.update(path.read_bytes())
    for library in _LIBRARIES:
        try:
            digest.update(f"{library} {importlib.metadata.version(library)}\n".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{library} absent\n".encode())
    return digest.hexdigest()


def rows_key(store: Store, spec: FeatureSpec, fact_sources: tuple[str, ...]) -> str | None:
    """What the newest rows of `store` computed with `spec` are a function of: every stored
    bucket file and every file of `fact_sources` (names and sizes), the spec and the code. Take
    it before reading anything: rows read after it are of that state of the store or a later
    one, and a later one's rows under an earlier key are never read (files only come and go
    forwards), whereas the other way round would keep an earlier state's rows under a later key."""
    files = {dataset: store.files(dataset) for dataset in (BUCKETS, *fact_sources)}
    return files_digest(store, files, prefix=f"{VERSION}\n{code_digest()}\n{spec.fingerprint}\n")


def load_rows(store: Store, key: str | None) -> pl.DataFrame | None:
    """The cached rows of `key`; None when there are none (`CacheFile.load`)."""
    return ROWS_FILE.load_table(store, key, _ROWS)


def save_rows(store: Store, key: str | None, rows: pl.DataFrame) -> bool:
    """Keep `rows` as those of `key` (replacing the cached ones); False when nothing was
    written (`CacheFile.save`)."""
    return ROWS_FILE.save(store, key, {}, {_ROWS: rows})
