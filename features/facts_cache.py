"""The fleet facts of a store kept on disk, so that a new process (a serving replica starting, a
nightly job, a retrain) reads them instead of computing them again (`features.on_demand`).

`features.plan.fleet_facts` reads the stored GPU presence, the XID events, the repairs and the
failure events, and works out the failure episodes: on a fleet of tens of thousands of GPUs,
seconds of every reader's first read. Those files are written once and replaced, never changed,
so the facts are a function of their names and sizes and of the spec: that is the cache's key
(`facts_key`). One file, `DATA/_cache/fleet_facts.bin`, holds the facts of one key:

- written whole or not at all: to a temporary name, flushed to disk, then renamed over the old
  one (a process killed while writing leaves a hidden temporary file that no reader opens, and
  the next write removes);
- read only when whole and current: a file of another key (the store changed since), another
  format version, a wrong length or checksum, or anything that does not decode is ignored, and
  the facts computed and written again;
- local data roots only: on a remote root nothing is cached (the facts are computed).

Format: `MAGIC`, an 8-byte little-endian header length, a JSON header (version, key, the
scalar facts, and each table's name, byte length and SHA-256), then each table as Arrow IPC.
Bump `VERSION` whenever what `fleet_facts` computes changes: older files are then stale.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import time
from datetime import datetime
from typing import Any

import polars as pl

from features.plan import FleetFacts
from features.spec import FeatureSpec
from ingest.errors import StoreError
from ingest.store import Store, temporary_prefix

VERSION = 1
MAGIC = b"gpufail fleet facts\n"
CACHE_FILE = "fleet_facts.bin"
_TEMPORARY = temporary_prefix(CACHE_FILE)
_STALE_TEMPORARY_S = 600.0
_TABLES = ("presence", "xid", "repairs", "episodes")


def cache_path(store: Store) -> str:
    return store.path("_cache", CACHE_FILE)


def facts_key(store: Store, spec: FeatureSpec, files: dict[str, list[str]]) -> str | None:
    """What the facts of `store` with `spec` are a function of: the spec, and the names and
    sizes of the files they come from (`files`: per dataset, `Store.files`). None when a file
    is gone by the time its size is read (a writer replaced it): nothing is cached then."""
    digest = hashlib.sha256(f"{VERSION}\n{spec.fingerprint}\n".encode())
    for dataset in sorted(files):
        for path in files[dataset]:
            try:
                size = os.path.getsize(path) if store.is_local else 0
            except OSError:
                return None
            digest.update(f"{dataset}\t{os.path.relpath(path, store.path())}\t{size}\n".encode())
    return digest.hexdigest()


def load_facts(store: Store, key: str | None) -> FleetFacts | None:
    """The cached facts of `key`; None when there is no key, the store is remote, or the file
    absent, stale or unreadable in any way."""
    if key is None or not store.is_local:
        return None
    try:
        with open(cache_path(store), "rb") as fh:
            data = fh.read()
        return _decoded(data, key)
    except Exception:
        return None


def save_facts(store: Store, key: str | None, facts: FleetFacts) -> bool:
    """Write the facts of `key` (replacing the cached ones) in one rename, durably
    (`Store.write_bytes_atomic`); False when there is no key, the store is remote, or the file
    could not be written (a read-only root: readers compute the facts)."""
    if key is None or not store.is_local:
        return False
    folder = store.path("_cache")
    try:
        os.makedirs(folder, exist_ok=True)
        _remove_stale_temporaries(folder)
        store.write_bytes_atomic(cache_path(store), b"".join(_encoded(facts, key)), durable=True)
    except (OSError, StoreError):
        return False
    return True


def _encoded(facts: FleetFacts, key: str) -> list[bytes]:
    tables: list[bytes] = []
    described: list[dict[str, Any]] = []
    for name in _TABLES:
        frame = getattr(facts, name)
        if frame is None:
            continue
        buffer = io.BytesIO()
        frame.write_ipc(buffer)
        body = buffer.getvalue()
        tables.append(body)
        described.append({"name": name, "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()})
    header = json.dumps(
        {
            "version": VERSION,
            "key": key,
            "data_end": facts.data_end.isoformat(),
            "first_data": facts.first_data.isoformat(),
            "events_by_source": facts.events_by_source,
            "tables": described,
        }
    ).encode()
    return [MAGIC, len(header).to_bytes(8, "little"), header, *tables]


def _decoded(data: bytes, key: str) -> FleetFacts | None:
    if not data.startswith(MAGIC):
        return None
    offset = len(MAGIC) + 8
    length = int.from_bytes(data[len(MAGIC) : offset], "little")
    header = json.loads(data[offset : offset + length])
    if header.get("version") != VERSION or header.get("key") != key:
        return None
    offset += length
    if offset + sum(t["bytes"] for t in header["tables"]) != len(data):
        return None
    frames: dict[str, pl.DataFrame | None] = dict.fromkeys(_TABLES)
    for table in header["tables"]:
        body = data[offset : offset + table["bytes"]]
        offset += table["bytes"]
        if hashlib.sha256(body).hexdigest() != table["sha256"]:
            return None
        frames[table["name"]] = pl.read_ipc(io.BytesIO(body))
    if any(frames[name] is None for name in ("presence", "xid", "episodes")):
        return None
    return FleetFacts(
        frames["presence"],  # type: ignore[arg-type]
        frames["xid"],  # type: ignore[arg-type]
        frames["repairs"],
        frames["episodes"],  # type: ignore[arg-type]
        datetime.fromisoformat(header["data_end"]),
        datetime.fromisoformat(header["first_data"]),
        {str(s): int(n) for s, n in header["events_by_source"].items()},
    )


def _remove_stale_temporaries(folder: str) -> None:
    """Temporary files of writes killed on the way (older than any write takes)."""
    now = time.time()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(_TEMPORARY):
            with contextlib.suppress(OSError):
                if now - os.path.getmtime(path) > _STALE_TEMPORARY_S:
                    os.remove(path)
