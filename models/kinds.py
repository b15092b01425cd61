"""The model kinds: their names, their default parameters, how an ensemble's settings resolve
into its members, and `make_model`, which builds an unfitted scikit-learn estimator of any kind.
The one place to add a kind or change a default: training, the Dask trainer and the
walk-forward comparison all read the kinds from here.

Single kinds (`SINGLE_KINDS`) are pipelines of an encoding step and one estimator from
`models.estimators`; the ensembles (`ENSEMBLE_KINDS`, `models.ensemble`) combine single models
built the same way. The string columns are encoded inside each pipeline, so the mapping learnt
at fit time is the one used at scoring time and is saved with the model:

- trees (`lightgbm`, `xgboost`, `random_forest`): `CategoryCodes` turns each string into the
  code of its category as learnt in `fit`; an unseen or missing category becomes NaN, which
  the trees route natively (as they do missing numeric values);
- `logistic` and `mlp`: one-hot encoding (unseen categories -> all zeros), median imputation
  with missing-value indicators (a telemetry gap is itself a signal), standard scaling.

Class imbalance: every kind weights the positive class by the same factor `pos_weight` (see
`models.estimators.balanced_pos_weight`): `scale_pos_weight` (LightGBM, XGBoost),
`class_weight={1: w}` (random forest, logistic regression) and positive oversampling for the
MLP (`OversampledMLP`). Members of an ensemble get the same weight, so one correction
(`models.estimators.prior_correction`) applies to the ensemble's output.

LightGBM also needs `reg_lambda` (lambda_l2) = 1 and `min_child_weight`
(min_sum_hessian_in_leaf) = 1: with its defaults it produced useless models at 1:1000
imbalance (held-out AUC about 0.5), where XGBoost did well (docs/evaluation.md).

Monotone constraints (`monotone_increasing`: features whose rise must never lower the risk)
are native for LightGBM, XGBoost and the random forest; logistic regression keeps the sign of
their coefficients non-negative (`SignConstrainedLogistic`); the MLP cannot be constrained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

from sklearn.pipeline import Pipeline

from models.ensemble import CascadeEnsemble, ParallelEnsemble
from models.estimators import (
    CategoryCodes,
    OversampledMLP,
    SignConstrainedLogistic,
    dense_preparation,
    monotone_positions,
)

SingleKind = Literal["lightgbm", "xgboost", "logistic", "random_forest", "mlp"]
EnsembleKind = Literal["parallel", "cascade"]
Kind = SingleKind | EnsembleKind
SINGLE_KINDS: tuple[str, ...] = get_args(SingleKind)
ENSEMBLE_KINDS: tuple[str, ...] = get_args(EnsembleKind)
KINDS: tuple[str, ...] = SINGLE_KINDS + ENSEMBLE_KINDS
TREE_KINDS: tuple[str, ...] = ("lightgbm", "xgboost", "random_forest")
MONOTONE_KINDS: tuple[str, ...] = ("lightgbm", "xgboost", "random_forest", "logistic")

THREADS = 2

DEFAULT_PARAMS: dict[str, dict[str, Any]] = {
    # Sized for daily retrains: 100 trees at rate 0.1 on 63 bins instead of 200 at 0.05 on 255.
    # (Half the features per tree was faster still on the demo, but on a frame with one
    # informative feature of five it cut held-out ROC-AUC from 0.94 to 0.87.)
    "lightgbm": {
        "n_estimators": 100,
        "learning_rate": 0.1,
        "max_bin": 63,
        "num_leaves": 31,
        "min_child_samples": 20,
        "reg_lambda": 1.0,  # lambda_l2: the imbalance trap (module notes)
        "min_child_weight": 1.0,  # min_sum_hessian_in_leaf: same
        "subsample_freq": 0,
        "n_jobs": THREADS,
        "verbose": -1,
        "random_state": 0,
    },
    "xgboost": {
        "n_estimators": 100,
        "learning_rate": 0.1,
        "max_bin": 64,
        "max_depth": 6,
        "tree_method": "hist",
        "min_child_weight": 1.0,
        "reg_lambda": 1.0,
        "n_jobs": THREADS,
        "random_state": 0,
        "verbosity": 0,
    },
    # C chosen on the last quarter of the training window among these (`SignConstrainedLogistic`):
    # stronger L2 than scikit-learn's 1.0, since the ~590 standardised, correlated inputs
    # converge in ~260 L-BFGS iterations at 0.1 instead of ~660 at 1.0, and the demo walk-forward
    # ranked alike (daily precision@10 10.2% vs 10.3%, recall@10 21 vs 20 of 41 failures).
    "logistic": {
        "C": [0.01, 0.03, 0.1],
        "max_iter": 1000,
    },
    "random_forest": {
        "n_estimators": 100,
        "min_samples_leaf": 5,
        "max_features": "sqrt",
        # Each tree sees a bootstrap of half the rows: as good here, and twice as fast.
        "max_samples": 0.5,
        "n_jobs": THREADS,
        "random_state": 0,
    },
    # One hidden layer of 32 and 10 epochs ranked the demo's held-out 14 days as well as
    # (64, 32) and 30 epochs (precision@10 0.094 / 0.092), several times faster.
    "mlp": {
        "hidden_layer_sizes": (32,),
        "alpha": 1e-3,
        "batch_size": 256,
        "learning_rate_init": 1e-3,
        "max_iter": 10,
        "random_state": 0,
    },
}

THREADED_KINDS: tuple[str, ...] = tuple(k for k in SINGLE_KINDS if "n_jobs" in DEFAULT_PARAMS[k])
"""Kinds whose estimator takes a thread count (`n_jobs`)."""

ENSEMBLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "parallel": {"members": ["lightgbm", "xgboost", "logistic"], "combine": "top_k_intersection", "top_k": 10},
    "cascade": {"first": "logistic", "second": "lightgbm", "target_recall": 0.95, "folds": 3},
}
"""Parameters of the ensembles: `make_model("parallel", members=[...], combine=..., top_k=...)`,
`make_model("cascade", first=..., second=..., target_recall=..., folds=...,
validation_gap=...)`. Both also take `n_jobs` (for every member that takes it) and
`member_params` ({kind: {param: value}}, for the members of that kind); the cascade takes
`first_params` and `second_params` for one stage only (a small, cheap first stage of the same
kind as the second, say)."""

_MEMBER_SETTINGS = {
    "parallel": ("members", "member_params", "n_jobs"),
    "cascade": ("first", "second", "first_params", "second_params", "member_params", "n_jobs"),
}
"""Ensemble settings that choose and configure the members; the others go to the ensemble."""


def kind_params(kind: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The parameters a model of `kind` is built with: its defaults (`DEFAULT_PARAMS` or
    `ENSEMBLE_DEFAULTS`) overridden by `params`."""
    if kind not in KINDS:
        raise ValueError(f"model kind: expected one of {list(KINDS)}, got {kind!r}")
    return {**DEFAULT_PARAMS.get(kind, ENSEMBLE_DEFAULTS.get(kind, {})), **(params or {})}


def member_kinds(kind: str, params: Mapping[str, Any] | None = None) -> list[str]:
    """The single kinds a model of `kind` with `params` is made of (itself for a single kind).
    ValueError naming the setting when an ensemble's members are not single kinds (a parallel
    ensemble needs at least two)."""
    settings = kind_params(kind, params)
    if kind in SINGLE_KINDS:
        return [kind]
    if kind == "parallel":
        members = settings["members"]
        if not isinstance(members, list | tuple) or len(members) < 2 or any(m not in SINGLE_KINDS for m in members):
            raise ValueError(
                f"members: expected a list of at least two kinds among {list(SINGLE_KINDS)}, got {members!r}"
            )
        return list(members)
    for stage in ("first", "second"):
        if settings[stage] not in SINGLE_KINDS:
            raise ValueError(f"{stage}: expected one of {list(SINGLE_KINDS)}, got {settings[stage]!r}")
    return [settings["first"], settings["second"]]


def member_params(kind: str, params: Mapping[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(kind, parameters over its defaults) of each member of an ensemble of `kind` with
    `params`, in order (the cascade: first, second): `member_params[kind]`, then the stage's
    own (`first_params`, `second_params`), then the ensemble's `n_jobs` for a member that
    takes threads."""
    if kind not in ENSEMBLE_KINDS:
        raise ValueError(f"ensemble kind: expected one of {list(ENSEMBLE_KINDS)}, got {kind!r}")
    settings = kind_params(kind, params)
    kinds = member_kinds(kind, settings)
    if kind == "parallel":
        stages: list[Mapping[str, Any]] = [{} for _ in kinds]
    else:
        stages = [settings.get("first_params") or {}, settings.get("second_params") or {}]
    per_kind: Mapping[str, Mapping[str, Any]] = settings.get("member_params") or {}
    n_jobs = settings.get("n_jobs")
    out = []
    for member, stage in zip(kinds, stages, strict=True):
        extra = {**per_kind.get(member, {}), **stage}
        if n_jobs is not None and member in THREADED_KINDS:
            extra.setdefault("n_jobs", n_jobs)
        out.append((member, extra))
    return out


def _single_model(
    kind: str, pos_weight: float, increasing: Sequence[str], columns: Sequence[str] | None, params: dict[str, Any]
) -> Pipeline:
    merged = kind_params(kind, params)
    if increasing and kind not in MONOTONE_KINDS:
        raise ValueError(f"monotone_increasing: kind {kind!r} cannot be constrained; expected one of {MONOTONE_KINDS}")
    if increasing and kind in TREE_KINDS:
        if columns is None:
            raise ValueError("monotone_increasing: the trees need `columns`, the feature columns in fit order")
        positions = monotone_positions(columns, increasing)
        if kind == "lightgbm":
            merged["monotone_constraints"] = positions
        elif kind == "xgboost":
            merged["monotone_constraints"] = "(" + ",".join(map(str, positions)) + ")"  # XGBoost 3's form
        else:
            merged["monotonic_cst"] = positions
    if kind == "lightgbm":
        from lightgbm import LGBMClassifier

        clf: Any = LGBMClassifier(scale_pos_weight=pos_weight, **merged)
    elif kind == "xgboost":
        from xgboost import XGBClassifier

        clf = XGBClassifier(scale_pos_weight=pos_weight, **merged)
    elif kind == "random_forest":
        from sklearn.ensemble import RandomForestClassifier

        clf = RandomForestClassifier(class_weight={0: 1.0, 1: pos_weight}, **merged)
    elif kind == "logistic":
        clf = SignConstrainedLogistic(class_weight={0: 1.0, 1: pos_weight}, increasing=tuple(increasing), **merged)
    else:
        clf = OversampledMLP(pos_weight=pos_weight, **merged)
    if kind in TREE_KINDS:
        return Pipeline([("encode", CategoryCodes()), ("model", clf)])
    return Pipeline([("prepare", dense_preparation()), ("model", clf)])


def make_model(
    kind: str,
    *,
    pos_weight: float = 1.0,
    monotone_increasing: Sequence[str] = (),
    columns: Sequence[str] | None = None,
    **params: Any,
) -> Any:
    """An unfitted scikit-learn estimator for `kind` (one of `KINDS`).

    `pos_weight` weights the positive class (use `balanced_pos_weight(y)`); every member of an
    ensemble gets the same weight, so one correction applies to the ensemble's output.
    `monotone_increasing` names features whose rise must never lower the risk (`columns`, the
    feature columns in fit order, is then needed for the trees).

    Single kinds: `params` override `DEFAULT_PARAMS[kind]` and go to the final estimator.
    Ensembles: `params` override `ENSEMBLE_DEFAULTS[kind]`; the members' parameters resolve
    as `member_params` says.
    """
    if kind in SINGLE_KINDS:
        return _single_model(kind, pos_weight, monotone_increasing, columns, params)
    settings = kind_params(kind, params)
    try:
        members = member_params(kind, settings)
    except ValueError as exc:
        raise ValueError(f"{kind} ensemble {exc}") from None
    built = [(k, _single_model(k, pos_weight, monotone_increasing, columns, extra)) for k, extra in members]
    ensemble = {k: v for k, v in settings.items() if k not in _MEMBER_SETTINGS[kind]}
    if kind == "parallel":
        kinds = [k for k, _ in built]
        names = [f"{k}_{i}" if kinds.count(k) > 1 else k for i, k in enumerate(kinds)]
        return ParallelEnsemble(estimators=[(n, m) for n, (_, m) in zip(names, built, strict=True)], **ensemble)
    (_, first), (_, second) = built
    return CascadeEnsemble(first=first, second=second, **ensemble)
