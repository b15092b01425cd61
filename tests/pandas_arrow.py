"""pandas -> Arrow/polars conversions for the tests, without pyarrow's Pandas4Warning.

pyarrow (25.x) reads a tz-aware pandas column through `Series.values`, which pandas 3.1
deprecates for DatetimeTZDtype with a Pandas4Warning (apache/arrow#51302,
pandas-dev/pandas#68426). Our own code never does that; the conversion is the same either way.
The warning is silenced only around the third-party call, so a `.values` in our code still shows.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pandas as pd
import polars as pl
import pyarrow as pa
from pandas.errors import Pandas4Warning


@contextmanager
def _pyarrow_reads_tz_values() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Series.values returning an ndarray that drops timezone", category=Pandas4Warning
        )
        yield


def polars_from_pandas(frame: pd.DataFrame) -> pl.DataFrame:
    """`pl.from_pandas(frame)`."""
    with _pyarrow_reads_tz_values():
        return pl.from_pandas(frame)


def arrow_from_pandas(frame: pd.DataFrame, schema: pa.Schema | None = None) -> pa.Table:
    """`pa.Table.from_pandas(frame, schema=schema, preserve_index=False)`."""
    with _pyarrow_reads_tz_values():
        return pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
