"""Fail-slow (straggler) features: a GPU that keeps running slower than its peers at the same load.

A fail-slow GPU does not crash; it runs its share of a synchronous job at a lower clock, and
every other GPU of the job waits for it at each step. It shows as a **sustained** deficit
against the GPUs that do the same work at the same time:

- its **node peers** run the same job (the same load), so a lower 24 h mean SM clock, or less
  power for the same utilisation, than the median of the node's other GPUs is the board's own;
- its **model peers** (the fleet's GPUs of its model at the same time) tell a board slow from a
  node that is slow as a whole (its cooling, its power feed): the board's highest SM clock over
  the window against the model's median highest clock among GPUs that were loaded in it (the
  highest clock of a loaded board is what it reaches under load, whatever its duty cycle).

Per row of a features frame (each GPU at each grid time; the window statistics come from
`features.windows`), with `<w>` the window (`24h` by default):

| feature | meaning |
| --- | --- |
| `sm_clock_node_deficit_<w>` | 1 - its `sm_clock_mhz_mean_<w>` / the median of its node's other loaded GPUs' (loaded GPUs only) |
| `power_per_util_node_deficit_<w>` | 1 - its power per utilisation point over `<w>` / the median of its node's other GPUs' (loaded GPUs only) |
| `sm_clock_model_deficit_<w>` | 1 - its `sm_clock_mhz_max_<w>` / the median of the loaded GPUs of its model at that time |
| `fail_slow_score_<w>` | the smaller of the node and model clock deficits (both must agree); the one there is when the other has no peers |

Positive is slower than the peers. Null where the GPU (or every peer) has no reading, or was
not loaded in the window. The deficits are relative, so GPU models with different clocks
compare on one scale. The feature build computes them (`features.build`) from the spec's
`fail_slow_window`, among the fleet's GPUs at each grid time: a build in pieces hands each
piece the fleet's model medians (`busy_clocks`, `model_clocks`), as it does the peer features'.
Scoring and the evaluation read the built score (`fail_slow_score`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import polars as pl

from features.peers import median_of_others
from ingest.errors import InputError
from ingest.schema import metric_catalogue

FAIL_SLOW_WINDOW = "24h"
"""The window of the default spec (`features.spec.FeatureSpec.fail_slow_window`); a spec's own
is `FeatureSpec.fail_slow_label`."""
LOADED_UTIL_PCT = 20.0
"""A GPU counts as loaded in the window when its mean utilisation reached this (power per
utilisation point means nothing on an idle board)."""
BUSY_UTIL_PCT = 50.0
"""A GPU is a model peer when its utilisation reached this at some point of the window."""


FAIL_SLOW_METRICS = ("sm_clock_mhz", "power_w", "util_gpu_pct")
"""The telemetry the features compare (through their window statistics, `needed_columns`)."""


def bucket_columns(columns: Sequence[str]) -> list[str]:
    """The columns of a frame of grid buckets (or a dense grid) the window statistics of the
    fail-slow metrics are computed from: all but those of the other metrics."""
    others = [m.column for m in metric_catalogue() if m.column not in FAIL_SLOW_METRICS]
    return [c for c in columns if not any(c.startswith(f"{m}_") for m in others)]


def fail_slow_columns(window: str = FAIL_SLOW_WINDOW) -> tuple[str, ...]:
    """The features' names for `window`."""
    return (
        f"sm_clock_node_deficit_{window}",
        f"power_per_util_node_deficit_{window}",
        f"sm_clock_model_deficit_{window}",
        f"fail_slow_score_{window}",
    )


FAIL_SLOW_MODEL_PREFIXES = ("sm_clock_model_deficit_", "fail_slow_score_")
"""The features that compare a GPU with its model's fleet (the score takes the smaller deficit)."""


def needed_columns(window: str = FAIL_SLOW_WINDOW) -> tuple[str, ...]:
    """The columns of a features frame the features of `window` are computed from."""
    return (
        "ts",
        "cluster",
        "node",
        f"sm_clock_mhz_mean_{window}",
        f"sm_clock_mhz_max_{window}",
        f"power_w_mean_{window}",
        f"util_gpu_pct_mean_{window}",
        f"util_gpu_pct_max_{window}",
    )


CLOCKS_SCHEMA = {"gpu_model": pl.String(), "ts": pl.Datetime("us", "UTC"), "clock": pl.Float64()}
"""The columns of `busy_clocks`."""
MODEL_CLOCK = "_fail_slow_model_clock"
"""The column of `model_clocks`: the model peers' median highest clock at a grid time."""


def _model_key(df: pd.DataFrame) -> pd.Series:
    return df["gpu_model"].astype(str) if "gpu_model" in df.columns else pd.Series("", index=df.index)


def _times(df: pd.DataFrame) -> np.ndarray:
    """The rows' ts as UTC datetime64 values (a tz-aware column's `to_numpy` is of objects)."""
    return pd.to_datetime(df["ts"], utc=True).dt.tz_convert(None).to_numpy(dtype="datetime64[ns]")


def _group_ids(*keys: np.ndarray) -> np.ndarray:
    """0, 1, ... per distinct combination of the rows' `keys` (factorising each key and then
    their codes: a MultiIndex of timestamps and names took most of the features' time)."""
    ids = np.zeros(len(keys[0]), dtype=np.int64)
    for key in keys:
        codes, uniques = pd.factorize(key)
        ids = pd.factorize(ids * (len(uniques) + 1) + codes)[0]
    return ids


def _values(df: pd.DataFrame, column: str) -> np.ndarray:
    return pd.to_numeric(df[column], errors="coerce").to_numpy(dtype=np.float64)


def busy_clocks(frame: Any, window: str = FAIL_SLOW_WINDOW) -> pl.DataFrame:
    """gpu_model (as text), ts and the highest SM clock over `window` of the rows of `frame` (a
    features frame) that were busy in it: what the model peers' median is taken over. A build in
    pieces (shards of nodes) gathers every piece's and takes the fleet's medians of them
    (`model_clocks`)."""
    df = _pandas(frame, window)
    busy = _values(df, f"util_gpu_pct_max_{window}") >= BUSY_UTIL_PCT
    clock = _values(df, f"sm_clock_mhz_max_{window}")
    keep = busy & ~np.isnan(clock)
    return pl.DataFrame(
        {"gpu_model": _model_key(df).to_numpy()[keep].astype(str), "ts": _times(df)[keep], "clock": clock[keep]},
        schema={"gpu_model": pl.String(), "ts": pl.Datetime("ns"), "clock": pl.Float64()},
    ).with_columns(pl.col("ts").dt.replace_time_zone("UTC").dt.cast_time_unit("us"))


def model_clocks(clocks: Sequence[pl.DataFrame]) -> pl.DataFrame:
    """Per gpu_model and ts: the median of the busy GPUs' highest clocks (`busy_clocks` of every
    piece of the fleet), in `MODEL_CLOCK`."""
    frames = [c for c in clocks if c.height]
    if not frames:
        return pl.DataFrame(
            schema={"gpu_model": pl.String(), "ts": pl.Datetime("us", "UTC"), MODEL_CLOCK: pl.Float64()}
        )
    return pl.concat(frames).group_by("gpu_model", "ts").agg(pl.col("clock").median().alias(MODEL_CLOCK))


def _pandas(frame: Any, window: str) -> pd.DataFrame:
    df = frame if isinstance(frame, pd.DataFrame) else frame.to_pandas()
    missing = [c for c in needed_columns(window) if c not in df.columns]
    if missing:
        raise InputError(
            f"fail-slow features: the features frame has no {missing}; expected the `{window}` window "
            "statistics of sm_clock_mhz, power_w and util_gpu_pct (add the window to [features] windows)"
        )
    return df


def fail_slow_features(
    frame: Any, window: str = FAIL_SLOW_WINDOW, *, model_medians: pl.DataFrame | None = None
) -> pd.DataFrame:
    """The fail-slow features (module notes) of each row of `frame` (pandas or polars), in its
    row order, as a pandas frame of `fail_slow_columns(window)`. The model peers are the rows'
    own, or the fleet's given by `model_medians` (`model_clocks`) when `frame` holds only a
    piece of it."""
    df = _pandas(frame, window)

    def values(column: str) -> np.ndarray:
        return _values(df, column)

    clock_mean, util_mean = values(f"sm_clock_mhz_mean_{window}"), values(f"util_gpu_pct_mean_{window}")
    loaded = util_mean >= LOADED_UTIL_PCT
    per_util = np.where(loaded, values(f"power_w_mean_{window}") / np.where(loaded, util_mean, 1.0), np.nan)
    times = _times(df)
    node_id = _group_ids(times, df["cluster"].astype(str).to_numpy(), df["node"].astype(str).to_numpy()) + 1
    # (+1: 0 is "no group" for median_of_others)
    # Only loaded boards compare: an idle board beside a busy job (a fresh replacement, a GPU
    # the job does not use) runs at its idle clock, and is not slow.
    clock_mean = np.where(loaded, clock_mean, np.nan)
    node_clock = median_of_others(node_id, clock_mean)
    node_power = median_of_others(node_id, per_util)

    with np.errstate(invalid="ignore", divide="ignore"):
        node_deficit = 1.0 - clock_mean / node_clock
        power_deficit = 1.0 - per_util / node_power
    model_deficit = _model_deficit(df, window, model_medians)
    names = fail_slow_columns(window)
    found = (node_deficit, power_deficit, model_deficit, _score(node_deficit, model_deficit))
    return pd.DataFrame(dict(zip(names, found, strict=True)), index=df.index)


def with_fleet_model_peers(frame: pl.DataFrame, window: str, model_medians: pl.DataFrame) -> pl.DataFrame:
    """`frame` (a features frame with the fail-slow features of `window`, built from a piece of
    the fleet: whole nodes) with the model deficit, and the score made with it, against the
    fleet's `model_medians` (`model_clocks`); the node deficits are the piece's own."""
    names = fail_slow_columns(window)
    df = _pandas(frame.select(*needed_columns(window), *[c for c in ("gpu_model",) if c in frame.columns]), window)
    model = _model_deficit(df, window, model_medians)
    score = _score(frame[names[0]].cast(pl.Float64).fill_null(np.nan).to_numpy(), model)
    return frame.with_columns(
        pl.Series(name, values, nan_to_null=True).cast(frame.schema[name])
        for name, values in ((names[2], model), (names[3], score))
    )


def _model_deficit(df: pd.DataFrame, window: str, model_medians: pl.DataFrame | None) -> np.ndarray:
    """1 - each busy row's highest clock / the median of its model's busy rows' at its time
    (the frame's own, or `model_medians`)."""
    clock_max = _values(df, f"sm_clock_mhz_max_{window}")
    busy = _values(df, f"util_gpu_pct_max_{window}") >= BUSY_UTIL_PCT
    model = _model_key(df)
    if model_medians is None:
        group = _group_ids(_times(df), model.to_numpy())
        peer_max = pd.Series(np.where(busy, clock_max, np.nan)).groupby(group).transform("median").to_numpy()
    else:
        keys = pl.DataFrame({"gpu_model": model.to_numpy().astype(str), "ts": _times(df)}).with_columns(
            pl.col("ts").dt.replace_time_zone("UTC").dt.cast_time_unit("us")
        )
        peer_max = (
            keys.join(model_medians, on=["gpu_model", "ts"], how="left", maintain_order="left")[MODEL_CLOCK]
            .fill_null(np.nan)
            .to_numpy()
        )
    with np.errstate(invalid="ignore", divide="ignore"):
        return 1.0 - clock_max / np.where(busy, peer_max, np.nan)


def _score(node_deficit: np.ndarray, model_deficit: np.ndarray) -> np.ndarray:
    """The smaller of the two deficits (both peer groups must agree); the one there is."""
    return np.where(
        np.isnan(node_deficit),
        model_deficit,
        np.where(np.isnan(model_deficit), node_deficit, np.fmin(node_deficit, model_deficit)),
    )


def fail_slow_score(frame: pd.DataFrame, window: str = FAIL_SLOW_WINDOW) -> np.ndarray | None:
    """Each row's `fail_slow_score_<window>`: the feature build's (`features.build`, which
    computes the features from the spec's window for the whole fleet at each grid time), or,
    for a frame without it (features built before the build computed them, rows made by hand),
    computed here from its window statistics by the same function over the frame's rows; None
    when the frame has neither."""
    score = fail_slow_columns(window)[-1]
    if score in frame.columns:
        return pd.to_numeric(frame[score], errors="coerce").to_numpy(dtype=np.float64)
    if all(c in frame.columns for c in needed_columns(window)):
        return fail_slow_features(frame, window)[score].to_numpy(dtype=np.float64)
    return None
