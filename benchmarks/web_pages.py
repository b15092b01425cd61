"""Benchmark of the operator's pages (`serving.web`) on a large synthetic fleet.

    python -m benchmarks.web_pages [--gpus 30000] [--days 28] [--repeat 20] [--json FILE]

Builds, in a temporary store:

- the serving snapshot of a fleet of `--gpus` GPUs (8 per node, two clusters): window features
  built by `features.build.build_features` from synthetic telemetry of 64 GPUs, copied under
  new names with jitter up to the fleet's size, scored and explained by a LightGBM trained on
  them (`serving.api_state.score_fleet`, what `gpufail serve` does at each reload);
- `--days` daily predictions snapshots of every GPU, failure XIDs on a few GPUs a day, a
  publish audit with one decision per node and day, and a publish state;

then starts the app in process (Starlette's test client: the server's work, routing,
rendering and response, without a socket), which scores the fleet and then warms the pages up
in the background (the alarm history, the at-risk table's first rows), waits for that, and
reports the time per page: the first request, and the median, 90th percentile and maximum of
`--repeat` more; and how long the start, the warm-up and the alarm history alone took.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

SEED_GPUS = 64
GPUS_PER_NODE = 8
TARGET_MS = 300.0
"""Issue 30: the fleet page of a 30,000-GPU fleet renders in under this on the server."""


def _tiers() -> Any:
    """The action policy of the default [publish] settings."""
    from gpufail.config import PublishSettings

    return PublishSettings().policy_config()


def seed_features(hours: int = 36, seed: int = 0) -> Any:
    """Window features of `SEED_GPUS` GPUs over `hours`, with a learnable label (hot GPUs fail)."""
    import polars as pl

    from features.build import build_features
    from features.spec import FeatureSpec
    from tests.synthetic import synthetic_telemetry, synthetic_xids

    start = datetime(2026, 3, 1, tzinfo=UTC)
    tel = synthetic_telemetry(SEED_GPUS, hours, interval=timedelta(minutes=5), start=start, seed=seed)
    events = synthetic_xids(tel, per_gpu_day=1.0, seed=seed).filter(pl.col("xid").is_in([13, 31, 43, 45, 63, 92]))
    features = build_features(tel, events, FeatureSpec(lost_after=None))
    rng = np.random.default_rng(seed)
    temp = features["temp_gpu_c_mean_1h"].fill_null(0).to_numpy()
    label = (temp > np.nanquantile(temp, 0.85)) | (rng.random(features.height) < 0.01)
    return features.with_columns(pl.Series("label", label.astype(np.int8)).cast(features.schema["label"]))


def train(features: Any) -> Any:
    from models.train import TrainOptions, train_model

    return train_model(
        features,
        TrainOptions(
            kind="lightgbm",
            train_window="1d",
            horizon="1h",
            params={"n_jobs": 1, "n_estimators": 30, "random_state": 0},
            negative_fraction=1.0,
        ),
    )


def fleet_rows(features: Any, n_gpus: int, seed: int = 0) -> Any:
    """The newest grid time of `features`, copied to `n_gpus` GPUs (new uuid, node, cluster)
    with each numeric value scaled by a random factor, so risks and explanations vary."""
    import polars as pl

    from features.schema import feature_columns

    newest = features.filter(pl.col("ts") == pl.col("ts").max()).sort("gpu_uuid")
    reps = -(-n_gpus // newest.height)
    big = pl.concat([newest] * reps).head(n_gpus)
    rng = np.random.default_rng(seed)
    i = np.arange(n_gpus)
    node = i // GPUS_PER_NODE
    numeric = [c for c in feature_columns(big) if big.schema[c].is_numeric()]
    factors = rng.lognormal(0.0, 0.15, (n_gpus, 1))
    return big.with_columns(
        pl.Series("gpu_uuid", [f"GPU-{k:08d}" for k in i]),
        pl.Series("node", [f"gpu-{'a' if n % 2 else 'b'}{n:05d}" for n in node]),
        pl.Series("cluster", ["east" if n % 2 else "west" for n in node]),
        pl.Series("gpu_index", (i % GPUS_PER_NODE).astype(np.int16)).cast(big.schema["gpu_index"]),
        *[(pl.col(c) * pl.Series(factors[:, 0])).cast(big.schema[c]) for c in numeric],
    )


def write_history(store: Any, snapshot: Any, days: int, seed: int = 0) -> None:
    """`days` daily predictions snapshots ending at the snapshot's day, failure XIDs, a publish
    audit (a decision per node and day) and a publish state."""
    import pandas as pd
    import pyarrow as pa

    from serving.policy import NodeState, PolicyState
    from serving.publish import AuditRow, append_audit, state_name
    from serving.score import prediction_table

    rng = np.random.default_rng(seed)
    fleet = snapshot.fleet
    base = pd.DataFrame(fleet.records)
    end = fleet.ts.to_pydatetime()
    nodes = list(fleet.nodes.values())
    failed_xids = []
    for d in range(days, 0, -1):
        ts = end - timedelta(days=d - 1)
        risk = np.clip(base["risk"].to_numpy() * rng.lognormal(0, 0.4, len(base)), 0, 1)
        day = base.assign(ts=pd.Timestamp(ts), risk=risk).sort_values("risk", ascending=False, ignore_index=True)
        day["rank"] = np.arange(1, len(day) + 1)
        day["model_kind"] = "lightgbm"
        store.write_owned("predictions", ts.date(), prediction_table(day))
        for g in base.sample(5, random_state=int(rng.integers(1 << 30))).itertuples():
            failed_xids.append((ts - timedelta(hours=3), g.cluster, g.node, g.gpu_uuid, int(g.gpu_index)))  # type: ignore[arg-type]
        rows = [
            AuditRow(
                time=ts + timedelta(minutes=10),
                cluster=n["cluster"],
                node=n["node"],
                gpus=(n["gpus"][0]["gpu_uuid"],),
                risk=n["node_risk"],
                previous_tier="none",
                tier="none",
                action="keep" if k > 3 else ("raise", "breaker_held", "skip", "lower")[k],
                reason=f"node risk {n['node_risk']:.3f}",
                top_features=("temp_gpu_c_mean_1h", "ecc_sbe_volatile_total_rate_24h"),
                model_version=snapshot.served.version,
                target="slurm",
                mode="live",
                dry_run=False,
                result="unchanged",
            )
            for k, n in enumerate(nodes)
        ]
        append_audit(rows, store.path("actions"), fs=store.fs)
    xids = pa.table(
        {
            "ts": [t for t, *_ in failed_xids],
            "last_ts": [t + timedelta(minutes=1) for t, *_ in failed_xids],
            "cluster": [c for _, c, *_ in failed_xids],
            "node": [n for _, _, n, *_ in failed_xids],
            "pci_bus_id": ["0000:18:00.0"] * len(failed_xids),
            "gpu_index": [i for *_, i in failed_xids],
            "gpu_uuid": [u for *_, u, _ in failed_xids],
            "xid": [79] * len(failed_xids),
            "pid": pa.nulls(len(failed_xids), pa.int64()),
            "process": pa.nulls(len(failed_xids), pa.string()),
            "message": ["GPU has fallen off the bus."] * len(failed_xids),
            "source": ["kmsg"] * len(failed_xids),
            "repeat_count": [1] * len(failed_xids),
        }
    )
    store.write("xid_events", xids)
    acting = {
        f"{n['cluster']}/{n['node']}": NodeState(tier="avoid", since=end, changed_at=end, applied="avoid")
        for n in nodes[:40]
    }
    store.write_state(state_name("slurm", "live"), PolicyState(nodes=acting).to_json())


def build(root: Path, n_gpus: int, days: int) -> tuple[Any, float]:
    """The app over a store at `root` whose model and features sources give a synthetic fleet
    of `n_gpus` GPUs (scored when the app starts, as `gpufail serve` does), and the seconds one
    scoring and explaining of the fleet took (to write the history, which needs the risks)."""
    from ingest.store import Store
    from serving.api import create_app
    from serving.api_state import LatestFeatures, ServedModel, ServeOptions, Snapshot, score_fleet

    features = seed_features()
    model = train(features)
    rows = fleet_rows(features, n_gpus).to_pandas()
    options = ServeOptions(data_root=str(root), tiers=_tiers(), features_max_age_s=0)
    began = time.perf_counter()
    fleet = score_fleet(model, rows, options.tiers, options.max_top_features)
    scoring_s = time.perf_counter() - began
    served = ServedModel(model, "bench", {"source": "path", "path": "bench", "metrics": None}, datetime.now(UTC))
    latest = LatestFeatures(rows, "bench", fleet.ts)
    store = Store.create(str(root))
    write_history(store, Snapshot(served, latest, fleet), days)

    class Fixed:
        """A model or features source that always has the same one (nothing to reload), from
        the data root (which messages name)."""

        def __init__(self, value: Any) -> None:
            self.value = value
            self.root = str(root)  # the data root the app names in its messages

        def fingerprint(self) -> str:
            return "bench"

        def load(self) -> Any:
            return self.value

    return create_app(options, Fixed(served), features=Fixed(latest), start_polling=False), scoring_s  # type: ignore[arg-type]


def time_history(app: Any, days: int) -> float:
    """Seconds `serving.web.history.daily_counts` takes over the app's store (the alarm history,
    computed at start and when a predictions or XID file arrives, in the background)."""
    from ingest.store import Store
    from serving.web import history

    state = app.state.serving
    store = Store.open(state.options.data_root)
    last = history.last_data_day(store, state.snapshot.fleet.ts.date())
    began = time.perf_counter()
    history.daily_counts(store, state.options.tiers, (79,), last, days)
    return time.perf_counter() - began


def time_pages(client: Any, pages: dict[str, str], repeat: int) -> dict[str, dict[str, float]]:
    out = {}
    for name, url in pages.items():
        began = time.perf_counter()
        first = client.get(url)
        first_ms = (time.perf_counter() - began) * 1000
        if first.status_code != 200:
            raise RuntimeError(f"{url}: {first.status_code} {first.text[:300]}")
        times = []
        for _ in range(repeat):
            began = time.perf_counter()
            r = client.get(url)
            times.append((time.perf_counter() - began) * 1000)
            assert r.status_code == 200
        ordered = sorted(times)
        out[name] = {
            "first_ms": first_ms,
            "median_ms": statistics.median(times),
            "p90_ms": ordered[max(0, int(len(ordered) * 0.9) - 1)],
            "max_ms": ordered[-1],
            "bytes": len(first.content),
        }
    return out


def _warm_ups() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpufail-web-warm-up"]


def run(n_gpus: int, days: int, repeat: int) -> dict[str, Any]:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using `httpx`")  # starlette's note about httpx versions
        from starlette.testclient import TestClient

    with tempfile.TemporaryDirectory(prefix="gpufail-web-bench-") as tmp:
        app, scoring_s = build(Path(tmp) / "data", n_gpus, days)
        began = time.perf_counter()
        with TestClient(app) as client:  # starts the app: scores the fleet, then warms the pages up
            ready_s = time.perf_counter() - began
            for thread in _warm_ups():
                thread.join()
            warm_s = time.perf_counter() - began - ready_s
            fleet = app.state.serving.snapshot.fleet
            riskiest = fleet.records[0]
            pages = {
                "fleet": "/",
                "fleet_filtered": "/?q=gpu-a000&tier=watch",
                "fleet_sorted_by_node": "/?sort=node&limit=5000",
                "node": f"/nodes/{riskiest['node']}?cluster={riskiest['cluster']}",
                "actions": "/actions",
            }
            timings = time_pages(client, pages, repeat)
            history_s = time_history(app, days)
    return {
        "gpus": n_gpus,
        "nodes": len(fleet.nodes),
        "days": days,
        "scoring_s": scoring_s,
        "ready_s": ready_s,
        "warm_up_s": warm_s,
        "history_s": history_s,
        "pages": timings,
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"operator pages, {result['gpus']:,} GPUs ({result['nodes']:,} nodes), {result['days']} days of history",
        f"app ready (fleet scored and explained) in {result['ready_s']:.1f} s; warm-up after it (alarm history, "
        f"first rows) {result['warm_up_s']:.2f} s; the alarm history alone {result['history_s'] * 1000:.0f} ms",
        f"{'page':<22} {'first ms':>9} {'median ms':>10} {'p90 ms':>8} {'max ms':>8} {'KB':>7}",
    ]
    for name, t in result["pages"].items():
        lines.append(
            f"{name:<22} {t['first_ms']:>9.0f} {t['median_ms']:>10.1f} {t['p90_ms']:>8.1f} {t['max_ms']:>8.1f} "
            f"{t['bytes'] / 1024:>7.0f}"
        )
    fleet = result["pages"]["fleet"]["median_ms"]
    verdict = "meets" if fleet < TARGET_MS else "MISSES"
    lines.append(f"fleet page median {fleet:.0f} ms: {verdict} the {TARGET_MS:.0f} ms target")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=30_000)
    parser.add_argument("--days", type=int, default=28)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    args = parser.parse_args(argv)
    if args.gpus < GPUS_PER_NODE or args.days < 1 or args.repeat < 1:
        parser.error("expected --gpus >= 8, --days >= 1 and --repeat >= 1")
    result = run(args.gpus, args.days, args.repeat)
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
