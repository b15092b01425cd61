"""Evaluation of rankings of GPUs per grid time, against trivial baselines.

Definitions (every metric uses labelled rows only; censored rows are neither ranked nor counted):

- precision@K: at each grid time, rank the GPUs by score (ties broken by a fixed-seed random
  key, so a constant score ranks at random rather than by GPU name) and take the top K (all of
  them where fewer than K are labelled). `precision_at_k_mean` is the mean over grid times of
  (positives among the picks / picks), every grid time counting, also those without any
  positive; `precision_at_k_pooled` is all positives picked / all picks. `oracle` ranks by the
  label itself: the best any model can do when a grid time has fewer than K positives.
- recall of failure episodes: an episode is one failure of one GPU (failure time = ts +
  time_to_failure_h on its positive rows; where that is missing, a run of consecutive positive
  rows, with the failure taken at the run's last row, a lower bound of the lead time). It is
  caught when at some grid time within the horizon before the failure (one of its positive
  rows) the GPU is in the top K (or, with a threshold, its score is at least the threshold).
  Lead time: hours from the first catch to the failure; the median over caught episodes.
- `pr_auc` (average precision) and `roc_auc` over all labelled rows, ignoring grid times.

Baselines: `random` (uniform scores, fixed seed) and `heuristic` (the sum of the columns whose
name starts with `xid_count` or contains both `ecc` and `increase`; zeros where there are none).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from sklearn.metrics import average_precision_score, roc_auc_score

from ingest.errors import InputError
from models.frame import labels, require_columns, to_pandas
from models.split import as_timedelta
from models.top_k import parse_top_k

SEED = 0


def _prepared(frame: Any, scores: Any) -> pd.DataFrame:
    """ts (UTC), gpu_uuid, label, score, time_to_failure_h of the labelled rows."""
    df = to_pandas(frame)
    require_columns(df, ["ts", "gpu_uuid", "label"], "evaluation frame")
    score = np.asarray(scores, dtype=np.float64)
    if score.shape != (len(df),):
        raise InputError(f"scores: expected one per row of the frame ({len(df)}), got shape {score.shape}")
    ts = pd.to_datetime(df["ts"])
    ts = ts.dt.tz_localize("UTC") if ts.dt.tz is None else ts.dt.tz_convert("UTC")
    ttf = (
        pd.to_numeric(df["time_to_failure_h"]).to_numpy(dtype=np.float64, na_value=np.nan)
        if "time_to_failure_h" in df.columns
        else np.full(len(df), np.nan)
    )
    out = pd.DataFrame(
        {
            "ts": ts.reset_index(drop=True),
            "gpu_uuid": df["gpu_uuid"].to_numpy(),
            "label": labels(df).to_numpy(),
            "score": score,
            "time_to_failure_h": ttf,
        }
    )
    return out.loc[out["label"].notna()].reset_index(drop=True)


def time_key(df: pd.DataFrame) -> np.ndarray:
    """The grid time of each row as an integer, for grouping. (Grouping by the timezone-aware
    column itself converts it to Python objects first: on the demo's 146k test rows that was
    90% of the comparison's time.)"""
    return np.asarray(df["ts"].astype("int64").to_numpy(), dtype=np.int64)


def _ranks(df: pd.DataFrame, seed: int) -> np.ndarray:
    """1-based rank of each row's score within its grid time (1 = highest)."""
    tiebreak = np.random.default_rng(seed).random(len(df))
    ts = time_key(df)
    order = np.lexsort((tiebreak, -df["score"].to_numpy(), ts))
    # In `order`, each grid time is one run; a row's rank is its place in its run.
    sorted_ts = ts[order]
    position = np.arange(len(df))
    starts = np.concatenate([[True], sorted_ts[1:] != sorted_ts[:-1]]) if len(df) else np.zeros(0, dtype=bool)
    run_start = np.maximum.accumulate(np.where(starts, position, 0)) if len(df) else position
    ranks = np.empty(len(df), dtype=np.int64)
    ranks[order] = position - run_start + 1
    return ranks


def _precision(df: pd.DataFrame, k: int, seed: int) -> dict[str, Any]:
    picked = _ranks(df, seed) <= k
    per_time = (
        pd.DataFrame({"ts": df["ts"], "hit": picked & (df["label"] == 1).to_numpy(), "picked": picked})
        .groupby("ts")[["hit", "picked"]]
        .sum()
    )
    return {
        "precision_at_k_mean": _num((per_time["hit"] / per_time["picked"]).mean()),
        "precision_at_k_pooled": _num(per_time["hit"].sum() / per_time["picked"].sum()),
        "n_times": len(per_time),
        "n_times_with_positive": int(df.loc[df["label"] == 1, "ts"].nunique()),
    }


def precision_at_k(frame: Any, k: int, *, score: str = "score", seed: int = SEED) -> dict[str, Any]:
    """Precision of the top `k` GPUs per grid time, ranked by column `score` of `frame`:
    `precision_at_k_mean` (over grid times) and `precision_at_k_pooled` (over all picks), with
    `n_times` and `n_times_with_positive`; see the module docstring."""
    if k < 1:
        raise InputError(f"k: expected a positive number of GPUs, got {k}")
    df = to_pandas(frame)
    require_columns(df, [score], "precision_at_k")
    return _precision(_prepared(df, df[score]), k, seed)


def _failure_times(df: pd.DataFrame) -> pd.Series:
    """The failure time of each positive row of `df` (from `_prepared`); NaT elsewhere."""
    pos = (df["label"] == 1).to_numpy()
    failure = pd.Series(pd.NaT, index=df.index, dtype="datetime64[ns, UTC]")
    ttf = df["time_to_failure_h"]
    known = pos & ttf.notna().to_numpy()
    # Rounded so that float32 time_to_failure_h values of one failure agree.
    failure[known] = (df.loc[known, "ts"] + pd.to_timedelta(ttf[known], unit="h")).dt.round("min")
    unknown = pos & ~known
    if unknown.any():
        # Runs of consecutive positive rows of one GPU; the failure comes after the run.
        sub = df.loc[pos, ["gpu_uuid", "ts"]].sort_values(["gpu_uuid", "ts"])
        step = df["ts"].drop_duplicates().sort_values().diff().min()
        new_run = (sub["gpu_uuid"] != sub["gpu_uuid"].shift()) | (sub["ts"].diff() > step)
        run_end = sub.groupby(new_run.cumsum())["ts"].transform("max")
        failure[unknown] = run_end.reindex(df.index)[unknown]
    return failure


def failure_episodes(frame: Any) -> pd.DataFrame:
    """One row (gpu_uuid, failure_ts) per failure episode seen in the labelled rows."""
    df = _prepared(frame, np.zeros(len(to_pandas(frame))))
    episodes = pd.DataFrame({"gpu_uuid": df["gpu_uuid"], "failure_ts": _failure_times(df)})
    return episodes.dropna().drop_duplicates().sort_values(["failure_ts", "gpu_uuid"], ignore_index=True)


def _recall(df: pd.DataFrame, caught: np.ndarray) -> dict[str, Any]:
    failure = _failure_times(df)
    pos = failure.notna().to_numpy()
    rows = pd.DataFrame(
        {"gpu_uuid": df["gpu_uuid"][pos], "failure_ts": failure[pos], "ts": df["ts"][pos], "caught": caught[pos]}
    )
    n = int(rows.groupby(["gpu_uuid", "failure_ts"]).ngroups)
    first = rows.loc[rows["caught"]].groupby(["gpu_uuid", "failure_ts"])["ts"].min()
    lead_h = (first.index.get_level_values("failure_ts") - pd.DatetimeIndex(first)) / pd.Timedelta(hours=1)
    return {
        "n_episodes": n,
        "n_caught": len(first),
        "recall": _num(len(first) / n) if n else None,
        "lead_time_h_median": _num(np.median(np.asarray(lead_h, dtype=float))) if len(first) else None,
    }


def _caught(df: pd.DataFrame, k: int | None, threshold: float | None, seed: int) -> np.ndarray:
    caught = np.zeros(len(df), dtype=bool)
    if k is not None:
        caught |= _ranks(df, seed) <= k
    if threshold is not None:
        caught |= df["score"].to_numpy() >= threshold
    return caught


def episode_recall(
    frame: Any,
    *,
    k: int | None = None,
    threshold: float | None = None,
    score: str = "score",
    seed: int = SEED,
) -> dict[str, Any]:
    """Failure episodes caught in the top `k` (or at score >= `threshold`; either suffices when
    both are given) before they happen: n_episodes, n_caught, recall and the median lead time
    of the first catch in hours (None when nothing is caught); see the module docstring."""
    if k is None and threshold is None:
        raise InputError("episode_recall: expected k or threshold, got neither")
    df = to_pandas(frame)
    require_columns(df, [score], "episode_recall")
    prepared = _prepared(df, df[score])
    return _recall(prepared, _caught(prepared, k, threshold, seed))


def row_metrics(y: np.ndarray, score: np.ndarray) -> dict[str, Any]:
    """PR-AUC (average precision) and ROC-AUC over rows; None where only one class is present."""
    y = np.asarray(y)
    if len(np.unique(y)) < 2:
        return {"pr_auc": None, "roc_auc": None}
    return {"pr_auc": _num(average_precision_score(y, score)), "roc_auc": _num(roc_auc_score(y, score))}


def score_metrics(
    frame: Any, scores: Any, *, k: int, threshold: float | None = None, seed: int = SEED
) -> dict[str, Any]:
    """Every metric of one score vector (aligned with the rows of `frame`): precision@K,
    episode recall and lead time in the top K (`*_at_k`) and, with `threshold`, at
    score >= threshold (`*_at_threshold`), PR-AUC and ROC-AUC."""
    df = _prepared(frame, scores)
    out: dict[str, Any] = _precision(df, k, seed)
    variants = [("at_k", _caught(df, k, None, seed))]
    if threshold is not None:
        variants.append(("at_threshold", _caught(df, None, threshold, seed)))
    for suffix, caught in variants:
        recall = _recall(df, caught)
        out["n_episodes"] = recall.pop("n_episodes")
        out.update({f"{name}_{suffix}": value for name, value in recall.items()})
    out.update(row_metrics(df["label"].to_numpy(dtype=int), df["score"].to_numpy()))
    return out


def baseline_scores(frame: Any, seed: int = SEED) -> dict[str, np.ndarray]:
    """Scores a model has to beat: `random` (uniform, fixed seed) and `heuristic` (sum of the
    `xid_count*` and `*ecc*increase*` columns, nulls as 0; zeros if there are no such columns)."""
    df = to_pandas(frame)
    return {"random": random_scores(len(df), seed), "heuristic": heuristic_scores(df)}


def random_scores(rows: int, seed: int = SEED) -> np.ndarray:
    return np.random.default_rng(seed).random(rows)


def heuristic_scores(frame: pd.DataFrame) -> np.ndarray:
    """Per row, the sum of the `heuristic_columns` (nulls as 0)."""
    heuristic = np.zeros(len(frame))
    for c in heuristic_columns(frame):
        heuristic += pd.to_numeric(frame[c], errors="coerce").fillna(0).to_numpy(dtype=np.float64)
    return heuristic


def heuristic_columns(frame: pd.DataFrame) -> list[str]:
    return [
        c
        for c in frame.columns
        if pd.api.types.is_numeric_dtype(frame[c]) and (c.startswith("xid_count") or ("ecc" in c and "increase" in c))
    ]


def _num(value: Any) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value


# -- walk-forward metrics ---------------------------------------------------------------------
#
# The walk-forward comparison (models/walk_forward.py) scores every grid time of a test period
# with several contenders and compares them day by day. The pieces below are pure functions of
# a prepared frame (`prepare_scored`): they know nothing about how the scores were made.

HARDWARE_XID_CLASSES = ("memory", "nvlink", "bus", "gsp")
"""XID classes (ingest/xid_classes.csv) a rule-based monitor treats as hardware trouble."""
UNCORRECTABLE_ECC_COUNTERS = (
    "ecc_dbe_volatile_total",
    "ecc_dbe_aggregate_total",
    "retired_pages_dbe_total",
    "remapped_rows_uncorrectable_total",
)
"""Counters whose increase means an uncorrectable (double-bit) memory error."""
RULE_WINDOW = "24h"


def rule_columns(frame: Any, window: str = RULE_WINDOW) -> list[str]:
    """The feature columns the rule baseline reads that `frame` has: hardware-class XID counts
    and uncorrectable-ECC counter increases over `window` (a feature window label, "24h")."""
    names = [f"xid_{c}_count_{window}" for c in HARDWARE_XID_CLASSES]
    names += [f"{c}_increase_{window}" for c in UNCORRECTABLE_ECC_COUNTERS]
    return [c for c in names if c in to_pandas(frame).columns]


def rule_flags(frame: Any, window: str = RULE_WINDOW) -> np.ndarray:
    """The rule existing monitors apply (NVSentinel, DCGM health watches): flag a GPU when it
    logged any hardware-class XID or any uncorrectable ECC error in the last `window`.
    A missing value never flags. Raises InputError when the frame has none of the columns."""
    df = to_pandas(frame)
    columns = rule_columns(df, window)
    if not columns:
        raise InputError(
            f"rule baseline: no xid_<class>_count_{window} or <ecc counter>_increase_{window} columns; "
            f"expected some of {[f'xid_{c}_count_{window}' for c in HARDWARE_XID_CLASSES]}"
        )
    flags = np.zeros(len(df), dtype=bool)
    for c in columns:
        flags |= pd.to_numeric(df[c], errors="coerce").fillna(0).to_numpy(dtype=np.float64) > 0
    return flags


def expected_failures_per_day(frame: Any) -> float:
    """Failure episodes per day in `frame` (its labelled rows), over the days it spans."""
    df = to_pandas(frame)
    cols = [c for c in ("ts", "gpu_uuid", "label", "time_to_failure_h") if c in df.columns]
    episodes = failure_episodes(df[cols])
    ts = pd.to_datetime(df["ts"])
    days = max((ts.max() - ts.min()) / pd.Timedelta(days=1), 1.0) if len(df) else 1.0
    return len(episodes) / days


def k_per_row(prepared: pd.DataFrame, spec: str | int, expected_per_day: float | None = None) -> np.ndarray:
    """K for each row of `prepared` (its grid time's K) under `spec` (`parse_top_k`)."""
    kind, value = parse_top_k(spec)
    if kind == "count":
        return np.full(len(prepared), int(value), dtype=np.int64)
    if kind == "expected":
        if expected_per_day is None:
            raise InputError("top_k 'expected': the expected failures per day were not given")
        return np.full(len(prepared), max(1, round(expected_per_day)), dtype=np.int64)
    fleet = prepared.groupby("ts")["gpu_uuid"].transform("size").to_numpy()
    return np.maximum(1, np.ceil(value * fleet - 1e-9)).astype(np.int64)


def prepare_scored(frame: Any, scores: Any) -> pd.DataFrame:
    """The labelled rows of `frame` with their `score`: ts (UTC), gpu_uuid, label,
    time_to_failure_h and failure_ts (the failure each positive row announces; NaT elsewhere)."""
    df = _prepared(frame, scores)
    df["failure_ts"] = _failure_times(df)
    return df


def ranks(prepared: pd.DataFrame, seed: int = SEED) -> np.ndarray:
    """1-based rank of each row's score among the rows of its grid time (ties at random)."""
    return _ranks(prepared, seed)


def episode_table(prepared: pd.DataFrame, caught: np.ndarray) -> pd.DataFrame:
    """One row per failure episode in `prepared`: gpu_uuid, failure_ts, caught (the GPU was
    caught on one of its positive rows) and lead_h (hours from the first catch to the failure)."""
    pos = prepared["failure_ts"].notna().to_numpy()
    # Positive rows only, before anything is converted (the times stay datetime64).
    rows = prepared.loc[pos, ["gpu_uuid", "failure_ts", "ts"]].reset_index(drop=True)
    rows["caught"] = np.asarray(caught)[pos]
    keys = ["gpu_uuid", "failure_ts"]
    episodes = rows.groupby(keys, sort=True)["caught"].any().rename("caught").reset_index()
    first = rows.loc[rows["caught"]].groupby(keys)["ts"].min().rename("first_catch").reset_index()
    episodes = episodes.merge(first, on=keys, how="left")
    lead = pd.to_datetime(episodes["failure_ts"]) - pd.to_datetime(episodes["first_catch"])
    episodes["lead_h"] = lead.dt.total_seconds() / 3600.0
    return episodes.drop(columns="first_catch").sort_values(["failure_ts", "gpu_uuid"], ignore_index=True)


def attach_modes(episodes: pd.DataFrame, failures: pd.DataFrame | None, tolerance: str = "6h") -> pd.Series:
    """The failure mode of each episode: the ground-truth failure (`failures`: gpu_uuid, ts,
    mode) of the same GPU nearest in time within `tolerance`; "unknown" where there is none
    (a real fleet has no ground truth, and a label can come from an XID the truth calls noise)."""
    if failures is None or len(episodes) == 0:
        return pd.Series("unknown", index=episodes.index, dtype=object)
    truth = to_pandas(failures)
    require_columns(truth, ["gpu_uuid", "ts", "mode"], "failures")
    truth_ts = pd.to_datetime(truth["ts"])
    truth_ts = truth_ts.dt.tz_localize("UTC") if truth_ts.dt.tz is None else truth_ts.dt.tz_convert("UTC")
    right = pd.DataFrame(
        {"gpu_uuid": truth["gpu_uuid"].astype(str).to_numpy(), "truth_ts": truth_ts.to_numpy(), "mode": truth["mode"]}
    ).sort_values("truth_ts")
    left = (
        episodes.assign(_order=np.arange(len(episodes)), gpu_uuid=episodes["gpu_uuid"].astype(str))
        .sort_values("failure_ts")
        .reset_index(drop=True)
    )
    # merge_asof needs one resolution on both sides (pandas keeps us or ns as read).
    left["failure_ts"] = pd.to_datetime(left["failure_ts"], utc=True).astype("datetime64[ns, UTC]")
    right["truth_ts"] = pd.to_datetime(right["truth_ts"], utc=True).astype("datetime64[ns, UTC]")
    matched = pd.merge_asof(
        left,
        right,
        left_on="failure_ts",
        right_on="truth_ts",
        by="gpu_uuid",
        direction="nearest",
        tolerance=as_timedelta(tolerance, "tolerance"),
    ).sort_values("_order")
    return pd.Series(matched["mode"].fillna("unknown").to_numpy(dtype=object), index=episodes.index)


def bootstrap_ci(
    per_day: np.ndarray,
    statistic: Any,
    *,
    samples: int,
    seed: int,
    level: float = 0.95,
) -> tuple[float | None, float | None]:
    """Percentile bootstrap interval over days: resample the rows of `per_day` (one per day;
    1-D or 2-D) with replacement `samples` times with a generator seeded by `seed`, apply
    `statistic` to each resample. Resampling whole days keeps the grid times of a day, which
    are strongly correlated, together. The same seed and number of days draw the same days,
    so intervals of several contenders are paired. (None, None) with fewer than 2 days."""
    values = np.asarray(per_day, dtype=np.float64)
    n = len(values)
    if n < 2 or samples < 1:
        return None, None
    draws = np.random.default_rng(seed).integers(0, n, size=(samples, n))
    stats = np.array([statistic(values[idx]) for idx in draws], dtype=np.float64)
    stats = stats[~np.isnan(stats)]
    if len(stats) == 0:
        return None, None
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return _num(low), _num(high)


def mean_of_ratios(per_day: np.ndarray) -> float:
    """Mean over days of hits/picks (columns 0 and 1); days without picks are left out."""
    hits, picks = per_day[:, 0], per_day[:, 1]
    keep = picks > 0
    return float(np.mean(hits[keep] / picks[keep])) if keep.any() else math.nan


def pooled_ratio(per_day: np.ndarray) -> float:
    """sum(column 0) / sum(column 1): e.g. episodes caught / episodes over the drawn days."""
    total = per_day[:, 1].sum()
    return float(per_day[:, 0].sum() / total) if total > 0 else math.nan


def safe_pr_auc(y: np.ndarray, score: np.ndarray) -> float | None:
    """Average precision, or None where only one class is present."""
    y = np.asarray(y)
    if len(np.unique(y)) < 2:
        return None
    return _num(average_precision_score(y, score))


def _day_index(prepared: pd.DataFrame, start: pd.Timestamp) -> np.ndarray:
    return ((prepared["ts"] - start) // pd.Timedelta(days=1)).to_numpy(dtype=np.int64)


def _by_k(
    prepared: pd.DataFrame,
    episodes: pd.DataFrame,
    modes: pd.Series,
    day: np.ndarray,
    n_days: int,
    k: np.ndarray,
    *,
    samples: int,
    seed: int,
    flags: np.ndarray | None = None,
) -> dict[str, Any]:
    """precision@K per day and overall (per GPU-hour, and per distinct GPU and day), episode
    recall and lead time overall and per mode. With `flags`, only flagged rows are picked (the
    paper's intersection: at most K, never topped up to K)."""
    picked = ranks(prepared, seed) <= k
    if flags is not None:
        picked &= flags
    hit = picked & (prepared["label"] == 1).to_numpy()
    hits = np.bincount(day, weights=hit, minlength=n_days)
    picks = np.bincount(day, weights=picked, minlength=n_days)
    caught = episode_table(prepared, picked)
    fail_day = ((caught["failure_ts"] - prepared["ts"].min()) // pd.Timedelta(days=1)).clip(0, n_days - 1)
    fail_day = fail_day.to_numpy(dtype=np.int64)
    caught_d = np.bincount(fail_day, weights=caught["caught"].to_numpy(dtype=float), minlength=n_days)
    failures_d = np.bincount(fail_day, minlength=n_days).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        daily_precision = np.where(picks > 0, hits / np.where(picks > 0, picks, 1), np.nan)
    ts = time_key(prepared)
    per_time_hits = pd.Series(hit).groupby(ts).sum()
    per_time_picks = pd.Series(picked).groupby(ts).sum()
    leads = caught.loc[caught["caught"], "lead_h"].to_numpy(dtype=float)
    by_mode = {}
    for mode in sorted(set(modes)):
        mask = (modes == mode).to_numpy()
        mode_leads = caught.loc[mask & caught["caught"].to_numpy(), "lead_h"].to_numpy(dtype=float)
        by_mode[mode] = {
            "n_episodes": int(mask.sum()),
            "n_caught": int(caught["caught"].to_numpy()[mask].sum()),
            "recall": _num(caught["caught"].to_numpy()[mask].mean()) if mask.any() else None,
            "lead_time_h_median": _num(np.median(mode_leads)) if len(mode_leads) else None,
        }
    precision_days = np.column_stack([hits, picks])
    recall_days = np.column_stack([caught_d, failures_d])
    gpu_days = _gpu_day_precision(prepared, picked, hit, day, n_days)
    valid = picks > 0
    return {
        "k_mean": _num(k.mean()) if len(k) else None,
        "picks_mean": _num(per_time_picks.mean()) if len(per_time_picks) else None,
        "precision_at_k_mean": _num((per_time_hits / per_time_picks).mean()),
        "precision_at_k_pooled": _num(hits.sum() / picks.sum()) if picks.sum() else None,
        "precision_daily_mean": _num(np.nanmean(daily_precision)) if valid.any() else None,
        "precision_daily_std": _num(np.nanstd(daily_precision)) if valid.any() else None,
        "precision_daily_ci": list(bootstrap_ci(precision_days, mean_of_ratios, samples=samples, seed=seed)),
        "precision_gpu_day_mean": _num(mean_of_ratios(gpu_days)) if gpu_days[:, 1].sum() else None,
        "precision_gpu_day_ci": list(bootstrap_ci(gpu_days, mean_of_ratios, samples=samples, seed=seed)),
        "n_episodes": len(caught),
        "n_caught": int(caught["caught"].sum()),
        "recall": _num(caught["caught"].mean()) if len(caught) else None,
        "recall_ci": list(bootstrap_ci(recall_days, pooled_ratio, samples=samples, seed=seed)),
        "lead_time_h_median": _num(np.median(leads)) if len(leads) else None,
        "by_mode": by_mode,
        "daily": [
            {
                "day": d,
                "precision": _num(daily_precision[d]),
                "n_failures": int(failures_d[d]),
                "n_caught": int(caught_d[d]),
                "recall": _num(caught_d[d] / failures_d[d]) if failures_d[d] else None,
            }
            for d in range(n_days)
        ],
        "_picked": picked,
    }


def _gpu_day_precision(
    prepared: pd.DataFrame, picked: np.ndarray, hit: np.ndarray, day: np.ndarray, n_days: int
) -> np.ndarray:
    """Per day: (distinct GPUs picked at some grid time that day whose label was 1 at one of
    their picks, distinct GPUs picked): precision counted in GPUs, not GPU-hours."""
    table = pd.DataFrame({"gpu": prepared["gpu_uuid"].to_numpy()[picked], "day": day[picked], "hit": hit[picked]})
    per_gpu = table.groupby(["day", "gpu"])["hit"].max().reset_index()
    hits = np.bincount(per_gpu["day"], weights=per_gpu["hit"], minlength=n_days)
    count = np.bincount(per_gpu["day"], minlength=n_days).astype(float)
    return np.column_stack([hits, count])


def _by_age(prepared: pd.DataFrame, picked: np.ndarray, age_h: np.ndarray, bucket_h: float) -> list[dict[str, Any]]:
    """Pooled precision@K by the age of the model that made the ranking, in `bucket_h` bins."""
    bucket = np.floor(age_h / bucket_h).astype(np.int64)
    hit = picked & (prepared["label"] == 1).to_numpy()
    table = pd.DataFrame({"bucket": bucket, "hit": hit, "picked": picked}).groupby("bucket")[["hit", "picked"]].sum()
    return [
        {"age_h": float(b) * bucket_h, "precision": _num(h / p) if p else None, "n_picks": int(p)}
        for b, h, p in zip(table.index.to_numpy(), table["hit"].to_numpy(), table["picked"].to_numpy(), strict=True)
    ]


def compare_scores(
    test: Any,
    scores: dict[str, np.ndarray],
    *,
    top_k: Sequence[str],
    expected_per_day: float,
    model_age_h: dict[str, np.ndarray] | None = None,
    failures: Any = None,
    bootstrap_samples: int = 1000,
    seed: int = SEED,
    age_bucket_h: float = 6.0,
    flags: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Every figure of the walk-forward comparison for each score vector of `scores` (aligned
    with the rows of `test`), at every K of `top_k` (the first is the headline).

    Per scorer: the headline figures under the keys of `score_metrics` (precision_at_k_mean,
    precision_at_k_pooled, n_episodes, n_caught_at_k, recall_at_k, lead_time_h_median_at_k,
    pr_auc, roc_auc), `by_k` (per K: daily precision mean, std and bootstrap CI over days,
    episode recall with its CI, lead time, the same per failure mode, and the daily series),
    `daily_pr_auc`, and `by_model_age` (headline precision@K by hours since the model's
    retraining, for scorers in `model_age_h`). Episodes get their failure mode from `failures`
    (see `attach_modes`). A scorer in `flags` picks only its flagged rows (`_by_k`)."""
    if not top_k:
        raise InputError("top_k: expected at least one K specification, got none")
    specs = [str(spec) for spec in top_k]
    for spec in specs:
        parse_top_k(spec)
    first = next(iter(scores.values())) if scores else np.zeros(len(to_pandas(test)))
    base = prepare_scored(test, first)
    if len(base) == 0:
        raise InputError("compare_scores: no labelled test rows; expected a test period with settled labels")
    day = _day_index(base, base["ts"].min())
    n_days = int(day.max()) + 1
    episodes = episode_table(base, np.zeros(len(base), dtype=bool))
    modes = attach_modes(episodes, failures)
    k_rows = {spec: k_per_row(base, spec, expected_per_day) for spec in specs}
    y = base["label"].to_numpy(dtype=int)
    labelled = _labelled(test)
    out: dict[str, Any] = {}
    for name, raw in scores.items():
        values = np.asarray(raw, dtype=np.float64)
        if values.shape != labelled.shape:
            raise InputError(
                f"scores of {name!r}: expected one per test row ({len(labelled)}), got shape {values.shape}"
            )
        prepared = base.assign(score=values[labelled])
        flagged = None if flags is None or name not in flags else np.asarray(flags[name], dtype=bool)[labelled]
        by_k = {
            spec: _by_k(
                prepared,
                episodes,
                modes,
                day,
                n_days,
                k_rows[spec],
                samples=bootstrap_samples,
                seed=seed,
                flags=flagged,
            )
            for spec in specs
        }
        head = by_k[specs[0]]
        picked = head["_picked"]
        entry: dict[str, Any] = {
            "precision_at_k_mean": head["precision_at_k_mean"],
            "precision_at_k_pooled": head["precision_at_k_pooled"],
            "n_episodes": head["n_episodes"],
            "n_caught_at_k": head["n_caught"],
            "recall_at_k": head["recall"],
            "lead_time_h_median_at_k": head["lead_time_h_median"],
            **row_metrics(y, prepared["score"].to_numpy()),
            "daily_pr_auc": [safe_pr_auc(y[day == d], prepared["score"].to_numpy()[day == d]) for d in range(n_days)],
            "by_k": {spec: {key: value for key, value in v.items() if key != "_picked"} for spec, v in by_k.items()},
        }
        if model_age_h is not None and name in model_age_h:
            entry["by_model_age"] = _by_age(prepared, picked, np.asarray(model_age_h[name])[labelled], age_bucket_h)
        out[name] = entry
    return out


def _labelled(frame: Any) -> np.ndarray:
    return labels(to_pandas(frame)).notna().to_numpy()
