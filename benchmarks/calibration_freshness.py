"""What calibrating without ageing the model does on a held-out window, as the nightly judges a
retrain: train as of the start of the last `holdout_days` of settled labels, score them, and
compare the served model of two schemes.

    python -m benchmarks.calibration_freshness --data DATA --holdout-days 7

- `fresh` (the product's): trained on the whole window up to the held-out window, carrying the
  map fitted on its calibration slice as scored by the fit made as of the slice's start
  (`models.train_store.train_model_from_store`);
- `aged` (before): that fit itself, calibrated on its own scores on the slice, so a
  `calibration_window` + horizon older.

Reported per scheme: the model's age at the held-out window's start, average precision, ECE,
mean risk against the observed rate, the rows at risk >= 0.5 (`high_risk_check`) and how many
rows share the top risk (`top_risk_ties`). The configuration's `[model]` settings are used.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import numpy as np
import pandas as pd
from sklearn.metrics import average_precision_score

from features.dataset import read_features
from gpufail.config import load_settings
from ingest.store import Store
from models.calibration import calibration_summary, high_risk_check, top_risk_ties
from models.train import TrainedModel, calibration_bounds, calibration_fit_options
from models.train_store import calibrated_from_store, store_settled_until, train_model_from_store, with_store_spec


def figures(model: TrainedModel, held: Any, start: Any) -> dict[str, Any]:
    y = held["label"].to_numpy(dtype=float)
    risk = model.predict_risk(held)
    gpus = pd.factorize(held["gpu_uuid"])[0]
    figures = calibration_summary(y, risk)
    return {
        "train_end": model.train_end.isoformat(),
        "age_h": (start - model.train_end) / timedelta(hours=1),
        "average_precision": float(average_precision_score(y, risk)),
        "ece": figures["ece"],
        "mean_risk": figures["mean_risk"],
        "observed_rate": figures["observed_rate"],
        "high_risk": high_risk_check(y, risk, groups=gpus),
        "top_ties": top_risk_ties(risk),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--holdout-days", type=float, default=7.0)
    parser.add_argument("--config", default=None)
    args = parser.parse_args(argv)
    store = Store.open(args.data)
    options = with_store_spec(store, load_settings(args.config).train_options())
    spec = options.carried_spec()
    settled = store_settled_until(store, options.horizon)
    start = settled - timedelta(days=args.holdout_days) + spec.grid
    options = replace(options, as_of=start)
    fresh = train_model_from_store(store, options)
    aged_fit = train_model_from_store(store, calibration_fit_options(options, calibration_bounds(settled, options)[0]))
    # The aged fit calibrated on its own scores: the scoring fit and the served fit are one.
    aged = calibrated_from_store(store, options, lambda *_: aged_fit)
    held = read_features(store, start=start.to_pydatetime(), end=(settled + spec.grid).to_pydatetime()).to_pandas()
    held = held[held["label"].notna()]
    out = {
        "holdout": [start.isoformat(), settled.isoformat()],
        "rows": len(held),
        "positives": int(np.sum(held["label"] == 1)),
        "aged": figures(aged, held, start),
        "fresh": figures(fresh, held, start),
    }
    print(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
