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

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sklearn.metrics import average_precision_score, roc_auc_score

from ingest.errors import InputError
from models.frame import labels, require_columns, to_pandas
from models.split import DurationLike, as_timedelta, time_split
from models.train import settled_until, train_model

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


def _ranks(df: pd.DataFrame, seed: int) -> np.ndarray:
    """1-based rank of each row's score within its grid time (1 = highest)."""
    tiebreak = np.random.default_rng(seed).random(len(df))
    order = np.lexsort((tiebreak, -df["score"].to_numpy(), df["ts"].astype("int64").to_numpy()))
    ranks = np.empty(len(df), dtype=np.int64)
    ranks[order] = df.iloc[order].groupby("ts", sort=False).cumcount().to_numpy() + 1
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
    columns = heuristic_columns(df)
    heuristic = np.zeros(len(df))
    for c in columns:
        heuristic += pd.to_numeric(df[c], errors="coerce").fillna(0).to_numpy(dtype=np.float64)
    return {"random": np.random.default_rng(seed).random(len(df)), "heuristic": heuristic}


def heuristic_columns(frame: pd.DataFrame) -> list[str]:
    return [
        c
        for c in frame.columns
        if pd.api.types.is_numeric_dtype(frame[c]) and (c.startswith("xid_count") or ("ecc" in c and "increase" in c))
    ]


def evaluate_holdout(
    frame: Any,
    *,
    kind: str,
    horizon: DurationLike,
    test_days: float,
    top_k: int,
    train_window: DurationLike,
    params: dict[str, Any] | None = None,
    threshold: float | None = None,
    seed: int = SEED,
) -> dict[str, Any]:
    """Train on the `train_window` before the last `test_days` of settled grid times (with a
    `horizon` gap), score the test window, and compare the model with the baselines.

    The test window ends at `models.train.settled_until(frame, horizon)`: after it only
    failures are labelled, which would flatter every ranking, random included.

    `threshold`, if given, also reports episode recall at risk >= threshold (for the model and
    the baselines' raw scores alike, so mostly meaningful for the model)."""
    df = to_pandas(frame)
    require_columns(df, ["ts", "gpu_uuid", "label"], "evaluate_holdout")
    if not test_days > 0:
        raise InputError(f"test_days: expected a positive number of days, got {test_days!r}")
    gap = as_timedelta(horizon, "horizon")
    last = settled_until(df, gap)
    ts = pd.to_datetime(df["ts"])
    ts = ts.dt.tz_localize("UTC") if ts.dt.tz is None else ts.dt.tz_convert("UTC")
    times = ts.drop_duplicates().sort_values()
    step = times.diff().min() if len(times) > 1 else pd.Timedelta(hours=1)
    test_start = last - pd.Timedelta(days=test_days) + step
    model = train_model(df, kind=kind, train_window=train_window, horizon=gap, as_of=test_start, params=params)
    _, test = time_split(df, test_start, gap, test_end=last + step)
    test = test.loc[labels(test).notna().to_numpy()]
    y = labels(test).to_numpy(dtype=int)
    if len(test) == 0:
        raise InputError(f"evaluate_holdout: no labelled rows from {test_start}; expected a test window")
    scores = {"model": model.predict_risk(test), **baseline_scores(test, seed)}
    results = {name: score_metrics(test, s, k=top_k, threshold=threshold, seed=seed) for name, s in scores.items()}
    results["oracle"] = _precision(_prepared(test, y.astype(float)), top_k, seed)
    return {
        "kind": kind,
        "model_version": model.version,
        "horizon_h": gap / pd.Timedelta(hours=1),
        "top_k": top_k,
        "threshold": threshold,
        "train": {
            "start": model.train_start.isoformat(),
            "end": model.train_end.isoformat(),
            "n_rows": model.n_rows,
            "n_positives": model.n_positives,
            "params": model.params,
        },
        "test": {
            "start": test_start.isoformat(),
            "end": last.isoformat(),
            "n_rows": len(test),
            "n_positives": int(y.sum()),
            "n_gpus": int(test["gpu_uuid"].nunique()),
        },
        "heuristic_columns": heuristic_columns(test),
        "scores": results,
        "versions": model.versions,
    }


def _num(value: Any) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value


_TABLE_COLUMNS = [
    ("precision@K mean", "precision_at_k_mean"),
    ("precision@K pooled", "precision_at_k_pooled"),
    ("episodes caught", "recall_at_k"),
    ("median lead h", "lead_time_h_median_at_k"),
    ("PR-AUC", "pr_auc"),
    ("ROC-AUC", "roc_auc"),
]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def render_report(metrics: dict[str, Any]) -> str:
    """A short Markdown summary of `evaluate_holdout`'s result."""
    train, test = metrics["train"], metrics["test"]
    lines = [
        f"# Hold-out evaluation: {metrics['kind']} ({metrics['model_version']})",
        "",
        f"- Train: {train['start']} .. {train['end']}, {train['n_rows']} rows, {train['n_positives']} positives",
        f"- Test: {test['start']} .. {test['end']}, {test['n_rows']} rows, {test['n_positives']} positives, "
        f"{test['n_gpus']} GPUs",
        f"- Horizon {metrics['horizon_h']:g} h (also the gap between train and test), K = {metrics['top_k']}",
        "",
        "| scorer | " + " | ".join(name for name, _ in _TABLE_COLUMNS) + " |",
        "| --- | " + " | ".join("---" for _ in _TABLE_COLUMNS) + " |",
    ]
    for scorer, values in metrics["scores"].items():
        lines.append(f"| {scorer} | " + " | ".join(_cell(values.get(key)) for _, key in _TABLE_COLUMNS) + " |")
    lines += [
        "",
        "precision@K mean: mean over grid times of the share of failing GPUs among the K",
        "highest-ranked (grid times without failures count as 0); pooled: over all picks.",
        "Episodes caught: failures whose GPU was in the top K at least once within the horizon",
        "before failing; lead time from that first catch. `oracle` ranks by the label itself.",
        f"Heuristic baseline columns: {', '.join(metrics.get('heuristic_columns') or []) or 'none (all zeros)'}.",
        "",
    ]
    return "\n".join(lines)


def write_report(metrics: dict[str, Any], out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write `metrics.json` and `report.md` into `out_dir` (created if needed), each atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in [
        ("metrics.json", json.dumps(metrics, indent=2, default=str) + "\n"),
        ("report.md", render_report(metrics)),
    ]:
        final = out / name
        tmp = out / f".tmp-{uuid.uuid4().hex}-{name}"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, final)
        written.append(final)
    return written[0], written[1]
