"""Calibrated risk: a monotone map from a model's odds-corrected probability to the observed
failure rate, fitted on a slice of labelled rows that comes after the model's training window,
and the figures that say how well a probability is calibrated.

Why a map at all. `TrainedModel.predict_risk` already divides out the class weight and the
negative subsampling (`models.estimators.prior_correction`), so its output has the right base
rate on average, but not in the tails: trees fit on a few hundred failures are over-confident
at the top and under-confident at the bottom. Publish tiers compare risk with absolute
thresholds, so the map is fitted on rows the model never trained on (a *later* slice: the
model's as-of time is moved back by the slice, see `models.train.calibration_bounds`).

Methods (`METHODS`):

- `platt`: logistic regression on the logit of the odds-corrected risk (two parameters: a
  slope, which corrects over- or under-confidence, and an offset). Strictly increasing, so it
  keeps the model's order and gives an alarm threshold every volume; stable with a few dozen
  failures in the slice.
- `beta`: beta calibration (Kull, Silva Filho and Flach, 2017): a logistic regression on
  log(p) and -log(1 - p), so a slope of its own for each tail of the logit (at the top the
  map's slope is b, at the bottom a, Platt being a = b). One slope fitted on a slice that is
  almost all healthy rows is set by the bulk and can be too steep where the few high risks
  are; three parameters are still stable with a few dozen failures. Both slopes are kept
  non-negative (a feature whose slope comes out negative is dropped and the rest refitted),
  so the map is increasing.
- `isotonic`: the pool-adjacent-violators fit (scikit-learn), interpolated linearly between
  the centres of its blocks, so that it is increasing between the first and the last block
  instead of a staircase (rows of one block would otherwise share one risk). Needs more
  failures than Platt; below the first and above the last centre it is flat.

The slice may hold a sample of its healthy rows (drawn at a share r, as training draws them):
each drawn healthy row then weighs 1/r (`fit_calibration`'s `negative_fraction`), so the map
is fitted to the slice's true base rate.

Figures (`reliability`): Brier score, expected calibration error over ten equal-width bins of
risk (the usual definition; with a rare event most rows are in the first bin), and a
reliability table over log-spaced bins with the observed rate's 95% Wilson interval;
`high_risk_check` compares the mean predicted and observed rate among rows at or above a risk;
`top_risk_ties` counts the rows that share the highest risk. Given each row's GPU, the
intervals count the rows as the GPUs they come from (`effective_rows`): a GPU's hours at high
risk fail or survive together, and read as independent rows, 37 hours of three GPUs would
claim the precision of 37 draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ingest.errors import InputError

METHODS = ("platt", "beta", "isotonic")
DEFAULT_METHOD = "platt"
_EPS = 1e-12

RELIABILITY_EDGES = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.2, 0.35, 0.5, 0.8, 1.0)
"""Bins of the reliability table: log-spaced where most rows are, then the publish tiers' range."""


def logit(p: Any) -> np.ndarray:
    """log(p / (1 - p)), with p kept within 1e-12 of 0 and 1."""
    return _logit(np.asarray(p, dtype=np.float64))


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), _EPS, 1.0 - _EPS)
    return np.log(p) - np.log1p(-p)


def _expit(z: np.ndarray) -> np.ndarray:
    return np.asarray(0.5 * (1.0 + np.tanh(0.5 * np.asarray(z, dtype=np.float64))), dtype=np.float64)


@dataclass(frozen=True)
class Calibration:
    """A fitted calibration map and where it came from (its provenance, `provenance()`)."""

    method: str
    params: dict[str, Any]
    """platt: {"slope", "offset"} on the logit; beta: {"a", "b", "c"} on log(p) and -log(1 - p);
    isotonic: {"x", "y"}, the block centres (lists)."""
    slice_start: pd.Timestamp
    slice_end: pd.Timestamp
    """The labelled rows the map was fitted on: slice_start <= ts < slice_end."""
    n_rows: int
    n_positives: int
    negative_fraction: float = 1.0
    """Share of the slice's healthy rows that were drawn (each weighed 1 / negative_fraction)."""
    mean_risk_before: float | None = None
    """Weighted mean odds-corrected risk on the slice, and (below) the observed failure rate."""
    observed_rate: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def apply(self, risk: Any) -> np.ndarray:
        """The calibrated probability of each odds-corrected risk."""
        return self.apply_logit(_logit(np.asarray(risk, dtype=np.float64)))

    def apply_logit(self, z: Any) -> np.ndarray:
        """The calibrated probability of each odds-corrected logit (`logit` of the risk): what
        a linear model's decision function gives without passing through a probability, which
        rounds to exactly 1.0 in float64 above a logit of about 37 and would send every such
        row to one calibrated value."""
        z = np.asarray(z, dtype=np.float64)
        if self.method == "platt":
            return _expit(self.params["slope"] * z + self.params["offset"])
        if self.method == "beta":
            return _expit(_beta_argument(z, self.params))
        x, y = np.asarray(self.params["x"]), np.asarray(self.params["y"])
        return np.asarray(np.interp(z, x, y), dtype=np.float64)

    def provenance(self) -> dict[str, Any]:
        """JSON-ready: method, slice, rows, positives, the draw, and the map's parameters."""
        return {
            "method": self.method,
            "slice_start": self.slice_start.isoformat(),
            "slice_end": self.slice_end.isoformat(),
            "n_rows": self.n_rows,
            "n_positives": self.n_positives,
            "negative_fraction": self.negative_fraction,
            "mean_risk_before": self.mean_risk_before,
            "observed_rate": self.observed_rate,
            "params": {k: (list(v) if isinstance(v, list | tuple | np.ndarray) else v) for k, v in self.params.items()},
            **self.extra,
        }


def check_method(method: str) -> str:
    if method not in METHODS:
        raise InputError(f"calibration method: expected one of {list(METHODS)}, got {method!r}")
    return method


def fit_calibration(
    risk: Any,
    y: Any,
    method: str = DEFAULT_METHOD,
    *,
    slice_start: pd.Timestamp,
    slice_end: pd.Timestamp,
    negative_fraction: float = 1.0,
    where: str = "calibration slice",
) -> Calibration:
    """Fit `method` (`METHODS`) mapping odds-corrected `risk` to the labels `y` (0/1) of the
    slice [slice_start, slice_end). Healthy rows weigh 1 / `negative_fraction` (the share of
    them drawn). InputError naming `where` when the slice has no failure or no healthy row."""
    return fit_calibration_on_logits(
        _logit(np.asarray(risk, dtype=np.float64)),
        y,
        method,
        slice_start=slice_start,
        slice_end=slice_end,
        negative_fraction=negative_fraction,
        where=where,
    )


def fit_calibration_on_logits(
    logit: Any,
    y: Any,
    method: str = DEFAULT_METHOD,
    *,
    slice_start: pd.Timestamp,
    slice_end: pd.Timestamp,
    negative_fraction: float = 1.0,
    where: str = "calibration slice",
) -> Calibration:
    """`fit_calibration` from the odds-corrected logits (`TrainedModel.predict_uncalibrated_logit`)
    rather than the risks: a linear model's large logits keep their order instead of all
    rounding to a risk of 1.0."""
    check_method(method)
    z = np.asarray(logit, dtype=np.float64)
    labels = np.asarray(y, dtype=np.float64)
    if z.shape != labels.shape:
        raise InputError(f"{where}: expected one risk per label, got {z.shape} and {labels.shape}")
    if not 0.0 < negative_fraction <= 1.0:
        raise InputError(f"{where}: negative_fraction expected a share in (0, 1], got {negative_fraction!r}")
    keep = ~np.isnan(labels) & np.isfinite(z)
    z, labels = z[keep], labels[keep]
    n_pos = int((labels == 1).sum())
    place = f"{where} {slice_start} .. {slice_end}"
    if n_pos == 0 or n_pos == len(labels):
        raise InputError(
            f"{place}: {len(labels)} labelled rows with {n_pos} failures; "
            "expected failing and healthy rows to calibrate on (a longer calibration_window)"
        )
    weight = np.where(labels == 1, 1.0, 1.0 / negative_fraction)
    p = _expit(z)
    try:
        params = _FITS[method](z, labels, weight)
    except _CannotCalibrate as exc:
        raise InputError(f"{place}: {exc}") from exc
    return Calibration(
        method=method,
        params=params,
        slice_start=slice_start,
        slice_end=slice_end,
        n_rows=len(labels),
        n_positives=n_pos,
        negative_fraction=float(negative_fraction),
        mean_risk_before=float(np.average(p, weights=weight)),
        observed_rate=float(np.average(labels, weights=weight)),
    )


def _platt(z: np.ndarray, y: np.ndarray, weight: np.ndarray) -> dict[str, Any]:
    from sklearn.linear_model import LogisticRegression

    # Almost no penalty: two parameters on thousands of rows need none, and a strong one would
    # pull the slope towards zero (every GPU the same risk). Newton steps on two parameters reach
    # the maximum-likelihood fit in about ten iterations; L-BFGS at its default tolerance stopped
    # short of it (the weighted mean risk off the observed rate) and took three times as long.
    fit = LogisticRegression(C=1e6, solver="newton-cholesky", tol=1e-8, max_iter=100).fit(
        z.reshape(-1, 1), y.astype(int), sample_weight=weight
    )
    return {"slope": float(fit.coef_[0, 0]), "offset": float(fit.intercept_[0])}


def _beta_features(z: np.ndarray) -> np.ndarray:
    """log(p) and -log(1 - p) of p = expit(z), computed from z so that neither overflows nor
    rounds to zero in the tails."""
    return np.column_stack([-np.logaddexp(0.0, -z), np.logaddexp(0.0, z)])


def _beta_argument(z: np.ndarray, params: dict[str, Any]) -> np.ndarray:
    features = _beta_features(z)
    return np.asarray(params["a"] * features[:, 0] + params["b"] * features[:, 1] + params["c"], dtype=np.float64)


class _CannotCalibrate(ValueError):
    """The slice's scores admit no increasing map of this method (the caller names the slice)."""


def _beta(z: np.ndarray, y: np.ndarray, weight: np.ndarray) -> dict[str, Any]:
    from sklearn.linear_model import LogisticRegression

    features = _beta_features(z)

    # As for Platt: almost no penalty, Newton steps to the maximum-likelihood fit.
    def fit(columns: list[int]) -> tuple[np.ndarray, float]:
        model = LogisticRegression(C=1e6, solver="newton-cholesky", tol=1e-8, max_iter=100)
        model.fit(features[:, columns], y.astype(int), sample_weight=weight)
        coef = np.zeros(2)
        coef[columns] = model.coef_[0]
        return coef, float(model.intercept_[0])

    coef, offset = fit([0, 1])
    if (coef < 0).any():
        # A negative slope would make the map decrease on one side; refit on the other feature.
        kept = int(np.argmax(coef))
        coef, offset = fit([kept])
        if coef[kept] < 0:
            raise _CannotCalibrate(
                f"beta calibration found the risk falling as the failure rate rises "
                f"(slopes {coef.tolist()}); expected a model whose risk ranks failures higher"
            )
    return {"a": float(coef[0]), "b": float(coef[1]), "c": offset}


def _isotonic(z: np.ndarray, y: np.ndarray, weight: np.ndarray) -> dict[str, Any]:
    from sklearn.isotonic import IsotonicRegression

    fitted = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit_transform(z, y, sample_weight=weight)
    # The blocks of the fit are its runs of equal values; each is represented by its centre.
    blocks = pd.DataFrame({"value": fitted, "zw": z * weight, "w": weight}).groupby("value", sort=True).sum()
    centres = (blocks["zw"] / blocks["w"]).to_numpy()
    return {"x": centres.tolist(), "y": blocks.index.to_numpy(dtype=np.float64).tolist()}


_FITS = {"platt": _platt, "beta": _beta, "isotonic": _isotonic}
"""Each method's fit: (logits, labels, weights) -> the map's parameters."""


# -- how well a probability is calibrated --------------------------------------------------------


def wilson_interval(positives: float, n: float, level: float = 0.95) -> tuple[float | None, float | None]:
    """The Wilson score interval of a binomial rate (None, None without rows)."""
    if n <= 0:
        return None, None
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + level / 2.0))
    rate = positives / n
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def expected_calibration_error(y: Any, p: Any, bins: int = 10) -> float:
    """Sum over `bins` equal-width bins of risk of |mean risk - failure rate| x share of rows."""
    y, p = np.asarray(y, dtype=np.float64), np.asarray(p, dtype=np.float64)
    if len(y) == 0:
        return math.nan
    which = np.minimum((p * bins).astype(np.int64), bins - 1)
    n = np.bincount(which, minlength=bins)
    gap = np.abs(np.bincount(which, weights=p, minlength=bins) - np.bincount(which, weights=y, minlength=bins))
    return float(gap.sum() / n.sum())


FEW_GROUPS = 30
"""Below this many GPUs the cluster-robust variance is itself too uncertain to lean on (it is
estimated from the GPUs' spread: a handful of them can look like independent rows by chance),
so each GPU counts as at most one draw."""


def effective_rows(y: Any, groups: Any | None) -> float:
    """How many independent rows labels `y` are worth when the rows of one group (a GPU: its
    consecutive hours share one fate within the horizon) are correlated: the rows divided by
    the design effect of the cluster-robust variance of their rate, at most the rows. Every
    group at one rate (all failing, or none) shows no spread to estimate it from, and fewer than
    `FEW_GROUPS` groups too little: then each group counts as one draw, the groups' effective
    number n^2 / sum(rows of a group ^ 2) (the groups, when they hold as many rows each).
    `groups`: integer codes (`pandas.factorize`), or None: every row independent."""
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if groups is None or n == 0:
        return float(n)
    codes = np.asarray(groups, dtype=np.int64)
    sizes = np.bincount(codes)
    present = sizes > 0
    positives, sizes = np.bincount(codes, weights=y)[present], sizes[present]
    n_groups = len(sizes)
    one_per_group = float(n**2 / (sizes.astype(np.float64) ** 2).sum())
    rate = positives.sum() / n
    if n_groups < 2 or rate in (0.0, 1.0):
        return one_per_group
    variance = n_groups / (n_groups - 1) * float(((positives - rate * sizes) ** 2).sum()) / n**2
    robust = float(n) if variance <= 0.0 else min(float(n), float(rate * (1.0 - rate) / variance))
    return min(robust, one_per_group) if n_groups < FEW_GROUPS else robust


def rate_interval(y: Any, groups: Any | None) -> tuple[float | None, float | None]:
    """The 95% Wilson interval of the failure rate of labels `y`, counted as `effective_rows`."""
    y = np.asarray(y, dtype=np.float64)
    n_eff = effective_rows(y, groups)
    return wilson_interval(float(y.mean()) * n_eff if len(y) else 0.0, n_eff)


def _group_codes(groups: Any | None, n: int) -> np.ndarray | None:
    if groups is None:
        return None
    codes = np.asarray(groups)
    if codes.shape != (n,) or not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"groups: expected {n} integer codes (pandas.factorize), got {codes.dtype} {codes.shape}")
    return codes


def reliability(
    y: Any, p: Any, edges: tuple[float, ...] = RELIABILITY_EDGES, groups: Any | None = None
) -> dict[str, Any]:
    """Brier score, expected calibration error (`expected_calibration_error`) and the
    reliability table (per bin of `edges`: rows, failures, mean risk, observed rate and its
    95% Wilson interval, over `rate_interval`'s effective rows when each row's `groups` code
    is given) of risks `p` against labels `y` (NaN labels are left out)."""
    y, p = np.asarray(y, dtype=np.float64), np.asarray(p, dtype=np.float64)
    codes = _group_codes(groups, len(y))
    keep = ~np.isnan(y)
    y, p = y[keep], p[keep]
    codes = None if codes is None else codes[keep]
    which = np.clip(np.searchsorted(np.asarray(edges), p, side="right") - 1, 0, len(edges) - 2)
    table = []
    for b in range(len(edges) - 1):
        mask = which == b
        n = int(mask.sum())
        pos = float(y[mask].sum())
        low, high = rate_interval(y[mask], None if codes is None else codes[mask])
        table.append(
            {
                "low": edges[b],
                "high": edges[b + 1],
                "n_rows": n,
                "n_positives": int(pos),
                "mean_risk": float(p[mask].mean()) if n else None,
                "observed_rate": pos / n if n else None,
                "observed_ci": [low, high],
            }
        )
    return {**_summary(y, p), "bins": table}


def calibration_summary(y: Any, p: Any) -> dict[str, Any]:
    """`reliability` without its table: rows, failures, mean risk, observed rate, Brier score
    and ECE of risks `p` against labels `y` (NaN labels left out), for callers that show no bins."""
    y, p = np.asarray(y, dtype=np.float64), np.asarray(p, dtype=np.float64)
    keep = ~np.isnan(y)
    return _summary(y[keep], p[keep])


def _summary(y: np.ndarray, p: np.ndarray) -> dict[str, Any]:
    return {
        "n_rows": len(y),
        "n_positives": int(y.sum()),
        "mean_risk": float(p.mean()) if len(p) else None,
        "observed_rate": float(y.mean()) if len(y) else None,
        "brier": float(np.mean((p - y) ** 2)) if len(y) else None,
        "ece": _finite(expected_calibration_error(y, p)),
    }


HIGH_RISK = 0.5
HIGH_RISK_TOLERANCE = 0.1


def high_risk_check(
    y: Any,
    p: Any,
    level: float = HIGH_RISK,
    tolerance: float = HIGH_RISK_TOLERANCE,
    groups: Any | None = None,
) -> dict[str, Any]:
    """Among rows with risk >= `level`: how many (and of how many `groups`: GPUs), their mean
    risk, the observed failure rate with its 95% Wilson interval over the rows' effective number
    (`effective_rows`), and a verdict: `outside` when the whole interval lies more than
    `tolerance` from the mean risk (however few the rows, they show it); else `too few rows`
    when the interval is wider than the tolerance on either side (the rows cannot tell); else
    `within` (|observed - mean risk| <= `tolerance`) or `outside`."""
    y, p = np.asarray(y, dtype=np.float64), np.asarray(p, dtype=np.float64)
    codes = _group_codes(groups, len(y))
    keep = ~np.isnan(y) & (p >= level)
    n = int(keep.sum())
    pos = float(y[keep].sum())
    kept_codes = None if codes is None else codes[keep]
    n_eff = effective_rows(y[keep], kept_codes)
    low, high = wilson_interval(pos / n * n_eff if n else 0.0, n_eff)
    out: dict[str, Any] = {"level": level, "tolerance": tolerance, "n_rows": n, "n_positives": int(pos)}
    if kept_codes is not None:
        out["n_groups"] = len(np.unique(kept_codes))
        out["effective_rows"] = n_eff
    if n == 0:
        return {**out, "mean_risk": None, "observed_rate": None, "observed_ci": [None, None], "verdict": "no rows"}
    mean, rate = float(p[keep].mean()), pos / n
    assert low is not None and high is not None
    verdict = high_risk_verdict(mean, rate, (low, high), tolerance)
    return {**out, "mean_risk": mean, "observed_rate": rate, "observed_ci": [low, high], "verdict": verdict}


def high_risk_verdict(mean: float, rate: float, interval: tuple[float, float], tolerance: float) -> str:
    """`high_risk_check`'s verdict on a mean risk against an observed rate and its interval."""
    low, high = interval
    if low > mean + tolerance or high < mean - tolerance:
        return "outside"
    if high - rate > tolerance or rate - low > tolerance:
        return "too few rows"
    return "within" if abs(rate - mean) <= tolerance else "outside"


def top_risk_ties(p: Any) -> dict[str, Any]:
    """The highest risk and how many rows share it exactly: more than a few means the model's
    output saturates (a linear model's probability rounding to 1.0), and then which of them an
    alarm picks is decided by the tie-break, not by the model."""
    p = np.asarray(p, dtype=np.float64)
    p = p[np.isfinite(p)]
    if len(p) == 0:
        return {"top_risk": None, "n_rows": 0}
    top = float(p.max())
    return {"top_risk": top, "n_rows": int((p == top).sum())}


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value
