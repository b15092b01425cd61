"""Trailing-window sums and extremes on a dense grid, computed only at the rows that are kept.

On a dense grid (`features.windows.dense_grid`: every grid time of every GPU, sorted by
(gpu_uuid, ts)) the window of k grid steps at a row is the last k rows of its GPU. A store
build holds the trailing 7-day window before the days it emits, so most rows are only there to
be looked back at: a one-day build keeps one row in eight, a block of 14 days about two in
three. Expressed in polars, the windows put every intermediate on every row: a running sum per
quantity, its value k rows earlier per window, a rolling maximum per window (~500 float columns
per row for the telemetry features), most of them thrown away by the row filter that followed.
Here one compiled pass (numba) per column walks the rows once and writes each window's value
at the kept rows only.

Both reductions restart at each GPU: `segments` are the runs of rows of one GPU.

- `trailing_sums`: for window k, the running sum of the GPU's rows up to the row minus the
  running sum k rows earlier (the sum itself while the GPU has fewer than k rows before it).
  This is the arithmetic of the polars expression it replaced, to the last bit: rounding
  depends only on the GPU's rows from its first in the frame, never on later data.
- `trailing_extremes`: the largest (or smallest) reading among the last k rows, by the van
  Herk / Gil-Werman scheme (prefix and suffix extremes within blocks of k rows: two passes per
  window whatever k). Null readings are absent; NaN readings are skipped unless the window has
  nothing else, as `features.runs` does within a bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import polars as pl

from features.runs import Runs, compiled


def gpu_segments(gpus: pl.Series) -> Runs:
    """The runs of rows of each GPU in a column sorted by GPU."""
    lengths = gpus.rle().struct.field("len").to_numpy() if gpus.len() else np.empty(0, np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.empty(0, np.int64)
    return Runs(starts, gpus.len())


def _segment_starts_of(rows, starts, ends, first):  # type: ignore[no-untyped-def]
    """first[r] = the first row of the GPU that row rows[r] belongs to (rows increasing)."""
    seg = 0
    for r in range(rows.shape[0]):
        while ends[seg] <= rows[r]:
            seg += 1
        first[r] = starts[seg]


def _sums_kernel(values, starts, ends, rows, first, sizes, running, out):  # type: ignore[no-untyped-def]
    for s in range(starts.shape[0]):
        total = 0.0
        for i in range(starts[s], ends[s]):
            total += values[i]
            running[i] = total
    for r in range(rows.shape[0]):
        i = rows[r]
        for w in range(sizes.shape[0]):
            k = sizes[w]
            if k == 1:
                out[w, r] = values[i]
            elif i - k >= first[r]:
                out[w, r] = running[i] - running[i - k]
            else:
                out[w, r] = running[i]


def _max_kernel(values, kind, starts, ends, rows, first, sizes, x, ahead, behind, numbers, nans, out, state):  # type: ignore[no-untyped-def]
    # kind per row: 0 no reading, 1 NaN, 2 a number. state per output: the same for the window.
    # x, ahead, behind, numbers, nans: scratch, one value per row.
    for s in range(starts.shape[0]):
        count_numbers, count_nans = 0, 0
        for i in range(starts[s], ends[s]):
            x[i] = values[i] if kind[i] == 2 else -np.inf
            count_numbers += kind[i] == 2
            count_nans += kind[i] == 1
            numbers[i], nans[i] = count_numbers, count_nans
    for w in range(sizes.shape[0]):
        k = sizes[w]
        if k > 1:
            # ahead[i]: max from the start of i's block to i; behind[i]: from i to the block's end.
            for s in range(starts.shape[0]):
                for block in range(starts[s], ends[s], k):
                    stop = min(block + k, ends[s])
                    best = -np.inf
                    for i in range(block, stop):
                        best = max(best, x[i])
                        ahead[i] = best
                    best = -np.inf
                    for i in range(stop - 1, block - 1, -1):
                        best = max(best, x[i])
                        behind[i] = best
        for r in range(rows.shape[0]):
            i = rows[r]
            j = max(i - k + 1, first[r])  # the window's first row
            if k == 1:
                best = x[i]
            elif j == first[r]:
                best = ahead[i]  # i is in the GPU's first block, which starts at j
            else:
                best = max(behind[j], ahead[i])
            before_numbers = numbers[j - 1] if j > first[r] else 0
            before_nans = nans[j - 1] if j > first[r] else 0
            if numbers[i] > before_numbers:
                out[w, r], state[w, r] = best, 2
            elif nans[i] > before_nans:
                out[w, r], state[w, r] = np.nan, 1
            else:
                out[w, r], state[w, r] = 0.0, 0


class KeptRows:
    """The rows of a dense grid that are kept (all when `keep` is None), with the first row of
    each one's GPU: what both reductions need, worked out once per frame."""

    def __init__(self, gpus: pl.Series, keep: pl.Series | None) -> None:
        self.segments = gpu_segments(gpus)
        self.n = gpus.len()
        self.rows = np.arange(self.n, dtype=np.int64) if keep is None else np.flatnonzero(keep.to_numpy())
        self.first = np.empty(len(self.rows), np.int64)
        compiled(_segment_starts_of)(self.rows, self.segments.starts, self.segments.ends, self.first)
        # Scratch columns over every row, reused by each reduction of the frame (~150 of them):
        # allocating them per column made the kernel's first touch of each page a page fault.
        self.floats = [np.empty(self.n, np.float64) for _ in range(3)]
        self.counts = [np.empty(self.n, np.int64) for _ in range(2)]

    def __len__(self) -> int:
        return len(self.rows)


def _zero_filled(values: pl.Series) -> np.ndarray:
    """The column as a Float64 numpy array, nulls as 0. Cast and filled only when needed: the
    window quantities (~150 columns a part) are Float64 without nulls already, and a cast and a
    fill would each copy the column again. (No speed-up measurable in a whole build: README.)"""
    if values.dtype != pl.Float64:
        values = values.cast(pl.Float64)
    if values.null_count():
        values = values.fill_null(0.0)
    return values.to_numpy()


def trailing_sums(values: pl.Series, kept: KeptRows, sizes: Sequence[int]) -> list[np.ndarray]:
    """Per window size k, the sum of `values` (nulls as 0, as Float64) over the last k rows of
    the GPU at each kept row."""
    flat = _zero_filled(values)
    out = np.empty((len(sizes), len(kept)), np.float64)
    compiled(_sums_kernel)(
        flat,
        kept.segments.starts,
        kept.segments.ends,
        kept.rows,
        kept.first,
        np.asarray(sizes, np.int64),
        kept.floats[0],
        out,
    )
    return list(out)


def trailing_extremes(
    values: pl.Series, kept: KeptRows, sizes: Sequence[int], how: Literal["max", "min"]
) -> list[pl.Series]:
    """Per window size k, the max (or min) reading over the last k rows of the GPU at each kept
    row: Float64, null when the window has no reading, NaN when it has only NaN."""
    sign = 1.0 if how == "max" else -1.0
    floats = values.cast(pl.Float64)
    flat = floats.to_numpy()  # nulls as NaN; the kernel reads only the rows whose kind is 2
    if how == "min":
        flat = -flat
    kind = np.full(len(flat), 2, np.int8)
    kind[np.isnan(flat)] = 1
    if floats.null_count():
        kind[floats.is_null().to_numpy()] = 0
    out = np.empty((len(sizes), len(kept)), np.float64)
    state = np.empty((len(sizes), len(kept)), np.int8)
    compiled(_max_kernel)(
        flat,
        kind,
        kept.segments.starts,
        kept.segments.ends,
        kept.rows,
        kept.first,
        np.asarray(sizes, np.int64),
        *kept.floats,
        *kept.counts,
        out,
        state,
    )
    result = []
    for w in range(len(sizes)):
        s = pl.Series(values.name, sign * out[w], dtype=pl.Float64)
        missing = state[w] == 0
        result.append(s.set(pl.Series(missing), None) if missing.any() else s)
    return result
