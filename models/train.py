"""Train one model on a window of a feature frame, and save or load it with its metadata.

A saved model is a folder of two files: `model.joblib` (a joblib pickle of a `TrainedModel`)
and `metadata.json` (its description and the library versions it was trained with, readable
without unpickling).
Pickles run code when loaded: load only model files you trust. They also break across
library upgrades (DOMAIN.md 5, complaint 7), so `load_model` warns when the installed
scikit-learn / LightGBM / XGBoost / numpy differ from the recorded ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ingest.errors import InputError
from models.estimators import (
    DEFAULT_PARAMS,
    MAX_POS_WEIGHT,
    balanced_pos_weight,
    effective_pos_weight,
    make_model,
    prior_correction,
)
from models.frame import feature_matrix, require_columns, split_xy, to_pandas
from models.split import DurationLike, TimeLike, as_timedelta, as_utc, time_split

FORMAT_VERSION = 1
CHECKED_LIBRARIES = ("scikit-learn", "lightgbm", "xgboost", "numpy")


class ModelVersionWarning(UserWarning):
    """A saved model was trained with other library versions than the installed ones."""


def library_versions(kind: str) -> dict[str, str]:
    """Versions of the libraries a model of `kind` depends on when it is unpickled."""
    import joblib
    import sklearn

    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pandas": pd.__version__,
        "scikit-learn": sklearn.__version__,
        "joblib": joblib.__version__,
    }
    if kind == "lightgbm":
        import lightgbm

        versions["lightgbm"] = lightgbm.__version__
    elif kind == "xgboost":
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
    """Factor by which class weighting overstates the odds; `predict_risk` divides it out."""
    versions: dict[str, str] = field(default_factory=dict)
    trained_at: pd.Timestamp = field(default_factory=lambda: pd.Timestamp.now(tz="UTC"))

    @property
    def version(self) -> str:
        """`kind-<train_end>-<digest>`: names the model in predictions and the audit log."""
        digest = hashlib.sha256(
            json.dumps(
                [self.kind, self.params, self.feature_columns, str(self.train_start), str(self.train_end), self.n_rows],
                sort_keys=True,
                default=str,
            ).encode()
        ).hexdigest()[:8]
        return f"{self.kind}-{self.train_end:%Y%m%dT%H%MZ}-{digest}"

    def predict_score(self, frame: Any) -> np.ndarray:
        """The estimator's probability of failure for each row of `frame` (class-weighted:
        right for ranking, too high as a probability)."""
        X = feature_matrix(frame, self.feature_columns)
        if len(X) == 0:
            return np.zeros(0)
        return np.asarray(self.estimator.predict_proba(X)[:, 1], dtype=np.float64)

    def predict_risk(self, frame: Any) -> np.ndarray:
        """Probability that each row's GPU fails within the horizon, with the class weighting
        divided out (`prior_correction`); same ranking as `predict_score`."""
        return prior_correction(self.predict_score(frame), self.pos_weight)

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
            "trained_at": self.trained_at.isoformat(),
            "versions": self.versions,
        }


def _utc_ts(df: pd.DataFrame) -> pd.Series:
    ts = pd.to_datetime(df["ts"])
    return ts.dt.tz_localize("UTC") if ts.dt.tz is None else ts.dt.tz_convert("UTC")


def settled_until(frame: Any, horizon: DurationLike) -> pd.Timestamp:
    """The last grid time at which every label is settled: the frame's last ts - horizon.

    After it, a label is known only where the GPU has already failed (a positive) and is
    censored elsewhere, so those grid times hold failures without their healthy peers; training
    or evaluating on them would overstate the share of failures."""
    df = to_pandas(frame)
    require_columns(df, ["ts"], "feature frame")
    if len(df) == 0:
        raise InputError("feature frame: no rows; expected at least one grid time")
    return _utc_ts(df).max() - as_timedelta(horizon, "horizon")


def training_rows(
    frame: Any, *, train_window: DurationLike, horizon: DurationLike, as_of: TimeLike | None = None
) -> pd.DataFrame:
    """The rows `train_model` fits on (censored rows included; `split_xy` drops them).

    With `as_of`: as_of - horizon - train_window <= ts < as_of - horizon (`time_split`), so that
    no label looks past as_of. Without: the `train_window` ending at `settled_until(frame,
    horizon)`, inclusive. Either way, nothing after `settled_until`.
    """
    df = to_pandas(frame)
    require_columns(df, ["ts", "gpu_uuid", "label"], "training frame")
    window = as_timedelta(train_window, "train_window")
    settled = settled_until(df, horizon)
    if as_of is not None:
        df, _ = time_split(df, as_utc(as_of), horizon, window)
        return df.loc[(_utc_ts(df) <= settled).to_numpy()]
    ts = _utc_ts(df)
    return df.loc[((ts > settled - window) & (ts <= settled)).to_numpy()]


def train_model(
    frame: Any,
    *,
    kind: str,
    train_window: DurationLike,
    horizon: DurationLike,
    as_of: TimeLike | None = None,
    params: dict[str, Any] | None = None,
    max_pos_weight: float = MAX_POS_WEIGHT,
    monotone_increasing: Sequence[str] = (),
) -> TrainedModel:
    """Fit a `kind` model on the most recent `train_window` of labelled rows that ends a
    `horizon` before `as_of` (see `training_rows`). `params` override the defaults of
    `models.estimators.DEFAULT_PARAMS`.

    `monotone_increasing` names features whose rise must never lower the risk (error counters:
    a new double-bit ECC error is never good news); the trees get monotone constraints on them.
    Without them, trees fit on a few hundred failures can rank a GPU lower because its error
    count went up. Logistic regression has no such constraint here: naming features is an error.
    """
    if kind not in DEFAULT_PARAMS:
        raise InputError(f"model kind: expected one of {sorted(DEFAULT_PARAMS)}, got {kind!r}")
    rows = training_rows(frame, train_window=train_window, horizon=horizon, as_of=as_of)
    X, y, ids = split_xy(rows)
    where = f"training window of {train_window} before {'the last settled label' if as_of is None else f'{as_of} - {horizon}'}"
    if X.shape[1] == 0:
        raise InputError(f"{where}: no feature columns (expected numeric columns besides ids and labels)")
    n_pos = int(y.sum())
    if n_pos == 0 or n_pos == len(y):
        raise InputError(
            f"{where}: need both failing and healthy labelled rows to train, got {len(y)} rows "
            f"with {n_pos} positives; widen train_window or check the labels"
        )
    pos_weight = balanced_pos_weight(y, max_pos_weight)
    user_params = dict(params or {})
    if monotone_increasing:
        unknown = sorted(set(monotone_increasing) - set(X.columns))
        if unknown:
            raise InputError(
                f"monotone_increasing: {unknown} are not feature columns; expected some of {list(X.columns)}"
            )
        if kind == "logistic":
            raise InputError(
                "monotone_increasing: only the tree models (lightgbm, xgboost) support it, got kind 'logistic'"
            )
        constraints = [int(c in set(monotone_increasing)) for c in X.columns]
        # LightGBM takes a list aligned with the columns; XGBoost 3 wants its "(1,0,...)" string.
        user_params["monotone_constraints"] = (
            constraints if kind == "lightgbm" else "(" + ",".join(map(str, constraints)) + ")"
        )
    estimator = make_model(kind, pos_weight=pos_weight, **user_params)
    estimator.fit(X, y)
    ts = _utc_ts(ids)
    recorded = {**DEFAULT_PARAMS[kind], **user_params}
    if kind != "logistic":
        recorded["scale_pos_weight"] = pos_weight
    return TrainedModel(
        estimator=estimator,
        feature_columns=list(X.columns),
        kind=kind,
        params=recorded,
        train_start=ts.min(),
        train_end=ts.max(),
        n_rows=len(y),
        n_positives=n_pos,
        horizon=as_timedelta(horizon, "horizon"),
        pos_weight=effective_pos_weight(kind, y, pos_weight),
        versions=library_versions(kind),
    )


# -- persistence ----------------------------------------------------------------------------

MODEL_FILE = "model.joblib"
METADATA_FILE = "metadata.json"


def _write_atomic(final: Path, data: bytes) -> None:
    tmp = final.with_name(f".tmp-{uuid.uuid4().hex}-{final.name}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    _write_atomic(folder / MODEL_FILE, buffer.getvalue())
    _write_atomic(folder / METADATA_FILE, json.dumps(meta, indent=2, default=str).encode())
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
    return model
