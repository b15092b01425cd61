"""The fleet facts of a store kept on disk, so that a new process (a serving replica starting, a
nightly job, a retrain) reads them instead of computing them again (`features.on_demand`).

`features.plan.fleet_facts` reads the stored GPU presence, the XID events, the repairs and the
failure events, and works out the failure episodes: on a fleet of tens of thousands of GPUs,
seconds of every reader's first read. Those files are written once and replaced, never changed,
so the facts are a function of their names and sizes and of the spec: that is the cache's key
(`facts_key`). One file, `DATA/_cache/fleet_facts.bin`, holds the facts of one key, written and
read as every cache file is (`features.cache_file`: whole or not at all, ignored when stale or
damaged). Bump `VERSION` whenever what `fleet_facts` computes changes: older files are then stale.
"""

from __future__ import annotations

from datetime import datetime

from features.cache_file import CacheFile, files_digest
from features.plan import FleetFacts
from features.spec import FeatureSpec
from ingest.store import Store

VERSION = 3
CACHE_FILE = "fleet_facts.bin"
# zstd: the XID events are most of the file (796k incidents of the paper fleet: 144 MB as they
# are, 19 MB compressed), and every process that computes features reads it whole and checks its
# digest (0.13 s of the 144 MB alone), where decompressing costs 0.02 s more than decoding.
FACTS_FILE = CacheFile(CACHE_FILE, b"gpufail fleet facts\n", VERSION, compression="zstd")
_TEMPORARY = FACTS_FILE.temporary_prefix
_TABLES = ("presence", "xid", "repairs", "episodes")


def cache_path(store: Store) -> str:
    return FACTS_FILE.path(store)


def facts_key(store: Store, spec: FeatureSpec, files: dict[str, list[str]]) -> str | None:
    """What the facts of `store` with `spec` are a function of: the spec, and the names and
    sizes of the files they come from (`files`: per dataset, `Store.files`). None when a file
    is gone by the time its size is read (a writer replaced it): nothing is cached then."""
    return files_digest(store, files, prefix=f"{VERSION}\n{spec.fingerprint}\n")


def load_facts(store: Store, key: str | None) -> FleetFacts | None:
    """The cached facts of `key`; None when there is no key, the store is remote, or the file
    absent, stale or unreadable in any way."""
    cached = FACTS_FILE.load(store, key)
    if cached is None:
        return None
    scalars, tables = cached
    if any(name not in tables for name in ("presence", "xid", "episodes")):
        return None
    try:
        return FleetFacts(
            tables["presence"],
            tables["xid"],
            tables.get("repairs"),
            tables["episodes"],
            datetime.fromisoformat(scalars["data_end"]),
            datetime.fromisoformat(scalars["first_data"]),
            {str(s): int(n) for s, n in scalars["events_by_source"].items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def save_facts(store: Store, key: str | None, facts: FleetFacts) -> bool:
    """Write the facts of `key` (replacing the cached ones); False when nothing was written
    (`CacheFile.save`: no key, a remote store, a read-only root)."""
    scalars = {
        "data_end": facts.data_end.isoformat(),
        "first_data": facts.first_data.isoformat(),
        "events_by_source": facts.events_by_source,
    }
    return FACTS_FILE.save(store, key, scalars, {name: getattr(facts, name) for name in _TABLES})
