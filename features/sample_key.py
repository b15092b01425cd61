"""Which negative rows a retrain draws, decided by a hash of the row's key instead of a random
stream.

A retrain keeps every positive row of its window and a share `f` of the negatives (failures
are ~1 row in 1,000). With a seeded random stream, whether a row is drawn depends on where it
falls in the frame, so only a reader of the whole window can tell. A hash of (gpu_uuid, ts)
makes it a property of the row: the key is the same in every process, polars or pandas, today
or next year, so the feature build can store it (`SAMPLE_KEY`) and write the rows a retrain
at `f <= PRESAMPLED_FRACTION` will read into a row group of their own (`write_features`).
Reading the window is then ~f of the bytes instead of all of them.

`key < key_threshold(f)` draws a row; the keys are uniform over [0, 2^32), so a share `f` of
them falls below the threshold, and a row drawn at `f` is also drawn at every larger share.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pandas as pd
import polars as pl

SAMPLE_KEY = "_sample_key"
"""The stored key column of the features files (UInt32). A storage detail: `read_features`
leaves it out unless it is asked for, so it is never mistaken for a feature."""

PRESAMPLED_FRACTION = 0.1
"""Rows with a key below `key_threshold(PRESAMPLED_FRACTION)`, and every positive, are written
first in each features file, in their own row group: a retrain drawing at most this share of
the negatives (the default is this share) reads only that group."""

_KEY_SPACE = 2**32
_MASK64 = 2**64 - 1
# splitmix64's constants (Steele, Lea and Flood, 2014): a bijective mixer whose output bits
# each depend on every input bit, so consecutive timestamps give unrelated keys.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def key_threshold(fraction: float) -> int:
    """The key below which a negative row is drawn at share `fraction` of the negatives."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"negative_fraction: expected a share in (0, 1], got {fraction!r}")
    return round(fraction * _KEY_SPACE)


def _gpu_hash(uuid: str) -> int:
    # blake2b rather than Python's or polars' hash: both may change between versions (polars
    # says so), and a key written by one version must match one computed by the next.
    return int.from_bytes(hashlib.blake2b(uuid.encode(), digest_size=8).digest(), "little")


def _as_polars(values: Any, name: str) -> pl.Series:
    if isinstance(values, pl.Series):
        return values
    if isinstance(values, pd.Series):
        return pl.from_pandas(values)  # through Arrow: keeps the time zone
    return pl.Series(name, values)


def sample_keys(gpu_uuid: Any, ts: Any, seed: int = 0) -> np.ndarray:
    """The UInt32 key of each (gpu_uuid, ts) row (polars or pandas Series, or arrays; `ts` as
    timezone-aware datetimes). `seed` picks another, equally uniform, set of keys; the stored
    `SAMPLE_KEY` is seed 0."""
    gpu = _as_polars(gpu_uuid, "gpu_uuid")
    if not isinstance(gpu.dtype, pl.Categorical | pl.Enum):
        # A categorical stays one: its distinct values are found and mapped on its codes (a
        # retrain's label rows, 15M of them on the paper fleet, took 2.5 s a week as text).
        gpu = gpu.cast(pl.String)
    moment = _as_polars(ts, "ts")
    if not isinstance(moment.dtype, pl.Datetime):
        raise ValueError(f"ts: expected datetimes, got {moment.dtype}")
    if len(gpu) != len(moment):
        raise ValueError(f"gpu_uuid and ts differ in length ({len(gpu)} and {len(moment)})")
    if gpu.null_count() or moment.null_count():
        raise ValueError("gpu_uuid and ts: expected no nulls (a features row is keyed by both)")
    # group_by rather than unique(): 5x faster on 17M strings of 31k GPUs.
    unique = gpu.to_frame("gpu_uuid").group_by("gpu_uuid").len()["gpu_uuid"]
    hashes = pl.Series([_gpu_hash(u) for u in unique.cast(pl.String).to_list()], dtype=pl.UInt64)
    per_row = gpu.replace_strict(unique, hashes, return_dtype=pl.UInt64).to_numpy()
    micros = moment.dt.epoch("us").to_numpy().astype(np.uint64)
    offset = np.uint64((seed * _GOLDEN) & _MASK64)
    # uint64 arithmetic on arrays wraps, which is what the mixer wants.
    x = per_row + micros * np.uint64(_GOLDEN) + offset
    x ^= x >> np.uint64(30)
    x *= np.uint64(_MIX1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(_MIX2)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(32)).astype(np.uint32)


def drawn(label: np.ndarray, keys: np.ndarray, negative_fraction: float) -> np.ndarray:
    """Which rows a retrain keeps: every positive (label 1) and the negatives (label 0) whose
    key is below the threshold of `negative_fraction`; censored rows (NaN label) never."""
    threshold = key_threshold(negative_fraction)
    return (label == 1) | ((label == 0) & (keys.astype(np.int64) < threshold))
