"""Where the walk-forward's fits read their rows: a frame in memory, or the store, day by day.

A fit needs two things: its training pool (every positive and the drawn negatives of its
window, then every row of the last grid time before it is trained, which only tells
`models.train.train_model` where labels settle) and the labelled rows it scores, a few runs
of the evaluation frame (`Span`). Both sources give the same rows in the same order, sorted
by (ts, gpu_uuid) as `features.dataset.read_features` returns them:

- `FrameRows` holds them in memory (what `run_walk_forward` is given);
- `StoreRows` reads them from the store's `features` dataset when a fit asks: the pool through
  the store's training draw (`models.train_store.sampled_rows_between`, the rows
  `gpufail train` reads), the scored rows one UTC day at a time (`read_features`). A process
  then holds one training draw and one day of rows, however long and large the fleet is.

Both are small to pickle except `FrameRows`, which a worker process receives once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from functools import cache
from typing import Protocol

import numpy as np
import pandas as pd
import polars as pl

from features.dataset import computed, drawn_rows, feature_days, read_features
from features.drawn_cache import kept
from ingest.errors import GpufailError
from ingest.store import Store
from models.frame import labels, to_pandas
from models.train import TrainedModel, TrainOptions
from models.train_store import sampled_rows_between


@dataclass(frozen=True)
class Pool:
    """A fit's training pool: the drawn labelled rows with start <= ts < end, then every row
    with last <= ts < anchor (the grid time before the fit's time)."""

    start: pd.Timestamp
    end: pd.Timestamp
    last: pd.Timestamp
    anchor: pd.Timestamp


_MICROSECOND_NS = 1000
"""The store's time resolution: a span ends a microsecond after its last grid time."""


@dataclass(frozen=True)
class Span:
    """A run of consecutive rows of the evaluation frame (`rows`, by position) and the grid
    times they cover, start_ns <= ts < end_ns: every labelled row of those times."""

    rows: slice
    start_ns: int
    end_ns: int


def spans(positions: np.ndarray, ns: np.ndarray) -> list[Span]:
    """Sorted unique positions in the evaluation frame (whose times are `ns`) as runs: a fit
    scores views of the frame, where picking its rows would copy them, and not what lies
    between (the horizon gap). The positions come in whole grid times."""
    if len(positions) == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) > 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(positions)]])
    out = []
    for a, b in zip(starts, ends, strict=True):
        first, last = int(positions[a]), int(positions[b - 1])
        out.append(Span(slice(first, last + 1), int(ns[first]), int(ns[last]) + _MICROSECOND_NS))
    return out


class Rows(Protocol):
    """What a fit reads (`FrameRows` or `StoreRows`)."""

    def pool(self, pool: Pool) -> pd.DataFrame: ...

    def scored(self, span: Span) -> Iterator[pd.DataFrame]:
        """The rows of `span`, in order, in one or more consecutive pieces."""
        ...

    def describe(self) -> str:
        """What one process holds, for an error message."""
        ...


def predict(model: TrainedModel, rows: Rows, runs: list[Span]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`model.predict_score_and_logit` of every row of `runs`, in order, and their labels."""
    raw, z, y = [np.zeros(0)], [np.zeros(0)], [np.zeros(0)]
    for span in runs:
        for piece in rows.scored(span):
            score, logit = model.predict_score_and_logit(piece)
            raw.append(score)
            z.append(logit)
            y.append(labels(piece).to_numpy(dtype=np.float64))
    return np.concatenate(raw), np.concatenate(z), np.concatenate(y)


@dataclass(frozen=True)
class FrameRows:
    """The rows in memory: the evaluation frame, and `training`, the rows of every pool (sorted
    by time, `training_ns`), with which of them the training draw keeps (`drawn`)."""

    evaluation: pd.DataFrame
    training: pd.DataFrame
    training_ns: np.ndarray
    drawn: np.ndarray

    def _between(self, start: pd.Timestamp, end: pd.Timestamp) -> slice:
        lo, hi = np.searchsorted(self.training_ns, [start.value, end.value], side="left")
        return slice(int(lo), int(hi))

    def pool(self, pool: Pool) -> pd.DataFrame:
        window = self._between(pool.start, pool.end)
        keep = np.flatnonzero(self.drawn[window]) + window.start
        last = self._between(pool.last, pool.anchor)
        return self.training.iloc[np.concatenate([keep, np.arange(last.start, last.stop)])]

    def scored(self, span: Span) -> Iterator[pd.DataFrame]:
        yield self.evaluation.iloc[span.rows]

    def describe(self) -> str:
        return f"{len(self.evaluation):,} evaluation and {len(self.training):,} training rows"


@cache
def _open(root: str) -> Store:
    """The store of `root`, opened once per process."""
    return Store.open(root)


def _utc(ns: int) -> datetime:
    return pd.Timestamp(ns, tz="UTC").to_pydatetime()


@dataclass(frozen=True)
class StoreRows:
    """The rows read from the store at `root` when a fit asks for them (see the module notes):
    the pool drawn at `negative_fraction` under `seed`, the scored rows a day at a time."""

    root: str
    negative_fraction: float
    seed: int
    horizon: pd.Timedelta
    scored_root: str | None = None
    """Where the scored rows are read from, when not `root` (a copy of the evaluation period)."""

    def pool(self, pool: Pool) -> pd.DataFrame:
        store = _open(self.root)
        options = TrainOptions(
            kind="lightgbm",  # (any: the options only choose rows)
            train_window=pool.end - pool.start,
            horizon=self.horizon,
            as_of=pool.end + self.horizon,
            negative_fraction=self.negative_fraction,
            seed=self.seed,
        )
        drawn = sampled_rows_between(store, (pool.start, pool.end), options)
        # The last grid time's rows only say where labels settle (they are never trained on):
        # their identity and labels are read, not their features.
        settles = read_features(store, pool.last.to_pydatetime(), pool.anchor.to_pydatetime(), columns=["label"])
        return to_pandas(pl.concat([drawn, settles], how="diagonal"))

    def scored(self, span: Span) -> Iterator[pd.DataFrame]:
        store = _open(self.scored_root or self.root)
        start, end = _utc(span.start_ns), _utc(span.end_ns)
        n = 0
        for day in feature_days(store, start, end):
            midnight = datetime.combine(day, time.min, tzinfo=UTC)
            piece = read_features(store, max(start, midnight), min(end, midnight + timedelta(days=1)))
            piece = piece.filter(pl.col("label").is_not_null())
            n += piece.height
            if piece.height:
                yield to_pandas(piece)
        expected = span.rows.stop - span.rows.start
        if n != expected:
            raise GpufailError(
                f"{self.root}: the features of {start:%Y-%m-%d %H:%M} .. {end:%Y-%m-%d %H:%M} hold {n:,} labelled "
                f"rows, where the walk-forward planned {expected:,}; expected the features unchanged during the run"
            )

    def describe(self) -> str:
        return "one training draw and one day of feature rows"


DRAWN_AHEAD_DAYS = 7
"""Days computed at once by `draw_ahead`: a week's draw at 1,000 paper nodes is ~70k rows."""


def draw_ahead(
    store: Store, span: tuple[pd.Timestamp, pd.Timestamp], negative_fraction: float, seed: int, progress: bool
) -> None:
    """Computes the training draws of [start, end) = `span` into the store's day cache
    (`features.drawn_cache`) a week at a time, when the store computes its features on demand
    and the fits' draws are kept there (seed 0, a share the cache keeps). Every fit then reads
    its pool from the cache: without this, the first fit computed its whole window while the
    evaluation's other inputs were held (the process's peak), and Dask workers each computed the
    same days at once."""
    if seed != 0 or not computed(store) or not kept(negative_fraction):
        return
    from tqdm.auto import tqdm

    start, end = span
    days = feature_days(store, start.to_pydatetime(), end.to_pydatetime())
    for first in tqdm(
        range(0, len(days), DRAWN_AHEAD_DAYS), desc="evaluate drawing", unit="week", disable=not progress
    ):
        lo = datetime.combine(days[first], time.min, tzinfo=UTC)
        last = days[min(first + DRAWN_AHEAD_DAYS, len(days)) - 1]
        hi = datetime.combine(last, time.min, tzinfo=UTC) + timedelta(days=1)
        drawn_rows(store, max(lo, start.to_pydatetime()), min(hi, end.to_pydatetime()), negative_fraction)
