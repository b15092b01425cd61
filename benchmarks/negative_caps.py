"""How many healthy rows a retrain needs: train on a store's window at several caps on the
negatives per positive, score the days after it, compare.

    python -m benchmarks.negative_caps --data DATA --as-of 2026-01-30T00:00Z --test-days 3 \
        --caps 20 33 none --threads 2

Each fit is `train_model_from_store` (the retrain `gpufail train` and the nightly job run),
trained to `as_of` minus the horizon; the test rows are the labelled rows of the `test_days`
from `as_of` on, which no fit has seen. Reported per cap: the negative share drawn, the rows,
seconds to read and fit, average precision over the test rows and the mean over test hours
of the precision of the top `top` GPUs. The default of `[model]
max_negatives_per_positive` was chosen from this on the 30-day paper store (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import polars as pl

from features.dataset import read_features
from ingest.store import Store
from models.split import as_utc
from models.train import TrainOptions
from models.train_store import train_model_from_store

PRODUCT_MONOTONE = ("ecc_dbe_*_increase_*", "remapped_rows_*_increase_*")
"""`[model] monotone_increasing`'s default, so the fits are the product's."""


def hourly_precision_at(ts: pl.Series, risk: np.ndarray, label: np.ndarray, top: int) -> float:
    """Mean over grid times of the share of failing rows among the `top` riskiest."""
    frame = pl.DataFrame({"ts": ts, "risk": risk, "y": label})
    ranked = frame.with_columns(rank=pl.col("risk").rank("ordinal", descending=True).over("ts"))
    per_hour = ranked.filter(pl.col("rank") <= top).group_by("ts").agg(pl.col("y").mean())["y"]
    return float(per_hour.to_numpy().mean())


def compare_caps(
    store: Store,
    *,
    as_of: str,
    test_days: int,
    caps: list[float | None],
    negative_fraction: float = 0.1,
    train_window: str = "21d",
    horizon: str = "24h",
    threads: int = 1,
    top: int = 30,
    monotone_increasing: Sequence[str] = (),
) -> list[dict[str, Any]]:
    from sklearn.metrics import average_precision_score

    start = as_utc(as_of).to_pydatetime()
    test = read_features(store, start=start, end=start + timedelta(days=test_days))
    test = test.filter(pl.col("label").is_not_null())
    label = test["label"].to_numpy()
    if test.height == 0 or label.sum() == 0:
        raise SystemExit(f"{store.root}: no labelled failing rows in the {test_days} days from {as_of}")
    results = []
    for cap in caps:
        began = time.perf_counter()
        model = train_model_from_store(
            store,
            TrainOptions(
                kind="lightgbm",
                train_window=train_window,
                horizon=horizon,
                as_of=as_of,
                params={"n_jobs": threads},
                negative_fraction=negative_fraction,
                max_negatives_per_positive=cap,
                monotone_increasing=monotone_increasing,
            ),
        )
        seconds = time.perf_counter() - began
        risk = model.predict_risk(test)
        results.append(
            {
                "max_negatives_per_positive": cap,
                "negative_fraction": round(model.negative_fraction, 5),
                "rows": model.n_rows,
                "positives": model.n_positives,
                "read_and_fit_s": round(seconds, 1),
                "average_precision": round(float(average_precision_score(label, risk)), 4),
                f"hourly_precision_top{top}": round(hourly_precision_at(test["ts"], risk, label, top), 4),
                "test_rows": test.height,
                "test_positives": int(label.sum()),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a store with a features dataset")
    parser.add_argument("--as-of", required=True, help="train before it, test from it (ISO time)")
    parser.add_argument("--test-days", type=int, default=3)
    parser.add_argument("--caps", nargs="+", default=["20", "none"], help="negatives per positive; 'none': no cap")
    parser.add_argument("--negative-fraction", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    caps = [None if c.lower() == "none" else float(c) for c in args.caps]
    compare_caps(
        Store.open(args.data),
        as_of=args.as_of,
        test_days=args.test_days,
        caps=caps,
        negative_fraction=args.negative_fraction,
        threads=args.threads,
        monotone_increasing=PRODUCT_MONOTONE,
    )


if __name__ == "__main__":
    main()
