"""Trailing-window sums and extremes at kept rows (`features.rolling`) against a plain loop."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from features.rolling import (
    BucketArrays,
    KeptRows,
    gauge_moments,
    gpu_segments,
    numpy_with_validity,
    trailing_extremes,
    trailing_last,
    trailing_sums,
)

SIZES = [1, 3, 6, 24]


def _frame(seed: int, kept_share: float = 0.4) -> tuple[pl.Series, pl.Series, pl.Series]:
    """GPUs of 1 to 60 rows; values with nulls and NaNs; a random keep mask keeping about
    `kept_share` of the rows."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, 12)
    gpus = pl.Series("gpu", np.repeat([f"GPU-{i:02d}" for i in range(len(lengths))], lengths))
    values = rng.normal(50, 20, len(gpus)).round(1)
    values[rng.random(len(gpus)) < 0.05] = np.nan
    series = pl.Series("v", values).scatter(np.flatnonzero(rng.random(len(gpus)) < 0.2), None)
    keep = pl.Series(rng.random(len(gpus)) < kept_share)
    return gpus, series, keep


def _column(values: pl.Series) -> tuple[BucketArrays, str]:
    """A column as the kernels read it: the frame's arrays and the column's name."""
    return BucketArrays(values.to_frame("v")), "v"


def _gauge(count: pl.Series, mean: pl.Series, variance: pl.Series) -> tuple[BucketArrays, str, str, str]:
    return BucketArrays(pl.DataFrame({"c": count, "m": mean, "v": variance})), "c", "m", "v"


def _windows(gpus: pl.Series, k: int) -> list[range]:
    """The rows of the window of k rows ending at each row, within its GPU."""
    names = gpus.to_list()
    out = []
    for i, name in enumerate(names):
        start = i
        while start > 0 and names[start - 1] == name and i - start + 1 < k:
            start -= 1
        out.append(range(start, i + 1))
    return out


# 40% kept: every block's sums, read at every row; 3%: each kept row's own, read at their ends.
@pytest.mark.parametrize("kept_share", [0.4, 0.03])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trailing_sums_equal_a_sum_over_each_window_at_the_kept_rows_only(seed, kept_share):
    gpus, values, keep = _frame(seed, kept_share)
    kept = KeptRows(gpus, keep)
    values = values.fill_nan(1.5)  # a running sum would carry a NaN on: the quantities summed have none
    got = trailing_sums(*_column(values), kept, SIZES)
    counted = trailing_sums(*_column(values), kept, SIZES, readings=True)
    plain = values.fill_null(0.0).to_list()
    present = values.is_not_null().to_list()
    rows = np.flatnonzero(keep.to_numpy())
    for k, sums, counts in zip(SIZES, got, counted, strict=True):
        assert len(sums) == len(rows)
        windows = _windows(gpus, k)
        for i, got_sum, got_count in zip(rows, sums, counts, strict=True):
            assert got_sum == pytest.approx(sum(plain[j] for j in windows[i]), abs=1e-9)
            assert got_count == sum(present[j] for j in windows[i])


# 40% kept: the blocks' passes over every row; 3%: each kept row's windows scanned alone.
@pytest.mark.parametrize("kept_share", [0.4, 0.03])
@pytest.mark.parametrize("dtype", [pl.Float64, pl.Float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("how", ["max", "min"])
def test_trailing_extremes_skip_nulls_and_nans_and_are_null_without_a_reading(seed, how, dtype, kept_share):
    gpus, values, keep = _frame(seed, kept_share)
    values = values.cast(dtype)
    assert keep.sum() > 0
    kept = KeptRows(gpus, keep)
    got = trailing_extremes(*_column(values), kept, SIZES, how)
    readings = values.to_list()
    pick = max if how == "max" else min
    for k, extremes in zip(SIZES, got, strict=True):
        windows = _windows(gpus, k)
        expected = []
        for i in np.flatnonzero(keep.to_numpy()):
            present = [readings[j] for j in windows[i] if readings[j] is not None]
            numbers = [v for v in present if not math.isnan(v)]
            expected.append(pick(numbers) if numbers else (math.nan if present else None))
        assert extremes.dtype == pl.Float64
        assert len(extremes) == len(expected)
        for g, e in zip(extremes.to_list(), expected, strict=True):
            assert (g is None and e is None) or (e is not None and math.isnan(e) and math.isnan(g)) or g == e


@pytest.mark.parametrize("how", ["max", "min"])
def test_trailing_extremes_of_few_kept_rows_are_those_of_every_row_to_the_bit(how):
    gpus, values, _ = _frame(3)
    every = trailing_extremes(*_column(values), KeptRows(gpus, None), SIZES, how)
    few = pl.Series(np.arange(len(gpus)) % 40 == 39)
    sparse = trailing_extremes(*_column(values), KeptRows(gpus, few), SIZES, how)
    for all_rows, kept_rows in zip(every, sparse, strict=True):
        assert kept_rows.equals(all_rows.filter(few))


@pytest.mark.parametrize("dtype", [pl.Float64, pl.Float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("limit", [0, 3, 200])
def test_trailing_last_is_the_gpus_forward_fill_within_the_limit_read_at_the_kept_rows(seed, limit, dtype):
    gpus, values, keep = _frame(seed)
    values = values.cast(dtype)
    kept = KeptRows(gpus, keep)
    got = trailing_last(*_column(values), kept, limit)
    filled = pl.DataFrame({"gpu": gpus, "v": values}).select(pl.col("v").forward_fill(limit=limit).over("gpu"))
    expected = filled["v"].filter(keep)
    assert got.dtype == pl.Float64
    assert got.is_null().sum() > 0  # some kept rows find no reading within the limit (or before them)
    assert got.equals(expected)  # NaN is a reading, and kept to the bit


def test_without_a_keep_mask_every_row_is_kept():
    gpus = pl.Series(["a", "a", "a", "b", "b"])
    kept = KeptRows(gpus, None)
    assert kept.rows.tolist() == [0, 1, 2, 3, 4]
    assert kept.first.tolist() == [0, 0, 0, 3, 3]
    (sums,) = trailing_sums(*_column(pl.Series([1.0, 2.0, 4.0, 8.0, 16.0])), kept, [2])
    assert sums.tolist() == [1.0, 3.0, 6.0, 8.0, 24.0]  # b's window does not reach back into a


def test_a_window_longer_than_the_gpus_rows_covers_them_all():
    gpus = pl.Series(["a"] * 3)
    kept = KeptRows(gpus, pl.Series([False, False, True]))
    (mx,) = trailing_extremes(*_column(pl.Series([5.0, None, 2.0])), kept, [168], "max")
    (total,) = trailing_sums(*_column(pl.Series([5.0, None, 2.0])), kept, [168])
    assert mx.to_list() == [5.0]
    assert total.tolist() == [7.0]


def test_gpu_segments_of_an_empty_column():
    segments = gpu_segments(pl.Series([], dtype=pl.String))
    assert len(segments) == 0
    assert trailing_sums(
        *_column(pl.Series([], dtype=pl.Float64)), KeptRows(pl.Series([], dtype=pl.String), None), [1, 6]
    ) == [
        pytest.approx([]),
        pytest.approx([]),
    ]


def _gauge_frame(seed: int) -> tuple[pl.Series, pl.Series, pl.Series, pl.Series, np.ndarray]:
    """GPUs of 1 to 80 hourly buckets of a gauge near 80,000 (count, mean, variance; empty
    buckets without a mean), each GPU starting at its own grid step."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 80, 10)
    gpus = pl.Series("gpu", np.repeat([f"GPU-{i:02d}" for i in range(len(lengths))], lengths))
    steps = np.concatenate([rng.integers(490_000, 490_100) + np.arange(n) for n in lengths])
    count = rng.integers(1, 13, len(gpus)).astype(float)
    mean = 80_000 + rng.normal(0, 3, len(gpus))
    variance = rng.gamma(2.0, 1.5, len(gpus))
    empty = rng.random(len(gpus)) < 0.15
    count[empty] = 0
    variance[count < 2] = np.nan
    return (
        gpus,
        pl.Series("c", count).scatter(np.flatnonzero(empty), None),
        pl.Series("m", mean).scatter(np.flatnonzero(empty), None),
        pl.Series("v", variance).fill_nan(None),
        steps,
    )


def _samples_of(count: float, mean: float, variance: float) -> tuple[float, float]:
    """(sum, sum of squares) of a bucket's samples from its count, mean and sample variance."""
    m2 = 0.0 if math.isnan(variance) else variance * (count - 1)
    return count * mean, m2 + count * mean * mean


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("share", [1.0, 0.3, 0.02])
def test_gauge_moments_equal_the_window_statistics_of_the_samples(seed, share):
    gpus, count, mean, variance, steps = _gauge_frame(seed)
    keep = pl.Series(np.random.default_rng(seed + 7).random(len(gpus)) < share)
    kept = KeptRows(gpus, keep, steps)
    got = gauge_moments(*_gauge(count, mean, variance), kept, SIZES)
    c, m, v = (s.fill_null(math.nan).to_numpy() for s in (count, mean, variance))
    rows = np.flatnonzero(keep.to_numpy())
    for k, (means, stds, slopes) in zip(SIZES, got, strict=True):
        windows = _windows(gpus, k)
        for r, i in enumerate(rows):
            buckets = [j for j in windows[i] if not math.isnan(m[j])]
            n = sum(c[j] for j in buckets)
            if not n:
                assert means[r] is None and stds[r] is None and slopes[r] is None
                continue
            total = sum(_samples_of(c[j], m[j] - 80_000, v[j])[0] for j in buckets)
            squares = sum(_samples_of(c[j], m[j] - 80_000, v[j])[1] for j in buckets)
            assert means[r] == pytest.approx(80_000 + total / n, abs=1e-9)
            if n > 1:
                assert stds[r] == pytest.approx(math.sqrt(max(squares - total * total / n, 0) / (n - 1)), rel=1e-9)
            else:
                assert stds[r] is None
            if len(buckets) > 1:
                expected = np.polyfit(steps[buckets].astype(float), m[buckets] - 80_000, 1)[0]
                assert slopes[r] == pytest.approx(expected, rel=1e-6, abs=1e-9)
            else:
                assert slopes[r] is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_window_value_depends_on_the_window_alone_to_the_last_bit(seed):
    """The same GPU-hours, in frames that start earlier or later, keep more or fewer rows (the
    sums then run over every block or over each kept row's own), give the same bits."""
    gpus, count, mean, variance, steps = _gauge_frame(seed)
    values = (mean - 79_990.0) * 1.1
    whole = KeptRows(gpus, None, steps)
    reference_sums = trailing_sums(*_column(values), whole, SIZES)
    reference_moments = gauge_moments(*_gauge(count, mean, variance), whole, SIZES)
    k_max = max(SIZES)
    segments = gpu_segments(gpus)
    for cut in (1, 5, 17):
        # Each GPU's frame starts `cut` rows later (a GPU of fewer rows keeps its last); the rows
        # with a whole window in the frame are compared.
        firsts = [s + min(cut, e - s - 1) for s, e in zip(segments.starts, segments.ends, strict=True)]
        frame = np.concatenate([np.arange(f, e) for f, e in zip(firsts, segments.ends, strict=True)])
        start = np.concatenate([np.full(e - f, f) for f, e in zip(firsts, segments.ends, strict=True)])
        compared = frame >= start + k_max - 1
        for share in (1.0, 0.05):
            keep = compared & (np.random.default_rng(cut).random(len(frame)) < share)
            if not keep.any():
                continue
            kept = KeptRows(gpus.gather(frame), pl.Series(keep), steps[frame])
            original = frame[keep]
            sums = trailing_sums(*_column(values.gather(frame)), kept, SIZES)
            moments = gauge_moments(
                *_gauge(count.gather(frame), mean.gather(frame), variance.gather(frame)), kept, SIZES
            )
            # The same rows read through their source rows instead of gathered.
            through = KeptRows(gpus.gather(frame), pl.Series(keep), steps[frame], source=frame)
            read = gauge_moments(*_gauge(count, mean, variance), through, SIZES)
            for w in range(len(SIZES)):
                assert np.array_equal(sums[w], reference_sums[w][original])
                for got, by_source, expected in zip(moments[w], read[w], reference_moments[w], strict=True):
                    assert got.equals(expected.gather(original))
                    assert by_source.equals(got)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("share", [1.0, 0.03])
def test_grid_rows_read_through_their_buckets_equal_the_buckets_gathered_onto_the_grid(seed, share):
    """A grid row reads its bucket's values through `KeptRows.source`, and a row without a
    bucket (-1) reads as no reading: the same bits as the bucket columns gathered onto the
    grid, nulls in its empty rows."""
    gpus, count, mean, variance, steps = _gauge_frame(seed)
    rng = np.random.default_rng(seed)
    readings = pl.Series("x", rng.normal(50, 20, len(gpus)).round(2)).scatter(
        np.flatnonzero(rng.random(len(gpus)) < 0.1), None
    )
    buckets = pl.DataFrame(
        {"c": count, "m": mean, "v": variance, "x": readings, "n": pl.Series(rng.integers(0, 9, len(gpus)))}
    )
    # The buckets stored in another order, and some grid rows without one.
    order = rng.permutation(len(gpus))
    stored = buckets[order]
    source = np.argsort(order)
    source[rng.random(len(gpus)) < 0.1] = -1
    gathered = stored.select(pl.all().gather(pl.Series(source).cast(pl.Int64).replace(-1, None)))
    keep = pl.Series(rng.random(len(gpus)) < share)
    on_grid = KeptRows(gpus, keep, steps)
    through = KeptRows(gpus, keep, steps, source=source)
    direct, indirect = BucketArrays(gathered), BucketArrays(stored)
    for how in ("max", "min"):
        for column in ("x", "n"):
            for a, b in zip(
                trailing_extremes(direct, column, on_grid, SIZES, how),
                trailing_extremes(indirect, column, through, SIZES, how),
                strict=True,
            ):
                assert a.equals(b)
    assert trailing_last(direct, "x", on_grid, 5).equals(trailing_last(indirect, "x", through, 5))
    for column in ("n", "x"):
        for readings in (False, True):
            for a, b in zip(
                trailing_sums(direct, column, on_grid, SIZES, readings=readings),
                trailing_sums(indirect, column, through, SIZES, readings=readings),
                strict=True,
            ):
                assert np.array_equal(a, b)
    for a, b in zip(
        gauge_moments(direct, "c", "m", "v", on_grid, SIZES),
        gauge_moments(indirect, "c", "m", "v", through, SIZES),
        strict=True,
    ):
        for x, y in zip(a, b, strict=True):
            assert x.equals(y)


@pytest.mark.parametrize("offset", [0, 3, 8, 11])
def test_numpy_with_validity_reads_a_slice_from_its_first_row(offset):
    values = pl.Series([float(i) if i % 3 else None for i in range(40)], dtype=pl.Float32)
    piece = values.slice(offset, 20)
    got, bits = numpy_with_validity(piece)
    valid = np.unpackbits(bits, bitorder="little")[:20].astype(bool)
    assert valid.tolist() == piece.is_not_null().to_list()
    assert got[valid].tolist() == piece.drop_nulls().to_list()
    assert got.dtype == np.float32
    _, all_valid = numpy_with_validity(pl.Series([1, 2, 3]))
    assert np.unpackbits(all_valid, bitorder="little")[:3].tolist() == [1, 1, 1]
