"""A file under `DATA/_cache/` that keeps what one process computed from the store for the next
(`features.facts_cache`: the fleet facts; `features.newest_cache`: the newest grid time's rows).

Each file holds the result of one key, a digest of everything the result is a function of (the
names and sizes of the store's files it was computed from, which are written once under unique
names and never changed; the spec; the code):

- written whole or not at all: to a temporary name, flushed to disk, then renamed over the old
  one (a process killed while writing leaves a hidden temporary file that no reader opens, and
  a later write removes);
- read only when whole and current: a file of another key (the store changed since), another
  kind or format version, a wrong length or checksum, or anything that does not decode is
  ignored, and the caller computes the result and writes it again;
- local data roots only: on a remote root nothing is cached.

Format: the kind's magic line, an 8-byte little-endian header length, a JSON header (version,
key, the caller's scalars, and each table's name, byte length and SHA-256), then each table as
Arrow IPC.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import polars as pl

from ingest.errors import StoreError
from ingest.store import Store, temporary_prefix

_STALE_TEMPORARY_S = 600.0


@dataclass(frozen=True)
class CacheFile:
    """One kind of cached result: its file name under `_cache/`, the first line of its files,
    and its format version (bumped whenever what is cached changes meaning: older files are
    then stale)."""

    name: str
    magic: bytes
    version: int
    compression: Literal["uncompressed", "lz4", "zstd"] = "uncompressed"
    """Of the tables' Arrow IPC (large tables of floats: zstd, about 3.5x smaller, read as fast)."""

    def path(self, store: Store) -> str:
        return store.path("_cache", self.name)

    @property
    def temporary_prefix(self) -> str:
        return temporary_prefix(self.name)

    def load(self, store: Store, key: str | None) -> tuple[dict[str, Any], dict[str, pl.DataFrame]] | None:
        """The scalars and tables cached for `key`; None when there is no key, the store is
        remote, or the file is absent, of another key, or unreadable in any way."""
        if key is None or not store.is_local:
            return None
        try:
            with open(self.path(store), "rb") as fh:
                data = fh.read()
            return self._decoded(data, key)
        except Exception:
            return None

    def load_table(self, store: Store, key: str | None, name: str) -> pl.DataFrame | None:
        """The cached table `name` of `key`; None when there is none (`load`)."""
        cached = self.load(store, key)
        return None if cached is None else cached[1].get(name)

    def save(
        self, store: Store, key: str | None, scalars: dict[str, Any], tables: dict[str, pl.DataFrame | None]
    ) -> bool:
        """Replace the cached result with that of `key` in one rename, durably
        (`Store.write_bytes_atomic`); False when there is no key, the store is remote, or the
        file could not be written (a read-only root: readers compute the result). Tables that
        are None are left out."""
        if key is None or not store.is_local:
            return False
        folder = store.path("_cache")
        try:
            os.makedirs(folder, exist_ok=True)
            self._remove_stale_temporaries(folder)
            store.write_bytes_atomic(self.path(store), b"".join(self._encoded(key, scalars, tables)), durable=True)
        except (OSError, StoreError):
            return False
        return True

    def _encoded(self, key: str, scalars: dict[str, Any], tables: dict[str, pl.DataFrame | None]) -> list[bytes]:
        bodies: list[bytes] = []
        described: list[dict[str, Any]] = []
        for name, frame in tables.items():
            if frame is None:
                continue
            buffer = io.BytesIO()
            frame.write_ipc(buffer, compression=self.compression)
            body = buffer.getvalue()
            bodies.append(body)
            described.append({"name": name, "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()})
        header = json.dumps({"version": self.version, "key": key, "scalars": scalars, "tables": described}).encode()
        return [self.magic, len(header).to_bytes(8, "little"), header, *bodies]

    def _decoded(self, data: bytes, key: str) -> tuple[dict[str, Any], dict[str, pl.DataFrame]] | None:
        if not data.startswith(self.magic):
            return None
        offset = len(self.magic) + 8
        length = int.from_bytes(data[len(self.magic) : offset], "little")
        header = json.loads(data[offset : offset + length])
        if header.get("version") != self.version or header.get("key") != key:
            return None
        offset += length
        if offset + sum(t["bytes"] for t in header["tables"]) != len(data):
            return None
        tables: dict[str, pl.DataFrame] = {}
        for table in header["tables"]:
            body = data[offset : offset + table["bytes"]]
            offset += table["bytes"]
            if hashlib.sha256(body).hexdigest() != table["sha256"]:
                return None
            tables[table["name"]] = pl.read_ipc(io.BytesIO(body))
        return header["scalars"], tables

    def _remove_stale_temporaries(self, folder: str) -> None:
        """Temporary files of writes killed on the way (older than any write takes)."""
        now = time.time()
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith(self.temporary_prefix):
                with contextlib.suppress(OSError):
                    if now - os.path.getmtime(path) > _STALE_TEMPORARY_S:
                        os.remove(path)


def files_digest(store: Store, files: dict[str, list[str]], *, prefix: str) -> str | None:
    """A digest of `prefix` and of the names (relative to the root) and sizes of `files` (per
    dataset, `Store.files`): the part of a key that says which state of the store a result is
    of. None when a file is gone by the time its size is read (a writer replaced it): nothing
    is cached then."""
    digest = hashlib.sha256(prefix.encode())
    for dataset in sorted(files):
        for path in files[dataset]:
            try:
                size = os.path.getsize(path) if store.is_local else 0
            except OSError:
                return None
            digest.update(f"{dataset}\t{os.path.relpath(path, store.path())}\t{size}\n".encode())
    return digest.hexdigest()
