"""Training on a Dask cluster: `lightgbm.dask` / `xgboost.dask` over the `features` dataset,
producing the same `models.train.TrainedModel` as `models.train.train_model`, so scoring, the
registry and the reports do not know where a model was trained.

What is the same as `train_model`: the training window (`training_rows`' bounds: the
`train_window` ending at the last settled grid time, or a horizon before `as_of`), every
positive and a share `negative_fraction` of the negatives, the positive weight (neg/pos of the
sample capped at `max_pos_weight`) and the one odds correction `predict_risk` divides out,
monotone constraints, and every hyperparameter: the estimator `models.kinds.make_model`
builds is the one whose parameters the Dask estimator gets.

What differs: each date file of the window is read, windowed and subsampled on a worker (seeded
per file), so the sample is another draw from the same distribution than the single-machine
one, and the trees are grown by data-parallel LightGBM / XGBoost across the workers (histograms
summed over workers). Held-out metrics agree within sampling noise;
`tests/models/test_distributed.py` states the tolerance.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from datetime import date
from typing import Any

import numpy as np
import pandas as pd
import polars as pl

from features.dataset import feature_days, read_features
from ingest.errors import InputError
from ingest.store import Store
from models.estimators import CategoryCodes, balanced_pos_weight, odds_factor
from models.frame import CATEGORICAL_COLUMNS, feature_columns, split_xy
from models.kinds import kind_params, make_model
from models.split import as_timedelta
from models.train import (
    TrainedModel,
    TrainOptions,
    check_both_classes,
    check_negative_fraction,
    library_versions,
    matching_features,
    sample_negatives,
)
from models.train_store import calibrated_from_store, window_label_counts, with_store_spec

DASK_KINDS = ("lightgbm", "xgboost")
_LABEL, _TS = "_label", "_ts"
_US = pd.Timedelta(microseconds=1)


def _part(
    day: date,
    seed: int,
    *,
    store: Store,
    bounds: tuple[pd.Timestamp, pd.Timestamp],
    inputs: Sequence[str],
    negative_fraction: float,
) -> pd.DataFrame:
    """One date partition's training rows: in the window, labelled, every positive and a seeded
    share of the negatives; the model inputs (`split_xy`), the label and the grid time."""
    start, end = bounds
    whole = pd.Timestamp(day, tz="UTC")
    frame = read_features(store, start=whole.to_pydatetime(), end=(whole + pd.Timedelta(days=1)).to_pydatetime())
    frame = frame.filter(pl.col("ts").is_between(start.to_pydatetime(), end.to_pydatetime(), closed="left"))
    X, y, ids = split_xy(sample_negatives(frame, negative_fraction, seed), inputs)
    X[_LABEL] = y
    X[_TS] = pd.to_datetime(ids["ts"], utc=True).dt.tz_convert(None)  # naive UTC: dask reduces it without warnings
    return X.reset_index(drop=True)


def _tracker_host(client: Any) -> str | None:
    """XGBoost's tracker address: loopback when every worker is on this machine (a LocalCluster,
    so nothing listens beyond 127.0.0.1), else XGBoost's own choice (the scheduler's address)."""
    from urllib.parse import urlparse

    hosts = {urlparse(w).hostname for w in client.scheduler_info()["workers"]}
    return "127.0.0.1" if hosts <= {"127.0.0.1", "localhost", None} else None


def _fit(kind: str, client: Any, local: Any, X: Any, y: Any) -> Any:
    """Fit the Dask twin of the unfitted estimator `local` and return a fitted local estimator
    of `local`'s class (what `TrainedModel` pickles and scores with, no cluster needed)."""
    params = local.get_params()
    if kind == "lightgbm":
        from lightgbm.dask import DaskLGBMClassifier

        with warnings.catch_warnings():
            # Each worker's LightGBM uses that worker's threads: n_jobs is ignored, with a warning.
            warnings.filterwarnings("ignore", message="Parameter n_jobs will be ignored")
            model = DaskLGBMClassifier(client=client, **params).fit(X, y)
        return model.to_local()
    from xgboost import XGBClassifier
    from xgboost.collective import Config
    from xgboost.dask import DaskXGBClassifier

    dask_model = DaskXGBClassifier(coll_cfg=Config(tracker_host_ip=_tracker_host(client)), **params)
    dask_model.client = client
    dask_model.fit(X, y, verbose=False)
    fitted = XGBClassifier(**params)
    fitted.load_model(bytearray(dask_model.get_booster().save_raw("ubj")))
    return fitted


def train_model_distributed(client: Any, store: Store, options: TrainOptions) -> TrainedModel:
    """`models.train.train_model` for `kind` lightgbm or xgboost on the Dask cluster of
    `client`, reading the store's `features` dataset on the workers (see the module notes).
    With `options.calibration`, the calibration slice's drawn rows (a small share of a window)
    are read and scored here (`models.train_store.calibrated_from_store`)."""
    if options.kind not in DASK_KINDS:
        raise InputError(
            f"model kind {options.kind!r}: training on Dask supports {list(DASK_KINDS)}; "
            "set [dask] scheduler = '' to train it on one machine"
        )
    options = with_store_spec(store, options)
    return calibrated_from_store(
        store, options, lambda fit_options, window: _train_distributed(client, store, fit_options, window)
    )


def _train_distributed(
    client: Any, store: Store, options: TrainOptions, bounds: tuple[pd.Timestamp, pd.Timestamp]
) -> TrainedModel:
    import dask.dataframe as dd

    kind = options.kind
    check_negative_fraction(options.negative_fraction)
    user_params = dict(options.params)
    options = options.drawn_from(*window_label_counts(store, *bounds))
    negative_fraction, where = options.negative_fraction, options.window_name
    days = [d for d in feature_days(store) if bounds[0].date() <= d <= (bounds[1] - _US).date()]
    if bounds[1] <= bounds[0] or not days:
        raise InputError(f"{where}: no feature rows in {bounds[0]} .. {bounds[1]}; widen train_window")
    # The input columns, from one (empty) read: the same for every date (the features schema).
    schema_frame = read_features(store, start=pd.Timestamp(days[-1], tz="UTC").to_pydatetime()).head(0)
    columns = feature_columns(schema_frame)
    if not [c for c in columns if c not in CATEGORICAL_COLUMNS]:
        raise InputError(f"{where}: no feature columns (expected numeric columns besides ids and labels)")
    seeds = np.random.SeedSequence(options.seed).generate_state(len(days)).tolist()
    meta = _part(days[-1], 0, store=store, bounds=(bounds[0], bounds[0]), inputs=columns, negative_fraction=1.0)
    rows = dd.from_map(
        _part, days, seeds, meta=meta, store=store, bounds=bounds, inputs=columns, negative_fraction=negative_fraction
    )
    # The sample stays in the workers' memory: counted, encoded and trained on without re-reading.
    rows = client.persist(rows)
    lengths = client.compute(rows.map_partitions(len)).result().tolist()
    rows = rows.partitions[[i for i, n in enumerate(lengths) if n]]
    y_all = rows[_LABEL]
    n_rows = sum(lengths)
    n_pos, ts_min, ts_max = client.compute([y_all.sum(), rows[_TS].min(), rows[_TS].max()], sync=True)
    n_pos = int(n_pos)
    check_both_classes(n_rows, n_pos, where)
    monotone = options.monotone_increasing
    chosen = matching_features(monotone, columns) if monotone else []
    pos_weight = balanced_pos_weight(
        np.repeat(np.array([1, 0], dtype=np.int8), [n_pos, n_rows - n_pos]), options.max_pos_weight
    )
    pipeline = make_model(
        kind, pos_weight=pos_weight, monotone_increasing=tuple(chosen), columns=list(columns), **user_params
    )
    # The string columns' codes are learnt from their values over the whole sample, which is
    # what `CategoryCodes.fit` on the whole sample would learn.
    categorical = [c for c in columns if c in CATEGORICAL_COLUMNS]
    # (Per-partition de-duplication: dask's own `unique` would shuffle the sample between workers.)
    distinct = client.compute(rows[categorical].map_partitions(pd.DataFrame.drop_duplicates), sync=True)
    values = [distinct[c].unique() for c in categorical]
    longest = max([len(v) for v in values], default=1)
    example = pd.DataFrame({c: np.nan for c in columns}, index=range(longest))
    for c, v in zip(categorical, values, strict=True):
        example[c] = np.resize(np.asarray(v, dtype=object), longest)
    encode = CategoryCodes().fit(example[list(columns)])
    X = rows[list(columns)].map_partitions(encode.transform, meta=encode.transform(meta[list(columns)]))
    fitted = _fit(kind, client, pipeline.named_steps["model"], X, y_all)
    pipeline.steps[0] = ("encode", encode)
    pipeline.steps[-1] = ("model", fitted)
    recorded = {**kind_params(kind, user_params), "pos_weight": pos_weight}
    if chosen:
        recorded["monotone_increasing"] = list(chosen)
    return TrainedModel(
        estimator=pipeline,
        feature_columns=list(columns),
        kind=kind,
        params=recorded,
        train_start=pd.Timestamp(ts_min).tz_localize("UTC"),
        train_end=pd.Timestamp(ts_max).tz_localize("UTC"),
        n_rows=n_rows,
        n_positives=n_pos,
        horizon=as_timedelta(options.horizon, "horizon"),
        pos_weight=odds_factor(pos_weight, negative_fraction),
        versions=library_versions(kind, user_params),
        negative_fraction=negative_fraction,
        feature_spec=options.carried_spec(),
    )
