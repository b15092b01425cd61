"""The promotion gate: whether a newly trained model (the challenger) replaces the one serving
(the champion), judged on the same, most recent held-out window.

`holdout_metrics` scores a model on that window (precision@K, episode recall, row metrics, with
the random and heuristic baselines), and `holdout_metrics_of` several in one pass, also over a
window that comes in parts of whole GPUs; `write_holdout_report` writes those figures for people.
`gate` is a pure function of two models' metrics: the challenger replaces the champion only if
its precision@K beats the champion's by a margin and its episode recall is not lower by more
than a tolerance; a registry with no champion takes the first model that reaches an absolute
precision floor. `promote_if_better` applies it through the registry (`models.registry`): it
moves the `champion` alias and records the decision and its reason with the model version.
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ingest.errors import InputError
from models.evaluate import heuristic_scores, random_scores, score_metrics
from models.frame import labels, to_pandas
from models.registry import CHALLENGER, CHAMPION, Registry, RegistryError, load_version, unreachable
from models.train import TrainedModel, write_file_atomic

GATE_TAG = "gpufail.gate"
REASON_TAG = "gpufail.gate_reason"


# -- evaluation on the held-out window ---------------------------------------------------------


# Rows of a held-out window converted to pandas and scored at once. The paper fleet's 3-day
# window is 2.3M rows x 420 feature columns (4 GB in polars, and as much again in pandas); a
# chunk of this size is ~0.5 GB.
HOLDOUT_ROWS_PER_CHUNK = 300_000
# A chunk is scored on every core, where a model trains on one thread (`[model] threads`): a
# held-out window is millions of rows, each scored on its own, so the scores are the same.
HOLDOUT_SCORING_THREADS = -1
_ROW = "_holdout_row"


def holdout_metrics(model: TrainedModel, holdout: Any, top_k: int) -> dict[str, Any]:
    """`model`'s precision@K, episode recall and row metrics on the labelled rows of `holdout`,
    with the random and heuristic baselines on the same rows.

    A polars `holdout` (a DataFrame, or a LazyFrame read a piece at a time) is scored a few grid
    times at a time (`_grid_time_chunks`), keeping only the keys and scores of each chunk; the
    metrics see the rows in `holdout`'s order, so they equal scoring the whole frame at once."""
    return holdout_metrics_of({"model": model}, holdout, top_k)


def holdout_metrics_of(
    models: Mapping[str, TrainedModel], holdout: Any, top_k: int, *, in_gpu_parts: bool = False
) -> dict[str, Any]:
    """`holdout_metrics` of each of `models` in one pass over `holdout`: {name: metrics, ...,
    "random": ..., "heuristic": ...}.

    With `in_gpu_parts`, `holdout` is polars frames of whole GPUs in any order (what
    `features.on_demand.iter_features_on_demand` yields), so that a window computed on demand
    is never held whole: each part is scored `HOLDOUT_ROWS_PER_CHUNK` rows at a time, and the
    scored rows are put in (ts, gpu_uuid) order, the order `features.dataset.read_features`
    gives the same rows. A model whose score of a row depends on the other GPUs of its grid
    time (`TrainedModel.scores_each_row_alone`) cannot be scored that way."""
    if in_gpu_parts:
        together = [name for name, model in models.items() if not model.scores_each_row_alone]
        if together:
            raise ValueError(
                f"{together}: these models rank the GPUs of a grid time together; expected whole grid times"
            )
        pieces: Iterable[Any] = (piece for part in holdout for piece in part.iter_slices(HOLDOUT_ROWS_PER_CHUNK))
    else:
        pieces = _grid_time_chunks(holdout, HOLDOUT_ROWS_PER_CHUNK)
    keys: list[pd.DataFrame] = []
    model_scores: dict[str, list[np.ndarray]] = {name: [] for name in models}
    heuristic: list[np.ndarray] = []
    order: list[np.ndarray] = []
    placed = 0
    for chunk in pieces:
        df = to_pandas(chunk)
        df = df.loc[labels(df).notna().to_numpy()]
        # Where each row goes: its place in a DataFrame, else the order the pieces come in.
        order.append(df.pop(_ROW).to_numpy() if _ROW in df.columns else np.arange(placed, placed + len(df)))
        placed += len(df)
        for name, model in models.items():
            risk = model.predict_risk(df, threads=HOLDOUT_SCORING_THREADS)
            model_scores[name].append(np.asarray(risk, dtype=np.float64))
        heuristic.append(heuristic_scores(df))
        keys.append(df[[c for c in _METRIC_KEYS if c in df.columns]].reset_index(drop=True))
    if not keys:
        raise InputError("held-out window: no rows to score; expected the features of its grid times")
    df = pd.concat(keys, ignore_index=True)
    if in_gpu_parts:
        rows = df.sort_values(["ts", "gpu_uuid"], kind="stable").index.to_numpy()
    else:
        rows = np.argsort(np.concatenate(order), kind="stable")
    df = df.iloc[rows].reset_index(drop=True)
    scores = {name: np.concatenate(parts)[rows] for name, parts in model_scores.items()}
    scores |= {"random": random_scores(len(df)), "heuristic": np.concatenate(heuristic)[rows]}
    return {name: score_metrics(df, s, k=top_k) for name, s in scores.items()}


# What the metrics read of a scored frame (models.evaluate._prepared).
_METRIC_KEYS = ("ts", "gpu_uuid", "label", "time_to_failure_h")


def _grid_time_chunks(frame: Any, rows: int) -> Iterable[Any]:
    """`frame` in pieces of about `rows` rows, each holding whole grid times (the ensembles rank
    the GPUs of a grid time against each other).

    A DataFrame's rows are numbered by their place in it (column `_ROW`). A LazyFrame
    (`features.dataset.scan_features`) is read a piece at a time, each piece in (ts, gpu_uuid)
    order: the order `read_features` gives the same rows. A pandas frame is already in memory
    and comes whole."""
    import polars as pl

    lazy = isinstance(frame, pl.LazyFrame)
    if not (lazy or isinstance(frame, pl.DataFrame)) or "ts" not in frame.collect_schema().names():
        yield frame
        return
    if not lazy and frame.height <= rows:
        yield frame
        return
    if not lazy:
        frame = frame.with_row_index(_ROW)
    per_time = frame.group_by("ts").len().sort("ts")
    per_time = per_time.collect() if isinstance(per_time, pl.LazyFrame) else per_time
    if per_time.height == 0:
        yield frame.collect() if lazy else frame
        return
    piece = (per_time["len"].cum_sum() - per_time["len"]) // rows
    for times in per_time.with_columns(piece=piece).partition_by("piece", maintain_order=True):
        chunk = frame.filter(pl.col("ts").is_between(times["ts"][0], times["ts"][-1]))
        yield chunk.sort("ts", "gpu_uuid").collect() if lazy else chunk


def write_holdout_report(metrics: dict[str, Any], out_dir: Path, *, title: str) -> list[Path]:
    """`metrics.json`, `report.md` and `precision.png` (precision@K of each ranking) into
    `out_dir`, each written to a temporary name and renamed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = ["| ranking | precision@K | episodes caught | recall | PR-AUC |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, m in metrics.items():
        if not isinstance(m, dict) or "precision_at_k_mean" not in m:
            continue
        rows.append(
            f"| {name} | {m['precision_at_k_mean']:.3f} | {m.get('n_caught_at_k', 0)} of {m.get('n_episodes', 0)} "
            f"| {_fmt(m.get('recall_at_k'))} | {_fmt(m.get('pr_auc'))} |"
        )
    text = f"# {title}\n\n" + "\n".join(rows) + "\n"
    written = []
    for name, data in [
        ("metrics.json", json.dumps(metrics, indent=2, default=str).encode()),
        ("report.md", text.encode()),
    ]:
        written.append(write_file_atomic(out_dir / name, data))
    names = [n for n, m in metrics.items() if isinstance(m, dict) and "precision_at_k_mean" in m]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(names, [metrics[n]["precision_at_k_mean"] for n in names], color="#4878a8")
    ax.set_ylabel("precision@K (mean over grid times)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=80)
    plt.close(fig)
    written.append(write_file_atomic(out_dir / "precision.png", png.getvalue()))
    return written


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{float(value):.3f}"


# -- the promotion gate ------------------------------------------------------------------------


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    reason: str
    challenger: dict[str, Any]
    champion: dict[str, Any] | None
    champion_version: str | None = None


def _headline(metrics: dict[str, Any]) -> tuple[float, float | None]:
    precision = float(metrics.get("precision_at_k_mean") or 0.0)
    recall = metrics.get("recall_at_k")
    return precision, None if recall is None else float(recall)


_SUMMARY_KEYS = ("precision_at_k_mean", "precision_at_k_pooled", "recall_at_k", "n_episodes", "n_caught_at_k", "pr_auc")


def _window(holdout: Any) -> Any:
    """`promote_if_better`'s held-out window, called for when it is a function."""
    return holdout() if callable(holdout) else holdout


def _summary(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics a decision is recorded with (a tag holds at most 5000 characters)."""
    return {key: metrics.get(key) for key in _SUMMARY_KEYS}


def gate(
    challenger: dict[str, Any],
    champion: dict[str, Any] | None,
    *,
    margin: float,
    recall_tolerance: float,
    floor: float,
) -> tuple[bool, str]:
    """Whether the challenger replaces the champion, and why, from their metrics on the same
    held-out window (`score_metrics` dicts).

    Without a champion: promote when precision@K >= `floor`. With one: promote when precision@K
    >= the champion's + `margin` and recall >= the champion's - `recall_tolerance`."""
    p, r = _headline(challenger)
    if champion is None:
        if p + 1e-9 >= floor:
            return True, f"no champion yet; precision@K {p:.3f} reaches the floor {floor:.3f}"
        return False, f"no champion yet, but precision@K {p:.3f} is below the floor {floor:.3f}"
    if int(challenger.get("n_episodes") or 0) == 0:
        return False, "the held-out window has no failure episodes: nothing to compare on, the champion stays"
    cp, cr = _headline(champion)
    # The epsilon keeps 0.28 + 0.02 from exceeding 0.30 in binary floating point.
    if p + 1e-9 < cp + margin:
        return False, f"precision@K {p:.3f} does not beat the champion's {cp:.3f} by the margin {margin:.3f}"
    if r is not None and cr is not None and r + 1e-9 < cr - recall_tolerance:
        return False, (
            f"precision@K {p:.3f} beats the champion's {cp:.3f}, but recall {r:.3f} is below the champion's "
            f"{cr:.3f} by more than the tolerance {recall_tolerance:.3f}"
        )
    return True, f"precision@K {p:.3f} beats the champion's {cp:.3f} by at least {margin:.3f}" + (
        f"; recall {r:.3f} vs {cr:.3f}" if r is not None and cr is not None else ""
    )


def promote_if_better(
    registry: Registry,
    version: str,
    holdout: Any,
    *,
    top_k: int,
    margin: float,
    recall_tolerance: float,
    floor: float,
    challenger_model: TrainedModel | None = None,
    challenger_metrics: dict[str, Any] | None = None,
    champion_metrics: tuple[str, dict[str, Any]] | None = None,
) -> GateDecision:
    """Compare registered `version` with the champion on `holdout` (the most recent held-out
    window), move the `champion` alias to it if `gate` says so, and record the decision and its
    reason as tags of the version and of its run. A version already decided is not re-judged.

    `challenger_metrics`: the version's `holdout_metrics(...)["model"]` on this same window and
    K when the caller has them (the nightly job's evaluation step): scoring it again cost the
    paper fleet's nightly 38 s. `champion_metrics`: (version, its metrics) likewise, used when
    that version is still the champion. `holdout` may be a function that returns the window,
    called only when a model is scored here."""
    mv = registry.call("read the model version", registry.client.get_model_version, registry.name, version)
    if GATE_TAG in (mv.tags or {}):
        recorded = json.loads(mv.tags[GATE_TAG])
        return GateDecision(**recorded)
    champion_mv = registry.alias_version(CHAMPION)
    if champion_mv is not None and str(champion_mv.version) == version:
        return GateDecision(False, f"version {version} is already the champion", {}, None, version)
    if challenger_metrics is not None:
        mine = challenger_metrics
    else:
        challenger = challenger_model or load_version(registry, version)
        mine = holdout_metrics(challenger, _window(holdout), top_k)["model"]
    theirs = None
    if champion_mv is not None and champion_metrics is not None and champion_metrics[0] == str(champion_mv.version):
        theirs = champion_metrics[1]
    elif champion_mv is not None:
        try:
            theirs = holdout_metrics(load_version(registry, str(champion_mv.version)), _window(holdout), top_k)["model"]
        except RegistryError as exc:
            if unreachable(exc.__cause__ or exc):
                raise
            # A champion that no longer loads (corrupt artifact, incompatible pickle) cannot
            # serve; any challenger that reaches the floor is better than it.
            theirs = None
            warnings.warn(
                f"champion version {champion_mv.version} cannot be loaded ({exc}); judging against the floor",
                RuntimeWarning,
                stacklevel=2,
            )
    promote, reason = gate(mine, theirs, margin=margin, recall_tolerance=recall_tolerance, floor=floor)
    decision = GateDecision(
        promote,
        reason,
        _summary(mine),
        None if theirs is None else _summary(theirs),
        None if champion_mv is None else str(champion_mv.version),
    )
    if promote:
        registry.call(
            "set the champion alias", registry.client.set_registered_model_alias, registry.name, CHAMPION, version
        )
        challenger_alias = registry.alias_version(CHALLENGER)
        if challenger_alias is not None and str(challenger_alias.version) == version:
            registry.call(
                "clear the challenger alias", registry.client.delete_registered_model_alias, registry.name, CHALLENGER
            )
    record = json.dumps(asdict(decision), default=str)
    registry.call(
        "record the decision", registry.client.set_model_version_tag, registry.name, version, GATE_TAG, record
    )
    registry.call("record the reason", registry.client.set_tag, mv.run_id, REASON_TAG, reason)
    return decision
