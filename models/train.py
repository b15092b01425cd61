"""Train one model on a window of a feature frame, and save or load it with its metadata.

A saved model is a folder of two files: `model.joblib` (a joblib pickle of a `TrainedModel`)
and `metadata.json` (its description, the feature spec and the library versions it was trained
with, readable without unpickling). A model carries the `features.spec.FeatureSpec` of the
features it was trained on: whatever builds features for it builds them with that spec.
Negative subsampling (`negative_fraction` r): healthy rows outnumber failing ones ~300:1, and
most of them say the same thing. Keeping a random share r of the negatives (every positive
kept) makes a fit ~1/r times cheaper and, on the demo, ranks as well (see `train_model`). It
multiplies the odds a model estimates by 1/r; with positives also weighted w, a model
overstates the odds by w / r, the one factor (`TrainedModel.pos_weight`) that `predict_risk`
divides out. The sample is drawn before the feature matrix is built, so a large window is
never materialised whole (the paper preset's 21-day window is ~18M rows).

Pickles run code when loaded: load only model files you trust. They also break across
library upgrades (a known failure of other tools' pickled models), so `load_model` warns when the installed
scikit-learn / LightGBM / XGBoost / numpy differ from the recorded ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.special import expit

from features.sample_key import drawn, sample_keys
from features.spec import FeatureSpec
from ingest.errors import InputError
from models.calibration import Calibration, check_method, fit_calibration_on_logits, logit
from models.ensemble import ParallelEnsemble
from models.estimators import MAX_POS_WEIGHT, balanced_pos_weight, odds_factor, prior_correction
from models.frame import feature_matrix, is_polars, labels, require_columns, split_xy, split_xy_polars, to_pandas
from models.kinds import ENSEMBLE_KINDS, KINDS, MONOTONE_KINDS, TREE_KINDS, kind_params, make_model, member_kinds
from models.split import DurationLike, TimeLike, as_timedelta, as_utc, rows_between, time_split

FORMAT_VERSION = 2
"""2: models carry a calibration (`TrainedModel.calibration`); folders of version 1 load
without one and are served uncalibrated, with an `UncalibratedModelWarning`."""
CHECKED_LIBRARIES = ("scikit-learn", "lightgbm", "xgboost", "numpy")

log = logging.getLogger(__name__)


class ModelVersionWarning(UserWarning):
    """A saved model was trained with other library versions than the installed ones."""


class UncalibratedModelWarning(UserWarning):
    """A saved model has no calibration (written before models carried one): its risk is the
    odds-corrected model output, not a calibrated probability."""


class ModelSpecWarning(UserWarning):
    """A saved model records no feature spec (saved before models carried one)."""


def one_blas_thread() -> Any:
    """A context in which BLAS (numpy, scipy: logistic regression, the MLP) uses one thread.
    OpenBLAS threads spin while they wait: on a busy 2-core machine, a logistic regression on
    the demo's 7-day window fit in 13 s with one thread and 62 s with two. The trees' own
    thread count (`n_jobs`) is not affected."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


DEFAULT_NEGATIVE_FRACTION = 0.1
"""Share of negative rows `train_model` keeps by default (see the module docstring)."""


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """What to train and on which rows. `train_model` (a frame),
    `models.train_store.train_model_from_store` (the store's features) and
    `models.distributed.train_model_distributed` (a Dask cluster) take the same options and fit
    the same model."""

    kind: str
    """One of `models.kinds.KINDS`."""
    train_window: DurationLike
    horizon: DurationLike
    as_of: TimeLike | None = None
    """Train on the `train_window` that ends a `horizon` before this time (see `training_rows`);
    None: the one that ends at the last settled label."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Overrides of the kind's defaults: `models.kinds.DEFAULT_PARAMS` (single kinds) or
    `ENSEMBLE_DEFAULTS` (`parallel`: members, combine, top_k; `cascade`: first, second,
    target_recall, folds; both: n_jobs, member_params)."""
    max_pos_weight: float = MAX_POS_WEIGHT
    """Cap on the positive-class weight (`balanced_pos_weight`)."""
    monotone_increasing: Sequence[str] = ()
    """Features (names or globs, `matching_features`) whose rise must never lower the risk
    (error counters: a new double-bit ECC error is never good news): the trees get monotone
    constraints on them, logistic regression non-negative coefficients, and every member of an
    ensemble likewise (the MLP cannot be constrained: naming features for it is an error).
    Without them, trees fit on a few hundred failures can rank a GPU lower because its error
    count went up."""
    negative_fraction: float = DEFAULT_NEGATIVE_FRACTION
    """Share of the window's negative rows drawn (every positive is kept)."""
    max_negatives_per_positive: float | None = None
    """At most this many negatives drawn per positive (`capped_negative_fraction`; None: no cap)."""
    seed: int = 0
    """Seed of the negative draw (`sample_negatives`)."""
    calibration: str | None = None
    """Fit a calibration (`models.calibration.METHODS`: "platt", "beta" or "isotonic") on the
    `calibration_window` of labelled rows after the training window (`calibration_bounds`);
    None: none (the walk-forward calibrates its fits itself)."""
    calibration_window: DurationLike = "7d"
    feature_spec: FeatureSpec | None = None
    """The spec of the features trained on, which the model carries. From a store, the spec its
    features record wins, and a different one here is refused (`models.train_store`); None:
    that spec, else the default settings with this horizon (`carried_spec`)."""

    @property
    def window_name(self) -> str:
        """How error messages name the training window."""
        end = "the last settled label" if self.as_of is None else f"{self.as_of} - {self.horizon}"
        return f"training window of {self.train_window} before {end}"

    def carried_spec(self) -> FeatureSpec:
        """The spec the model will carry: `feature_spec`, else the default settings with the
        label horizon trained on."""
        return self.feature_spec or spec_with_horizon(self.horizon)

    def drawn_from(self, n_negative: int, n_positive: int) -> TrainOptions:
        """These options with `negative_fraction` the share drawn from a window of these label
        counts (`capped_negative_fraction`)."""
        fraction = capped_negative_fraction(
            n_negative, n_positive, self.negative_fraction, self.max_negatives_per_positive
        )
        return replace(self, negative_fraction=fraction)


def capped_negative_fraction(
    n_negative: int, n_positive: int, negative_fraction: float, max_negatives_per_positive: float | None
) -> float:
    """The share of the negatives a fit draws: `negative_fraction`, lowered where that would
    draw more than `max_negatives_per_positive` negatives per positive (None: no cap). A big
    fleet's window has the same few failures per GPU-day as a small one's and many times the
    healthy rows, so a fixed share makes its retrain slow without ranking better."""
    if max_negatives_per_positive is not None and max_negatives_per_positive <= 0:
        raise InputError(
            f"max_negatives_per_positive: expected a positive number or none, got {max_negatives_per_positive!r}"
        )
    if max_negatives_per_positive is None or n_negative == 0 or n_positive == 0:
        return negative_fraction
    return min(negative_fraction, max_negatives_per_positive * n_positive / n_negative)


def check_negative_fraction(negative_fraction: float) -> None:
    if not 0.0 < negative_fraction <= 1.0:
        raise InputError(f"negative_fraction: expected a share in (0, 1], got {negative_fraction!r}")


def _label_array(frame: Any) -> np.ndarray:
    """`label` as floats: 1.0, 0.0, NaN for censored."""
    return frame["label"].cast(float).to_numpy() if is_polars(frame) else labels(frame).to_numpy()


def label_counts(frame: Any) -> tuple[int, int]:
    """(negatives, positives) among the labelled rows of a feature frame."""
    label = _label_array(frame)
    return int((label == 0).sum()), int((label == 1).sum())


def library_versions(kind: str, params: dict[str, Any] | None = None) -> dict[str, str]:
    """Versions of the libraries a model of `kind` (with ensemble `params`) depends on when it
    is unpickled."""
    kinds = set(member_kinds(kind, params)) if kind in KINDS else {kind}
    import joblib
    import sklearn

    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pandas": pd.__version__,
        "scikit-learn": sklearn.__version__,
        "joblib": joblib.__version__,
    }
    if "lightgbm" in kinds:
        import lightgbm

        versions["lightgbm"] = lightgbm.__version__
    if "xgboost" in kinds:
        import xgboost

        versions["xgboost"] = xgboost.__version__
    return versions


@dataclass
class TrainedModel:
    """A fitted estimator and what is needed to use and trust it."""

    estimator: Any
    feature_columns: list[str]
    kind: str
    params: dict[str, Any]
    train_start: pd.Timestamp
    train_end: pd.Timestamp
    n_rows: int
    n_positives: int
    horizon: pd.Timedelta
    pos_weight: float
    """Factor by which class weighting and negative subsampling overstate the odds
    (w / negative_fraction); `predict_risk` divides it out."""
    versions: dict[str, str] = field(default_factory=dict)
    trained_at: pd.Timestamp = field(default_factory=lambda: pd.Timestamp.now(tz="UTC"))
    negative_fraction: float = 1.0
    """Share of the window's negative rows the model was fit on (`n_rows` counts the sample)."""
    feature_spec: FeatureSpec = field(default_factory=FeatureSpec)
    """The spec of the features the model was trained on: scoring and serving build features
    with it and refuse features built with another (`features.manifest.check_spec`)."""
    calibration: Calibration | None = None
    """The map from odds-corrected to calibrated risk, fitted after the training window (None:
    an uncalibrated model, e.g. one saved before models carried a calibration)."""

    @property
    def calibrated(self) -> bool:
        # getattr: a model pickled before the field existed has no such attribute.
        return getattr(self, "calibration", None) is not None

    def design_matrix(self, frame: Any) -> pd.DataFrame:
        """What the estimator takes: the feature columns and, for an ensemble that ranks within
        scoring times, the time column."""
        X = feature_matrix(frame, self.feature_columns)
        time_column = getattr(self.estimator, "time_column", None)
        if time_column is not None:
            df = to_pandas(frame)
            require_columns(df, [time_column], "feature frame")
            X[time_column] = df[time_column].to_numpy()
        return X

    @property
    def scores_each_row_alone(self) -> bool:
        """Whether a row's score depends on that row alone, so that any subset of rows can be
        scored apart: not for the parallel ensemble, which ranks the GPUs of a scoring time
        against each other, so its rows must come in whole grid times (the cascade uses its
        time column only to fit)."""
        return not isinstance(self.estimator, ParallelEnsemble)

    @property
    def version(self) -> str:
        """`kind-<train_end>-<digest>`: names the model in predictions and the audit log."""
        identity: list[Any] = [
            self.kind,
            self.params,
            self.feature_columns,
            str(self.train_start),
            str(self.train_end),
            self.n_rows,
        ]
        if self.calibrated:
            # Only for calibrated models, so an older model keeps the version it was served under.
            identity.append(self.calibration_info())
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:8]
        return f"{self.kind}-{self.train_end:%Y%m%dT%H%MZ}-{digest}"

    def predict_score(self, frame: Any, *, threads: int | None = None) -> np.ndarray:
        """The estimator's probability of failure for each row of `frame` (class-weighted:
        right for ranking, too high as a probability). `threads`: a LightGBM model's threads for
        this call instead of the `n_jobs` it was trained with (-1: every core this process may
        use). Each row is scored on its own, so the scores are the same; only a large frame (a
        held-out window) is worth more than one."""
        X = self.design_matrix(frame)
        if len(X) == 0:
            return np.zeros(0)
        options = {"num_threads": threads} if threads is not None and self.kind == "lightgbm" else {}
        with one_blas_thread():
            return np.asarray(self.estimator.predict_proba(X, **options)[:, 1], dtype=np.float64)

    def predict_uncalibrated_risk(self, frame: Any, *, threads: int | None = None) -> np.ndarray:
        """The estimator's probability with the class weighting and the negative subsampling
        divided out (`prior_correction`): right on average, not in the tails; same ranking as
        `predict_score`."""
        return prior_correction(self.predict_score(frame, threads=threads), self.pos_weight)

    def predict_uncalibrated_logit(self, frame: Any, *, threads: int | None = None) -> np.ndarray:
        """The logit of `predict_uncalibrated_risk`: for a linear model its decision function
        less log(pos_weight), never passed through a probability (which is exactly 1.0 in
        float64 from a logit of about 37 on, so that such rows would tie at the top); for the
        others, the logit of the odds-corrected probability."""
        return self.predict_score_and_logit(frame, threads=threads)[1]

    def predict_score_and_logit(self, frame: Any, *, threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(`predict_score`, `predict_uncalibrated_logit`) of each row, the model run once."""
        if self.kind == "logistic" and hasattr(self.estimator, "decision_function"):
            X = self.design_matrix(frame)
            if len(X) == 0:
                return np.zeros(0), np.zeros(0)
            with one_blas_thread():
                decision = np.asarray(self.estimator.decision_function(X), dtype=np.float64)
            return expit(decision), decision - math.log(self.pos_weight)
        score = self.predict_score(frame, threads=threads)
        return score, logit(prior_correction(score, self.pos_weight))

    def calibrate(self, uncalibrated_risk: Any) -> np.ndarray:
        """`predict_uncalibrated_risk`'s values through the model's calibration (unchanged
        without one)."""
        risk = np.asarray(uncalibrated_risk, dtype=np.float64)
        calibration = getattr(self, "calibration", None)
        return risk if calibration is None else calibration.apply(risk)

    def calibrate_logit(self, uncalibrated_logit: Any) -> np.ndarray:
        """`predict_uncalibrated_logit`'s values through the model's calibration (their
        probability without one)."""
        z = np.asarray(uncalibrated_logit, dtype=np.float64)
        calibration = getattr(self, "calibration", None)
        return expit(z) if calibration is None else calibration.apply_logit(z)

    def predict_risk(self, frame: Any, *, threads: int | None = None) -> np.ndarray:
        """Probability that each row's GPU fails within the horizon: the calibrated risk
        (`calibrate_logit(predict_uncalibrated_logit)`), or the uncalibrated one for a model
        without a calibration."""
        return self.predict_risks(frame, threads=threads)[1]

    def predict_risks(self, frame: Any, *, threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(uncalibrated, calibrated) risk of each row, the model run once."""
        if not self.calibrated:
            risk = self.predict_uncalibrated_risk(frame, threads=threads)
            return risk, risk
        z = self.predict_uncalibrated_logit(frame, threads=threads)
        return expit(z), self.calibrate_logit(z)

    def calibration_info(self) -> dict[str, Any] | None:
        """The calibration's provenance (`Calibration.provenance`), None without one."""
        calibration = getattr(self, "calibration", None)
        return None if calibration is None else calibration.provenance()

    def metadata(self) -> dict[str, Any]:
        """JSON-ready description (the sidecar file of `save_model`)."""
        return {
            "format_version": FORMAT_VERSION,
            "version": self.version,
            "kind": self.kind,
            "params": self.params,
            "feature_columns": self.feature_columns,
            "train_start": self.train_start.isoformat(),
            "train_end": self.train_end.isoformat(),
            "n_rows": self.n_rows,
            "n_positives": self.n_positives,
            "horizon_h": self.horizon / pd.Timedelta(hours=1),
            "pos_weight": self.pos_weight,
            "negative_fraction": getattr(self, "negative_fraction", 1.0),
            "feature_spec": self.feature_spec.to_json(),
            "feature_spec_fingerprint": self.feature_spec.fingerprint,
            "trained_at": self.trained_at.isoformat(),
            "versions": self.versions,
            "calibrated": self.calibrated,
            "calibration": self.calibration_info(),
        }


def _utc_ts(df: pd.DataFrame) -> pd.Series:
    ts = pd.to_datetime(df["ts"])
    return ts.dt.tz_localize("UTC") if ts.dt.tz is None else ts.dt.tz_convert("UTC")


def _require(frame: Any, columns: Sequence[str], what: str) -> None:
    if is_polars(frame):
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise InputError(
                f"{what}: missing column(s) {missing}; expected a feature frame with {list(columns)}, "
                f"got columns {list(frame.columns)[:20]}{' ...' if len(frame.columns) > 20 else ''}"
            )
    else:
        require_columns(to_pandas(frame), columns, what)


def settled_until(frame: Any, horizon: DurationLike) -> pd.Timestamp:
    """The last grid time at which every label is settled: the frame's last ts - horizon.

    After it, a label is known only where the GPU has already failed (a positive) and is
    censored elsewhere, so those grid times hold failures without their healthy peers; training
    or evaluating on them would overstate the share of failures."""
    _require(frame, ["ts"], "feature frame")
    if len(frame) == 0:
        raise InputError("feature frame: no rows; expected at least one grid time")
    last = as_utc(frame["ts"].max()) if is_polars(frame) else _utc_ts(to_pandas(frame)).max()
    return last - as_timedelta(horizon, "horizon")


def _window(frame: Any, *, train_window: DurationLike, horizon: DurationLike, as_of: TimeLike | None) -> Any:
    """`training_rows` in the type of `frame` (polars stays polars: nothing is converted yet)."""
    _require(frame, ["ts", "gpu_uuid", "label"], "training frame")
    start, end = training_bounds(settled_until(frame, horizon), train_window=train_window, horizon=horizon, as_of=as_of)
    if end <= start:
        return frame.head(0)
    train, _ = time_split(frame, end + as_timedelta(horizon, "horizon"), horizon, end - start)
    return train


def training_bounds(
    settled: pd.Timestamp, *, train_window: DurationLike, horizon: DurationLike, as_of: TimeLike | None
) -> tuple[pd.Timestamp, pd.Timestamp]:
    """[start, end) of the grid times `train_model` fits on, given `settled_until` of the
    data: as_of - horizon - window <= ts < as_of - horizon (time_split's training side), or
    settled - window < ts <= settled; never past settled. Empty when end <= start."""
    window = as_timedelta(train_window, "train_window")
    after_settled = settled + pd.Timedelta(microseconds=1)
    if as_of is not None:
        end = as_utc(as_of) - as_timedelta(horizon, "horizon")
        return end - window, min(end, after_settled)
    return after_settled - window, after_settled


def training_rows(
    frame: Any, *, train_window: DurationLike, horizon: DurationLike, as_of: TimeLike | None = None
) -> pd.DataFrame:
    """The rows `train_model` fits on (censored rows included; `split_xy` drops them).

    With `as_of`: as_of - horizon - train_window <= ts < as_of - horizon (`time_split`), so that
    no label looks past as_of. Without: the `train_window` ending at `settled_until(frame,
    horizon)`, inclusive. Either way, nothing after `settled_until`.
    """
    return to_pandas(_window(frame, train_window=train_window, horizon=horizon, as_of=as_of))


def _negative_sample_mask(frame: Any, negative_fraction: float, seed: int) -> np.ndarray:
    """Every positive and the negatives drawn at `negative_fraction` by their row's key
    (`features.sample_key`: a hash of gpu_uuid and ts, so a row is drawn or not whatever frame
    it is in, and a store can hold the drawn rows apart)."""
    check_negative_fraction(negative_fraction)
    _require(frame, ["ts", "gpu_uuid", "label"], "training frame")
    return drawn(_label_array(frame), sample_keys(frame["gpu_uuid"], frame["ts"], seed), negative_fraction)


def sample_negatives(frame: Any, negative_fraction: float, seed: int = 0) -> pd.DataFrame:
    """The labelled rows of `frame` with every positive and a share `negative_fraction` of the
    negatives (drawn by a hash of each row's gpu_uuid and ts under `seed`: the same row is
    always drawn at the same share), as pandas. The sample is drawn before any conversion, so
    only the kept rows are materialised."""
    keep = _negative_sample_mask(frame, negative_fraction, seed)
    if is_polars(frame):
        import polars as pl

        return to_pandas(frame.filter(pl.Series(keep)))
    return to_pandas(frame).loc[keep]


def training_sample(keys: Any, options: TrainOptions) -> Any:
    """The `ts` and `gpu_uuid` of the rows `train_model(frame, options)` fits on, in its order,
    drawn at `options.negative_fraction`, from a polars frame of only `ts`, `gpu_uuid` and
    `label` sorted by (ts, gpu_uuid) as `read_features` returns it. The window and the negative
    draw need nothing else, so a caller can read the hundreds of feature columns for these rows
    alone (`train_model_on_sample`): a fleet of 30k GPUs has ~17M rows in a 3-week window,
    ~28 GB of features, of which ~10% are kept."""
    import polars as pl

    window = _window(keys, train_window=options.train_window, horizon=options.horizon, as_of=options.as_of)
    keep = _negative_sample_mask(window, options.negative_fraction, options.seed)
    return window.filter(pl.Series(keep)).select("ts", "gpu_uuid")


def matching_features(patterns: Sequence[str], columns: Sequence[str]) -> list[str]:
    """The feature columns named by `patterns`: exact names or shell-style globs
    (`ecc_dbe_*_increase_*`), so a setting keeps working when windows are added. A pattern that
    names no column is an error rather than a constraint silently not applied."""
    import fnmatch

    chosen: list[str] = []
    for pattern in patterns:
        hits = [c for c in columns if fnmatch.fnmatchcase(c, pattern)]
        if not hits:
            raise InputError(
                f"monotone_increasing: {pattern!r} matches no feature column; expected a feature name or a "
                f"glob such as 'ecc_dbe_*_increase_*' (features: {len(columns)}, e.g. {list(columns)[:5]})"
            )
        chosen += [c for c in hits if c not in chosen]
    return chosen


def check_model_kind(kind: str, params: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The user's parameters and the model kinds a `kind` model fits (its members for an
    ensemble), or an `InputError` naming an unknown kind or member."""
    user_params = dict(params or {})
    try:
        kinds = member_kinds(kind, user_params)
    except ValueError as exc:
        raise InputError(f"{kind} ensemble {exc}" if kind in KINDS else str(exc)) from None
    return user_params, kinds


def calibration_bounds(settled: pd.Timestamp, options: TrainOptions) -> tuple[pd.Timestamp, pd.Timestamp]:
    """[start, end) of the calibration slice of a model trained with `options` on data whose
    labels are settled until `settled` (`settled_until`): the `calibration_window` that ends
    where the served model's training window ends (a horizon before `as_of`, or after
    `settled`). The map is fitted on the slice's rows as scored by a fit made as of the slice's
    start (`calibration_fit_options`: its last training label ends before the slice begins, so
    its scores there are out of time); the served model is then fitted on the whole window up
    to the slice's end and carries that map (`attach_calibration`), so calibrating never makes
    it older."""
    _, end = training_bounds(
        settled, train_window=options.calibration_window, horizon=options.horizon, as_of=options.as_of
    )
    return end - as_timedelta(options.calibration_window, "calibration_window"), end


def calibration_fit_options(options: TrainOptions, slice_start: pd.Timestamp) -> TrainOptions:
    """The options of the fit that scores a calibration slice: trained as of the slice's start,
    not calibrated itself."""
    return replace(options, as_of=slice_start, calibration=None)


def served_fit_options(options: TrainOptions) -> TrainOptions:
    """The options of the served fit of a calibrated model: the whole training window up to the
    newest settled label (or `as_of - horizon`), not calibrated itself."""
    return replace(options, calibration=None)


def calibrate_model(
    model: TrainedModel,
    rows: Any,
    *,
    method: str,
    bounds: tuple[pd.Timestamp, pd.Timestamp],
    negative_fraction: float = 1.0,
) -> TrainedModel:
    """`model` with a calibration (`models.calibration.fit_calibration_on_logits`) fitted on the
    labelled `rows` of the calibration slice `bounds` as `model` scores them, of which a share
    `negative_fraction` of the healthy ones were drawn."""
    df = to_pandas(rows)
    df = df.loc[labels(df).notna().to_numpy()] if len(df) else df
    if len(df) == 0:
        raise InputError(
            f"calibration slice {bounds[0]} .. {bounds[1]}: no labelled rows; expected feature rows at the end of the "
            "training window (a shorter calibration_window, or more data)"
        )
    calibration = fit_calibration_on_logits(
        model.predict_uncalibrated_logit(df),
        labels(df).to_numpy(),
        method,
        slice_start=bounds[0],
        slice_end=bounds[1],
        negative_fraction=negative_fraction,
    )
    return replace(model, calibration=calibration)


def short_history_note(
    first: pd.Timestamp, settled: pd.Timestamp, options: TrainOptions, bounds: tuple[pd.Timestamp, pd.Timestamp]
) -> str | None:
    """One line when the data, from its first grid time `first`, is too short for a full
    `train_window` for the served fit and for the fit that scores the calibration slice
    `bounds`: how many days each trains on, how many calibrate, and why (None when both fits
    have their whole window)."""
    window = as_timedelta(options.train_window, "train_window")
    _, served_end = training_bounds(settled, train_window=window, horizon=options.horizon, as_of=options.as_of)
    fit_start, fit_end = training_bounds(settled, train_window=window, horizon=options.horizon, as_of=bounds[0])
    if fit_start >= first:
        return None
    day = pd.Timedelta(days=1)
    served_days = max(served_end - max(served_end - window, first), pd.Timedelta(0)) / day
    fit_days = max(fit_end - first, pd.Timedelta(0)) / day
    horizon = as_timedelta(options.horizon, "horizon")
    calibration = as_timedelta(options.calibration_window, "calibration_window")
    need = window + horizon + calibration
    return (
        f"short history: the data starts {first:%Y-%m-%d %H:%M}, less than train_window {_days(window)} + "
        f"horizon {_days(horizon)} + calibration_window {_days(calibration)} ({need / day:.1f} days) "
        f"before the newest settled label: the served model trains on {served_days:.1f} days (up to "
        f"{served_end:%Y-%m-%d %H:%M}), its calibration map on {(bounds[1] - bounds[0]) / day:.1f} days "
        f"({bounds[0]:%Y-%m-%d %H:%M} .. {bounds[1]:%Y-%m-%d %H:%M}) scored by a fit on {fit_days:.1f} days before them"
    )


def _days(duration: pd.Timedelta) -> str:
    """A duration as the configuration writes it: whole days as "7d", else hours ("36h")."""
    hours = duration / pd.Timedelta(hours=1)
    return f"{hours / 24:g}d" if hours % 24 == 0 else f"{hours:g}h"


def attach_calibration(model: TrainedModel, calibrated: TrainedModel, note: str | None) -> TrainedModel:
    """The served fit `model` carrying the calibration of `calibrated`, the fit that scored the
    slice (its training window recorded with it), and the short-history note, logged here."""
    calibration = calibrated.calibration
    assert calibration is not None
    extra: dict[str, Any] = {
        "scored_by_train_start": calibrated.train_start.isoformat(),
        "scored_by_train_end": calibrated.train_end.isoformat(),
    }
    if note is not None:
        log.warning("%s", note)
        extra["note"] = note
    return replace(model, calibration=replace(calibration, extra={**calibration.extra, **extra}))


def train_model(frame: Any, options: TrainOptions) -> TrainedModel:
    """Fit a model as `options` say on the most recent `train_window` of labelled rows of
    `frame` that ends a `horizon` before `as_of` (see `training_rows`), keeping every positive
    and a share `negative_fraction` of the negatives, at most `max_negatives_per_positive` per
    positive (drawn by `sample_negatives` under `seed`). With `calibration`, the map is fitted on
    the calibration slice (`calibration_bounds`, the slice's healthy rows drawn as the training
    rows are) as scored by a fit made as of the slice's start, and the returned model is fitted
    on the whole window (the slice included) and carries that map."""
    check_model_kind(options.kind, options.params)  # before the window is cut: a bad setting fails fast
    if options.calibration is not None:
        check_method(options.calibration)
        settled = settled_until(frame, options.horizon)
        bounds = calibration_bounds(settled, options)
        scorer = train_model(frame, calibration_fit_options(options, bounds[0]))
        _require(frame, ["ts", "gpu_uuid", "label"], "calibration frame")
        part = rows_between(frame, *bounds)
        drawn = options.drawn_from(*label_counts(part))
        rows = sample_negatives(part, drawn.negative_fraction, options.seed)
        calibrated = calibrate_model(
            scorer,
            rows,
            method=options.calibration,
            bounds=bounds,
            negative_fraction=drawn.negative_fraction,
        )
        first = as_utc(frame["ts"].min()) if is_polars(frame) else _utc_ts(to_pandas(frame)).min()
        note = short_history_note(first, settled, options, bounds)
        return attach_calibration(train_model(frame, served_fit_options(options)), calibrated, note)
    window = _window(frame, train_window=options.train_window, horizon=options.horizon, as_of=options.as_of)
    options = options.drawn_from(*label_counts(window))
    return train_model_on_sample(sample_negatives(window, options.negative_fraction, options.seed), options)


def check_both_classes(n_rows: int, n_positives: int, where: str) -> None:
    """An `InputError` unless the labelled rows hold both failing and healthy ones."""
    if n_positives == 0 or n_positives == n_rows:
        raise InputError(
            f"{where}: need both failing and healthy labelled rows to train, got {n_rows} rows "
            f"with {n_positives} positives; widen train_window or check the labels"
        )


def train_model_on_sample(rows: Any, options: TrainOptions) -> TrainedModel:
    """`train_model` on rows already windowed and negative-sampled (`training_sample` picks
    them; `options.negative_fraction` is the share that was drawn, for the odds correction)."""
    kind, where = options.kind, options.window_name
    user_params, kinds = check_model_kind(kind, options.params)
    # LightGBM reads polars through Arrow, ~3x faster than through pandas, to the same trees.
    X, y, ids = split_xy_polars(rows) if kind == "lightgbm" and is_polars(rows) else split_xy(to_pandas(rows))
    if X.shape[1] == 0:
        raise InputError(f"{where}: no feature columns (expected numeric columns besides ids and labels)")
    n_pos = int(y.sum())
    check_both_classes(len(y), n_pos, where)
    monotone_increasing = options.monotone_increasing
    if monotone_increasing:
        monotone_increasing = matching_features(monotone_increasing, list(X.columns))
        unconstrained = sorted(set(kinds) - set(MONOTONE_KINDS))
        if unconstrained:
            raise InputError(
                f"monotone_increasing: {unconstrained} cannot be constrained; expected kinds among {list(MONOTONE_KINDS)}"
            )
    pos_weight = balanced_pos_weight(y, options.max_pos_weight)
    horizon_td = as_timedelta(options.horizon, "horizon")
    build_params = dict(user_params)
    if kind == "cascade":
        # The first stage's last training label must not look into the validation slice.
        build_params.setdefault("validation_gap", horizon_td)
    estimator = make_model(
        kind,
        pos_weight=pos_weight,
        monotone_increasing=tuple(monotone_increasing),
        columns=list(X.columns),
        **build_params,
    )
    ts = _utc_ts(ids)
    design = X.assign(ts=ts.to_numpy()) if kind in ENSEMBLE_KINDS else X
    try:
        # Trees use no BLAS: their fits leave its process-wide limit alone, so that two of them
        # can run side by side (`models.train_store.calibrated_from_store`).
        with one_blas_thread() if set(kinds) - set(TREE_KINDS) else contextlib.nullcontext():
            estimator.fit(design, y)
    except ValueError as exc:
        if kind not in ENSEMBLE_KINDS:
            raise
        # The ensembles' data checks (a slice without failures, ...) are about the input.
        raise InputError(f"{where}: {exc}") from exc
    recorded = kind_params(kind, build_params)
    if kind == "cascade":
        recorded["threshold"] = estimator.threshold_
        recorded["validation_recall"] = estimator.validation_recall_
        recorded["kept_fraction"] = estimator.kept_fraction_
    recorded["pos_weight"] = pos_weight
    chosen_C = getattr(getattr(estimator, "named_steps", {}).get("model"), "C_", None)
    if chosen_C is not None:
        recorded["C_chosen"] = chosen_C
    if monotone_increasing:
        recorded["monotone_increasing"] = list(monotone_increasing)
    return TrainedModel(
        estimator=estimator,
        feature_columns=list(X.columns),
        kind=kind,
        params=recorded,
        train_start=ts.min(),
        train_end=ts.max(),
        n_rows=len(y),
        n_positives=n_pos,
        horizon=horizon_td,
        pos_weight=odds_factor(pos_weight, options.negative_fraction),
        versions=library_versions(kind, user_params),
        negative_fraction=options.negative_fraction,
        feature_spec=options.carried_spec(),
    )


def spec_with_horizon(horizon: DurationLike) -> FeatureSpec:
    """The default feature settings with this label horizon (the defaults alone when it does
    not fit the default grid)."""
    try:
        return FeatureSpec(horizon=as_timedelta(horizon, "horizon").to_pytimedelta())
    except (ValueError, TypeError):
        return FeatureSpec()


# -- persistence ----------------------------------------------------------------------------

MODEL_FILE = "model.joblib"
METADATA_FILE = "metadata.json"


def write_file_atomic(final: Path, data: bytes) -> Path:
    """Write `data` to `final` through a temporary file in the same folder and a rename, so a
    reader (or a crash) never sees a half-written model, report or metrics file."""
    tmp = final.with_name(f".tmp-{uuid.uuid4().hex}-{final.name}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def save_model(model: TrainedModel, path: str | os.PathLike[str]) -> Path:
    """Write `model` into the folder `path` (created if needed): `model.joblib` and
    `metadata.json`, each atomically (an existing model there is replaced file by file).
    Returns the folder."""
    import io

    import joblib

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    joblib.dump(model, buffer)
    meta = {**model.metadata(), "saved_at": datetime.now(UTC).isoformat()}
    write_file_atomic(folder / MODEL_FILE, buffer.getvalue())
    write_file_atomic(folder / METADATA_FILE, json.dumps(meta, indent=2, default=str).encode())
    return folder


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The `metadata.json` of a saved model folder, without unpickling the model."""
    file = Path(path) / METADATA_FILE
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"model metadata {file}: not found; expected a folder written by save_model") from None
    except ValueError as exc:
        raise InputError(f"model metadata {file}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("versions"), dict):
        raise InputError(f"model metadata {file}: expected an object with a 'versions' object")
    return meta


def _installed_version(lib: str) -> str | None:
    import importlib

    try:
        module = importlib.import_module({"scikit-learn": "sklearn"}.get(lib, lib))
    except ImportError:
        return None
    return str(module.__version__)


def _version_mismatches(recorded: dict[str, str]) -> list[str]:
    found = []
    for lib in CHECKED_LIBRARIES:
        if lib in recorded:
            installed = _installed_version(lib)
            if recorded[lib] != installed:
                found.append(f"{lib} {recorded[lib]} (installed {installed or 'none'})")
    return found


def load_model(path: str | os.PathLike[str]) -> TrainedModel:
    """Read a model folder written by `save_model`.

    Warns (`ModelVersionWarning`) when the libraries it was trained with differ from the
    installed ones, before unpickling; raises `InputError` naming the file when the folder,
    the model or its metadata is missing or cannot be read."""
    import joblib

    folder = Path(path)
    file = folder / MODEL_FILE
    if not folder.is_dir():
        raise InputError(f"model folder {folder}: not found; expected a folder written by save_model")
    if not file.is_file():
        raise InputError(f"model file {file}: not found; expected a folder written by save_model")
    meta = read_metadata(folder)
    mismatches = _version_mismatches(meta["versions"])
    if mismatches:
        warnings.warn(
            f"model {folder} was trained with {', '.join(mismatches)}; its predictions may differ "
            "or it may not load: retrain it, or install the recorded versions",
            ModelVersionWarning,
            stacklevel=2,
        )
    try:
        model = joblib.load(file)
    except Exception as exc:
        hint = f"; it was trained with {', '.join(mismatches)}" if mismatches else ""
        raise InputError(
            f"model file {file}: cannot be read ({type(exc).__name__}: {exc}); expected a model "
            f"written by models.train.save_model{hint}"
        ) from exc
    if not isinstance(model, TrainedModel):
        raise InputError(f"model file {file}: expected a TrainedModel, got {type(model).__name__}")
    if "feature_spec" not in vars(model):
        # Saved before models carried their spec: it was evidently built with the defaults.
        model.feature_spec = spec_with_horizon(model.horizon)
        warnings.warn(
            f"model {folder} records no feature spec (saved before models carried one); it is taken as built "
            f"with the default settings and its horizon (feature spec {model.feature_spec.fingerprint}): retrain "
            "it if its features were built otherwise",
            ModelSpecWarning,
            stacklevel=2,
        )
    if not model.calibrated:
        warnings.warn(
            f"model {folder} has no calibration (format {meta.get('format_version', 1)}): it is served "
            "uncalibrated, its risk the odds-corrected model output rather than a calibrated probability; "
            "retrain it (`gpufail train`) to calibrate it",
            UncalibratedModelWarning,
            stacklevel=2,
        )
    return model
