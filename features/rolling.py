"""Trailing-window sums, moments and extremes on a dense grid, computed only at the rows kept.

On a dense grid (`features.windows.dense_grid`: every grid time of every GPU, sorted by
(gpu_uuid, ts)) the window of k grid steps at a row is the last k rows of its GPU. A store
build holds the trailing 7-day window before the days it emits, so most rows are only there to
be looked back at: a one-day build keeps one row in eight, a block of 14 days about two in
three. Expressed in polars, the windows put every intermediate on every row: a running sum per
quantity, its value k rows earlier per window, a rolling maximum per window (~500 float columns
per row for the telemetry features), most of them thrown away by the row filter that followed.
Here one compiled pass (numba) per column walks the rows and writes each window's value at the
kept rows only.

Every reduction restarts at each GPU: `segments` are the runs of rows of one GPU.

The kernels read the bucket columns where they are (`BucketArrays`: a column's Arrow buffer
and validity bitmap), each grid row through its bucket's row (`KeptRows.source`; -1 for a grid
time without a bucket, which reads as no reading). A reader's grid is a week of the fleet's
buckets, gaps filled: gathering every column onto it, then copying it again to put 0 or NaN in
its nulls, was a third of the work of computing the newest hour.

A value depends on the rows of its window alone, to the last bit, whatever else the frame
holds: a frame that starts a week earlier or later, or keeps other rows, gives the same value.
That is what lets a reader compute any range from its lookback alone (`features.on_demand`).
Sums are therefore not a running sum minus the running sum k rows earlier (whose rounding
depends on where the frame starts) but the van Herk / Gil-Werman scheme with blocks of k grid
steps aligned to the epoch (`KeptRows.steps`): the window ending at row i is the tail of the
block before i's (summed from that block's end backwards) plus the head of i's block (summed
from its start forwards), each summed in a fixed order over rows of the window only. Where few
rows are kept (the newest hour of a week-long frame) each kept row's two pieces are summed
alone (cost k), else every block's are (two passes): the same additions in the same order, so
the same bits.

- `trailing_sums`: the sum of a column over the window.
- `gauge_moments`: a gauge's window mean, standard deviation and slope from its per-bucket
  count, mean and variance. Each piece takes its deviations about a reading of its own (the
  first mean met in its order of summation), so a steady large reading (a memory gauge near
  80,000 MiB) keeps its small spread; the two pieces are then put on one centre and one time
  origin (the older block's start).
- `trailing_extremes`: the largest (or smallest) reading among the last k rows (prefix and
  suffix extremes within blocks of k rows, or each kept row's window scanned alone where few
  rows are kept; exact, so either way gives the same value). Null readings are absent;
  NaN readings are skipped unless the window has nothing else, as `features.runs` does within
  a bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

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


def _pieces_kernel(steps, starts, ends, rows, first, k, dense, head, tail, lo, hi, forward):  # type: ignore[no-untyped-def]
    # Per kept row r: head[r], the first row of its block (of k steps, epoch-aligned, within its
    # GPU), and tail[r], the window's first row. Then the pieces to sum, each a range [lo, hi) of
    # rows summed forwards (from a block's start) or backwards (from a block's end): every
    # block's both ways when `dense`, else each kept row's own two. Returns how many.
    for r in range(rows.shape[0]):
        i = rows[r]
        head[r] = max(i - steps[i] % k, first[r])
        tail[r] = max(i - k + 1, first[r])
    count = 0
    if dense:
        for s in range(starts.shape[0]):
            start = starts[s]
            while start < ends[s]:
                stop = min(start + k - steps[start] % k, ends[s])
                lo[count], hi[count], forward[count] = start, stop, True
                lo[count + 1], hi[count + 1], forward[count + 1] = start, stop, False
                count += 2
                start = stop
    else:
        for r in range(rows.shape[0]):
            lo[count], hi[count], forward[count] = head[r], rows[r] + 1, True
            count += 1
            if tail[r] < head[r]:
                lo[count], hi[count], forward[count] = tail[r], head[r], False
                count += 1
    return count


def _sums_kernel(
    values, bits, readings, source, lo, hi, forward, count, every_row, rows, head, tail, ahead, behind, out
):  # type: ignore[no-untyped-def]
    # ahead[t]: the sum from t's piece start forwards to t; behind[t]: from its end back to t.
    # Row t adds its bucket's value (`source`; -1: none), 0 where null or none; or, with
    # `readings`, 1 where there is a value.
    for p in range(count):
        total = 0.0
        step = 1 if forward[p] else -1
        first, stop = (lo[p], hi[p]) if forward[p] else (hi[p] - 1, lo[p] - 1)
        target = ahead if forward[p] else behind
        for t in range(first, stop, step):
            b = source[t]
            if b >= 0 and (bits[b >> 3] >> (b & 7)) & 1:
                total += 1.0 if readings else np.float64(values[b])
            if every_row or t == stop - step:
                target[t] = total
    for r in range(rows.shape[0]):
        i = rows[r]
        out[r] = behind[tail[r]] + ahead[i] if tail[r] < head[r] else ahead[i]


def _moments_kernel(
    count,
    count_bits,
    mean,
    mean_bits,
    var,
    var_bits,
    source,
    steps,
    k,
    lo,
    hi,
    forward,
    pieces,
    every_row,
    rows,
    head,
    tail,
    ahead,
    behind,
    out,
):  # type: ignore[no-untyped-def]
    # Per row of a piece, from the piece's start (in its order of summation) to the row: the
    # samples n, and about the piece's centre c (its first bucket mean met; NaN: none yet)
    # s = sum of n * (mean - c), q = sum of squares about c; over buckets with a mean, with x the
    # bucket's grid steps from its block's start: bn, bx, bxx, by = sum of (mean - c), bxy.
    # Stored as columns 0..8 (n, s, q, bn, bx, bxx, by, bxy, c) of ahead / behind: at every row
    # of the piece with `every_row` (every block's pieces, which the kept rows share), else at
    # its last row only (each kept row's own pieces: what it reads).
    for p in range(pieces):
        origin = steps[lo[p]] - steps[lo[p]] % k
        if forward[p]:
            first, stop, step = lo[p], hi[p], 1
        else:
            first, stop, step = hi[p] - 1, lo[p] - 1, -1
        n = s = q = bn = bx = bxx = by = bxy = 0.0
        c = np.nan
        for t in range(first, stop, step):
            # The grid row's bucket (-1: none); its bit in `*_bits`: the value is not null. Null
            # (or no bucket) is a count of 0, no mean, no squared deviations.
            b = source[t]
            counted = b >= 0 and (count_bits[b >> 3] >> (b & 7)) & 1
            nb = np.float64(count[b]) if counted else 0.0
            n += nb
            if counted and (var_bits[b >> 3] >> (b & 7)) & 1:
                m2 = var[b] * (nb - 1.0)  # the bucket's sum of squared deviations
                if not np.isnan(m2):
                    q += m2
            if b >= 0 and (mean_bits[b >> 3] >> (b & 7)) & 1 and not np.isnan(mean[b]):
                if np.isnan(c):
                    c = mean[b]
                d = mean[b] - c
                x = float(steps[t] - origin)
                s += nb * d
                q += nb * d * d
                bn += 1.0
                bx += x
                bxx += x * x
                by += d
                bxy += x * d
            if every_row or t == stop - step:
                target = ahead if forward[p] else behind
                target[t, 0], target[t, 1], target[t, 2], target[t, 3] = n, s, q, bn
                target[t, 4], target[t, 5], target[t, 6], target[t, 7], target[t, 8] = bx, bxx, by, bxy, c
    for r in range(rows.shape[0]):
        i = rows[r]
        n, s, q, bn, bx, bxx, by, bxy, c = (
            ahead[i, 0],
            ahead[i, 1],
            ahead[i, 2],
            ahead[i, 3],
            ahead[i, 4],
            ahead[i, 5],
            ahead[i, 6],
            ahead[i, 7],
            ahead[i, 8],
        )
        if tail[r] < head[r]:
            # The older block's tail joins: both on one centre (the newer piece's when it has
            # one) and one time origin (the older block's start, k steps before the newer's).
            j = tail[r]
            n0, s0, q0, bn0, bx0, bxx0, by0, bxy0, c0 = (
                behind[j, 0],
                behind[j, 1],
                behind[j, 2],
                behind[j, 3],
                behind[j, 4],
                behind[j, 5],
                behind[j, 6],
                behind[j, 7],
                behind[j, 8],
            )
            if np.isnan(c):
                c = c0
            shift = 0.0 if np.isnan(c0) else c0 - c
            e = float(k)
            bxy = bxy + e * by
            bxx = bxx + 2.0 * e * bx + e * e * bn
            bx = bx + e * bn
            s = s + (s0 + shift * n0)
            q = q + (q0 + 2.0 * shift * s0 + n0 * shift * shift)
            by = by + (by0 + shift * bn0)
            bxy = bxy + (bxy0 + shift * bx0)
            bxx = bxx + bxx0
            bx = bx + bx0
            bn = bn + bn0
            n = n + n0
        out[0, r] = s / n + c if n > 0 else np.nan
        out[1, r] = np.sqrt(max(q - s * s / n, 0.0) / (n - 1.0)) if n > 1 else np.nan
        denominator = bn * bxx - bx * bx
        out[2, r] = (bn * bxy - bx * by) / denominator if bn > 1 and denominator > 0 else np.nan


def _max_kernel(
    values, bits, sign, source, starts, ends, rows, first, sizes, x, ahead, behind, numbers, nans, out, state
):  # type: ignore[no-untyped-def]
    # Each grid row reads its bucket's value (`source`; -1: none) times `sign`: a reading when
    # its bit in `bits` is set (not null), a number unless NaN. state per output: 0 no reading in
    # the window, 1 only NaN, 2 a number. x, ahead, behind, numbers, nans: scratch, one per row.
    for s in range(starts.shape[0]):
        count_numbers, count_nans = 0, 0
        for i in range(starts[s], ends[s]):
            b = source[i]
            reading = b >= 0 and (bits[b >> 3] >> (b & 7)) & 1
            v = sign * np.float64(values[b]) if reading else 0.0
            number = reading and not np.isnan(v)
            x[i] = v if number else -np.inf
            count_numbers += number
            count_nans += reading and not number
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


def _sparse_max_kernel(values, bits, sign, source, rows, first, sizes, out, state):  # type: ignore[no-untyped-def]
    # Each kept row's window scanned on its own (`_max_kernel`'s outputs): where kept rows are
    # few, cheaper than the blocks' passes over every row. `values` in their own float type:
    # a reading's Float64 is exact, so the extreme is the same value either way.
    for w in range(sizes.shape[0]):
        k = sizes[w]
        for r in range(rows.shape[0]):
            i = rows[r]
            best = -np.inf
            numbers = nans = 0
            for j in range(max(i - k + 1, first[r]), i + 1):
                b = source[j]
                if b >= 0 and (bits[b >> 3] >> (b & 7)) & 1:
                    v = sign * np.float64(values[b])
                    if np.isnan(v):
                        nans += 1
                    else:
                        numbers += 1
                        best = max(best, v)
            if numbers:
                out[w, r], state[w, r] = best, 2
            elif nans:
                out[w, r], state[w, r] = np.nan, 1
            else:
                out[w, r], state[w, r] = 0.0, 0


class KeptRows:
    """The rows of a dense grid that are kept (all when `keep` is None), with the first row of
    each one's GPU: what every reduction needs, worked out once per frame.

    `steps` are the rows' grid times in grid steps since the epoch (consecutive within a GPU,
    as on a dense grid): the sums' blocks are aligned to them, so that a value does not depend
    on where the frame starts. Without them the row numbers stand in (for a frame on its own).

    `source`: per row, the row of the `BucketArrays` its bucket's values are read from (-1
    where the grid row has no bucket); without it, the same row."""

    def __init__(
        self,
        gpus: pl.Series,
        keep: pl.Series | None,
        steps: np.ndarray | None = None,
        source: np.ndarray | None = None,
    ) -> None:
        self.segments = gpu_segments(gpus)
        self.n = gpus.len()
        self.rows = np.arange(self.n, dtype=np.int64) if keep is None else np.flatnonzero(keep.to_numpy())
        self.first = np.empty(len(self.rows), np.int64)
        compiled(_segment_starts_of)(self.rows, self.segments.starts, self.segments.ends, self.first)
        self.steps = np.arange(self.n, dtype=np.int64) if steps is None else np.asarray(steps, np.int64)
        if len(self.steps) != self.n:
            raise ValueError(f"steps: expected one per row ({self.n}), got {len(self.steps)}")
        self.source = np.arange(self.n, dtype=np.int64) if source is None else np.asarray(source, np.int64)
        if len(self.source) != self.n:
            raise ValueError(f"source: expected one per row ({self.n}), got {len(self.source)}")
        # Scratch columns over every row, reused by each reduction of the frame (~150 of them):
        # allocating them per column made the kernel's first touch of each page a page fault.
        self.floats = [np.empty(self.n, np.float64) for _ in range(3)]
        self.counts = [np.empty(self.n, np.int64) for _ in range(2)]
        self._pieces: dict[int, tuple[Any, ...]] = {}
        self._moments: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def pieces(self, k: int) -> tuple[Any, ...]:
        """For windows of k rows: (head, tail, lo, hi, forward, count, every_row), each kept
        row's block start and window start, the pieces to sum (`_pieces_kernel`), and whether
        they are every block's (read at every row), which they are when the kept rows' own would
        add more rows than two passes over the frame."""
        if k not in self._pieces:
            dense = len(self.rows) * k >= 2 * self.n
            size = 2 * self.n if dense else 2 * len(self.rows)
            head, tail = np.empty(len(self.rows), np.int64), np.empty(len(self.rows), np.int64)
            lo, hi, forward = np.empty(size, np.int64), np.empty(size, np.int64), np.empty(size, np.bool_)
            count = compiled(_pieces_kernel)(
                self.steps, self.segments.starts, self.segments.ends, self.rows, self.first, k, dense,
                head, tail, lo, hi, forward,
            )  # fmt: skip
            self._pieces[k] = (head, tail, lo, hi, forward, np.int64(count), dense)
        return self._pieces[k]

    def moment_scratch(self) -> tuple[np.ndarray, np.ndarray]:
        """Two (rows, 9) float arrays for `gauge_moments`, allocated on first use (a row's nine
        together: where only the kept rows' pieces are summed, few pages are touched)."""
        if self._moments is None:
            self._moments = (np.empty((self.n, 9), np.float64), np.empty((self.n, 9), np.float64))
        return self._moments


class BucketArrays:
    """Bucket columns as the window kernels read them: each column's values where polars holds
    them (no copy; a null's slot holds anything) and its validity as a bitmap (bit i of byte
    i // 8, least significant first: set where not null), kept for the parts of a shard to
    share. Grid rows read them through `KeptRows.source` (-1: a grid row without a bucket), so a
    week of the fleet's buckets is not gathered onto its grid, column by column, nor copied again
    to fill its nulls: most of the work of computing the newest hour."""

    def __init__(self, frame: pl.DataFrame) -> None:
        self.frame = frame
        self._kept: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def column(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(values, validity bitmap) of a column (Float64 unless numeric). Two threads asking
        for one column at once may each make them: the same arrays, and no lock to wait on."""
        if name not in self._kept:
            s = self.frame[name]
            if not s.dtype.is_numeric():
                s = s.cast(pl.Float64)
            self._kept[name] = numpy_with_validity(s)
        return self._kept[name]


def numpy_with_validity(s: pl.Series) -> tuple[np.ndarray, np.ndarray]:
    """A numeric column's values (from its Arrow buffer, no copy where it is one chunk) and its
    validity bitmap, both starting at the column's first row."""
    a = s.to_arrow()
    n, offset = len(a), a.offset
    values = np.frombuffer(a.buffers()[1], dtype=a.type.to_pandas_dtype())[offset : offset + n]
    validity = a.buffers()[0]
    if validity is None:
        return values, validity_bitmap(np.ones(n, np.bool_))
    if offset % 8:  # a slice that starts inside a byte: its bits moved to the start
        return values, validity_bitmap(np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")[offset:][:n])
    return values, np.frombuffer(validity, np.uint8)[offset // 8 : offset // 8 + (n + 7) // 8]


def validity_bitmap(valid: np.ndarray) -> np.ndarray:
    """A mask (true: a value) as the kernels read validity, Arrow's layout: bit i of byte i // 8,
    least significant first. Read-only, as Arrow's buffers are: numba compiles a kernel once per
    argument type, writability included, so a column with nulls and one without share one
    compilation (`gpufail.precompile` compiles each kernel ahead for the types a store holds)."""
    bits = np.packbits(valid, bitorder="little")
    bits.flags.writeable = False
    return bits


def trailing_sums(
    buckets: BucketArrays, column: str, kept: KeptRows, sizes: Sequence[int], *, readings: bool = False
) -> list[np.ndarray]:
    """Per window size k, the sum of `column` (nulls as 0, as Float64) over the last k rows of
    the GPU at each kept row; with `readings`, how many of those rows have a value (not null)."""
    values, bits = buckets.column(column)
    out = []
    for k in sizes:
        head, tail, lo, hi, forward, count, every_row = kept.pieces(k)
        sums = np.empty(len(kept), np.float64)
        compiled(_sums_kernel)(
            values, bits, readings, kept.source, lo, hi, forward, count, every_row, kept.rows, head, tail,
            kept.floats[0], kept.floats[1], sums,
        )  # fmt: skip
        out.append(sums)
    return out


def gauge_moments(
    buckets: BucketArrays, count: str, mean: str, variance: str, kept: KeptRows, sizes: Sequence[int]
) -> list[tuple[pl.Series, pl.Series, pl.Series]]:
    """Per window size k, a gauge's (mean, std, slope) over the last k rows of the GPU at each
    kept row, from its per-bucket sample `count`, `mean` and sample `variance` (columns of
    `buckets`; nulls: no reading): the mean and the sample standard deviation over the samples of
    the window (null without a sample, or one), and the least-squares slope of the bucket means
    per grid step (null with fewer than two bucket means). Float64, named `mean`."""
    counts, means, variances = (buckets.column(c) for c in (count, mean, variance))
    ahead, behind = kept.moment_scratch()
    result = []
    for k in sizes:
        head, tail, lo, hi, forward, pieces, every_row = kept.pieces(k)
        out = np.empty((3, len(kept)), np.float64)
        compiled(_moments_kernel)(
            *counts, *means, *variances, kept.source, kept.steps, k, lo, hi, forward, pieces, every_row, kept.rows,
            head, tail,
            ahead, behind, out,
        )  # fmt: skip
        result.append(tuple(_nan_as_null(mean, column) for column in out))
    return result  # type: ignore[return-value]


def _nan_as_null(name: str, values: np.ndarray) -> pl.Series:
    s = pl.Series(name, values, dtype=pl.Float64)
    missing = np.isnan(values)
    return s.set(pl.Series(missing), None) if missing.any() else s


def trailing_extremes(
    buckets: BucketArrays, column: str, kept: KeptRows, sizes: Sequence[int], how: Literal["max", "min"]
) -> list[pl.Series]:
    """Per window size k, the max (or min) reading of `column` over the last k rows of the GPU
    at each kept row: Float64, null when the window has no reading, NaN when it has only NaN."""
    sign = 1.0 if how == "max" else -1.0
    values, bits = buckets.column(column)
    out = np.empty((len(sizes), len(kept)), np.float64)
    state = np.empty((len(sizes), len(kept)), np.int8)
    windows = np.asarray(sizes, np.int64)
    if len(kept) * sum(sizes) < 2 * kept.n:
        # Few kept rows (the newest hour of a week keeps one in 169): each window scanned alone
        # reads fewer rows than the blocks' two passes per window over every row.
        compiled(_sparse_max_kernel)(values, bits, sign, kept.source, kept.rows, kept.first, windows, out, state)
    else:
        compiled(_max_kernel)(
            values,
            bits,
            sign,
            kept.source,
            kept.segments.starts,
            kept.segments.ends,
            kept.rows,
            kept.first,
            windows,
            *kept.floats,
            *kept.counts,
            out,
            state,
        )
    result = []
    for w in range(len(sizes)):
        s = pl.Series(column, sign * out[w], dtype=pl.Float64)
        missing = state[w] == 0
        result.append(s.set(pl.Series(missing), None) if missing.any() else s)
    return result


def _last_kernel(values, bits, source, rows, first, limit, out, found):  # type: ignore[no-untyped-def]
    for r in range(rows.shape[0]):
        found[r] = False
        j = rows[r]
        while j >= max(first[r], rows[r] - limit):
            b = source[j]
            if b >= 0 and (bits[b >> 3] >> (b & 7)) & 1:
                out[r] = values[b]
                found[r] = True
                break
            j -= 1


def trailing_last(buckets: BucketArrays, column: str, kept: KeptRows, limit: int) -> pl.Series:
    """At each kept row, the GPU's last reading (non-null value) of `column` among that row and
    the `limit` rows before it (`forward_fill(limit).over(gpu)` read at the kept rows), as
    Float64; null when there is none. Walking back from the kept rows only: the newest hour
    keeps one row in 168, and the fill over every row of the frame cost more than the rest of
    its windows."""
    values, bits = buckets.column(column)
    out, found = last_valid(values, bits, kept, limit, np.float64)
    s = pl.Series(column, out, dtype=pl.Float64)
    return s if found.all() else s.set(pl.Series(~found), None)


def last_valid(
    values: np.ndarray, bits: np.ndarray, kept: KeptRows, limit: int, dtype: type[np.generic]
) -> tuple[np.ndarray, np.ndarray]:
    """At each kept row, the GPU's last value whose bit in the bitmap `bits` is set (see
    `BucketArrays`) among that row and the `limit` rows before it, as `dtype`, and whether there
    was one (`trailing_last` on arrays; row j reads element `kept.source[j]`)."""
    out = np.empty(len(kept), dtype)
    found = np.empty(len(kept), np.bool_)
    compiled(_last_kernel)(values, bits, kept.source, kept.rows, kept.first, limit, out, found)
    return out, found
