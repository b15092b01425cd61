"""`features.column_sort`: a wide frame sorted a few columns at a time equals it sorted whole."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl
import pytest

from features.column_sort import sorted_column_by_column


def _pieces(width: int) -> pl.DataFrame:
    rng = np.random.default_rng(7)
    first = datetime(2026, 1, 1, tzinfo=UTC)
    pieces = []
    for piece in range(4):  # the parts of an on-demand read, each a chunk of its own
        hours = rng.permutation(1_000)[:400]
        pieces.append(
            pl.DataFrame(
                {
                    "ts": [first + timedelta(hours=int(h)) for h in hours],
                    "gpu_uuid": [f"GPU-{piece}-{i % 7}" for i in range(len(hours))],
                    **{f"f{c}": rng.normal(size=len(hours)) for c in range(width - 2)},
                }
            )
        )
    whole = pl.concat(pieces, how="vertical")
    assert whole.n_chunks() == 4
    return whole


@pytest.mark.parametrize("width", [3, 12, 40])
def test_a_frame_of_many_pieces_sorted_column_by_column_equals_it_sorted_whole(width):
    whole = _pieces(width)
    expected = whole.sort("ts", "gpu_uuid")
    given = whole.clone()
    assert sorted_column_by_column(given, ["ts", "gpu_uuid"]).equals(expected)
    assert given.width == 0  # its columns were taken, not copied


@pytest.mark.parametrize("width", [3, 40])
def test_what_is_applied_to_each_batch_of_columns_is_applied_before_the_sort(width):
    # The stored buckets are narrowed to Float32 a few columns at a time as they are put in order.
    whole = _pieces(width)
    narrowed = pl.selectors.starts_with("f")
    expected = whole.with_columns(narrowed.cast(pl.Float32)).sort("ts", "gpu_uuid")
    got = sorted_column_by_column(
        whole.clone(), ["ts", "gpu_uuid"], each=lambda batch: batch.with_columns(narrowed.cast(pl.Float32))
    )
    assert got.equals(expected)
    assert got.schema == expected.schema
