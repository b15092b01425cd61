"""Shards of a fleet for the feature build: groups of whole nodes, and the carried grid buckets
kept per shard.

A GPU's features need its own history and, at each grid time, the other GPUs of its node (node
peer features); nothing else but the fleet median per GPU model, which the store build computes
from every GPU's buckets of a day before sharding them (`features.peers.model_medians`). So a
shard of whole nodes can be built on its own, and the store build builds a time block of many
days for one shard at a time: its memory is one shard's buckets, not the fleet's, and the
trailing window before a block is computed once per block instead of once per day.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import threading
from datetime import date, datetime
from pathlib import Path

import polars as pl

from features.schema import TS_DTYPE

GPU = "gpu_uuid"
NODE = ["cluster", "node"]
SHARD = "_shard"


def node_groups(presence: pl.DataFrame, partition_nodes: int) -> list[pl.DataFrame]:
    """Whole (cluster, node) pairs in groups of about `partition_nodes`, in name order; nodes
    that reported the same GPU uuid are always in one group (union-find over the GPUs)."""
    if partition_nodes < 1:
        raise ValueError(f"partition_nodes: expected at least 1, got {partition_nodes}")
    pairs = presence.select(*NODE, GPU).unique()
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(x: tuple[str, str]) -> tuple[str, str]:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for nodes in pairs.group_by(GPU).agg(pl.struct(*NODE).alias("n"))["n"].to_list():
        first = find((nodes[0]["cluster"], nodes[0]["node"]))
        for other in nodes[1:]:
            parent[find((other["cluster"], other["node"]))] = first
    members: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for key in sorted(parent):
        members.setdefault(find(key), []).append(key)
    groups: list[list[tuple[str, str]]] = []
    for component in sorted(members.values()):
        if groups and len(groups[-1]) + len(component) <= partition_nodes:
            groups[-1].extend(component)
        else:
            groups.append(list(component))
    return [pl.DataFrame(g, schema=NODE, orient="row") for g in groups]


def shard_map(presence: pl.DataFrame, *, gpu_buckets: int, max_buckets: int) -> pl.DataFrame:
    """(cluster, node, `_shard`) for every node of `presence`: the fewest shards of whole nodes
    such that one shard holds about `max_buckets` carried buckets when every GPU carries
    `gpu_buckets` (0 allows one node per shard). One shard when the fleet fits."""
    if presence.height == 0 or not set(NODE) <= set(presence.columns):
        return pl.DataFrame(schema={"cluster": pl.String, "node": pl.String, SHARD: pl.Int32})
    nodes = presence.select(*NODE).unique().height
    needed = presence[GPU].n_unique() * gpu_buckets
    shards = nodes if max_buckets <= 0 else max(1, math.ceil(needed / max_buckets))
    groups = node_groups(presence, max(1, math.ceil(nodes / min(shards, nodes))))
    return pl.concat(
        [g.with_columns(pl.lit(i, dtype=pl.Int32).alias(SHARD)) for i, g in enumerate(groups)], how="vertical"
    )


def shard_count(shards: pl.DataFrame) -> int:
    """How many shards a `shard_map` has (ids 0 .. count - 1; one for an empty map)."""
    return max(1, shards[SHARD].n_unique()) if shards.height else 1


class ShardedBuckets:
    """Grid buckets carried between the days of a store build, per shard of whole nodes
    (`shard_map`). With one shard they stay in memory; with more, each day's buckets of each
    shard go to an Arrow IPC file in a private temporary folder (removed by `close`), and a
    shard's are read back when its block is built. The files are uncompressed: they are read
    once or twice, soon after they are written.

    One thread may `add` the next days while others `take` a block's (the store build reads
    ahead while it builds): `take` reads only up to its `before`, and the lists of what is held
    change under a lock. `forget` and `close` are for when no `take` is running."""

    def __init__(self, shards: pl.DataFrame, *, scratch: str | None = None) -> None:
        self.shards = shards
        self.count = shard_count(shards)
        self._memory: list[pl.DataFrame] = []
        # Per shard: (first ts, last ts, file) of each day's buckets.
        self._files: dict[int, list[tuple[datetime, datetime, Path]]] = {}
        self._lock = threading.Lock()
        self._folder = Path(tempfile.mkdtemp(prefix="gpufail-buckets-", dir=scratch)) if self.count > 1 else None

    def add(self, day: date, buckets: pl.DataFrame) -> None:
        """Keep the buckets aggregated from one day of telemetry."""
        if buckets.height == 0:
            return
        if self._folder is None:
            with self._lock:
                self._memory.append(buckets)
            return
        # A bucket whose node is not in the map (not possible when the map comes from the same
        # store's presence) goes to shard 0 rather than being lost.
        tagged = buckets.join(self.shards, on=NODE, how="left", nulls_equal=True, maintain_order="left")
        tagged = tagged.with_columns(pl.col(SHARD).fill_null(0))
        for (shard,), part in tagged.partition_by(SHARD, as_dict=True, include_key=False).items():
            path = self._folder / f"shard={shard}-day={day.isoformat()}.arrow"
            part.write_ipc(path)
            with self._lock:
                self._files.setdefault(int(shard), []).append((part["ts"].min(), part["ts"].max(), path))  # type: ignore[arg-type]

    def rows(self) -> int:
        """Buckets held in memory (0 when they are on disk)."""
        with self._lock:
            return sum(f.height for f in self._memory)

    def take(self, shard: int, after: datetime, before: datetime | None = None) -> pl.DataFrame | None:
        """The shard's buckets with `after` < ts (< `before` when given); None when it has none."""
        within = pl.col("ts") > pl.lit(after, dtype=TS_DTYPE)
        if before is not None:
            within &= pl.col("ts") < pl.lit(before, dtype=TS_DTYPE)
        with self._lock:
            memory, files = list(self._memory), list(self._files.get(shard, []))
        if self._folder is None:
            frames = [f.filter(within) for f in memory]
        else:
            wanted = [p for first, last, p in files if last > after and (before is None or first < before)]
            frames = [pl.read_ipc(p).filter(within) for p in wanted]
        frames = [f for f in frames if f.height]
        if not frames:
            return None
        # One chunk, not one per day: joins and gathers on a chunked frame were 2-3x slower.
        return pl.concat(frames, how="vertical_relaxed", rechunk=True) if len(frames) > 1 else frames[0]

    def forget(self, until: datetime) -> None:
        """Drop the buckets with ts <= `until` (no later block needs them)."""
        keep_from = pl.lit(until, dtype=TS_DTYPE)
        with self._lock:
            self._memory = [f for f in (f.filter(pl.col("ts") > keep_from) for f in self._memory) if f.height]
            for shard, files in self._files.items():
                for _, last, path in files:
                    if last <= until:
                        path.unlink(missing_ok=True)
                self._files[shard] = [entry for entry in files if entry[1] > until]

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        self._memory, self._files = [], {}
