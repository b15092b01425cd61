"""The examples/daily_table walk-through, command by command, as its README gives them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from examples.daily_table.make_table import write_table
from tests.cli import gpufail

EXAMPLE = Path(__file__).parents[1] / "examples" / "daily_table"


def test_a_daily_table_with_failure_records_goes_from_import_to_an_evaluated_backtest(tmp_path: Path) -> None:
    table = write_table(tmp_path / "work")
    root, model, report = tmp_path / "fleet", tmp_path / "model", tmp_path / "report"
    env = {"GPUFAIL_CONFIG": str(EXAMPLE / "gpufail.toml")}

    def run(*args: str) -> str:
        result = gpufail(*args, env=env)
        assert result.returncode == 0, f"gpufail {' '.join(args)}: {result.stderr}"
        return result.stdout

    imported = run("ingest", "table", str(table), "--map", str(EXAMPLE / "mapping.toml"), "--data", str(root))
    assert imported.startswith("table: 6,720 telemetry rows, 16 failures, 0 repairs")

    built = run("features", "--data", str(root), "--quiet")
    positives = int(re.search(r"\(([\d,]+) positive", built)[1].replace(",", ""))  # type: ignore[index]
    assert positives > 0 and f"{positives:,} positive from failure records" in built
    assert "warning" not in built
    assert run("features", "--data", str(root), "--quiet").startswith("features: up to date: 140 files cover")

    trained = run("train", "--data", str(root), "--model-out", str(model), "--until", "2026-02-19")
    assert re.search(r"to 2026-0[12]-\d\d", trained) and "2026-02-19" not in trained.split("calibrated")[0]

    scored = run("score", "--data", str(root), "--model", str(model), "--start", "2026-02-19", "--end", "2026-03-05")
    assert scored.startswith("scored 14 grid times")

    run("evaluate", "--data", str(root), "--report", str(report), "--quiet")
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics["test"]["start"].startswith("2026-02-19")
    best = max(s["precision_at_k_pooled"] for name, s in metrics["scores"].items() if name not in ("random", "oracle"))
    assert best > metrics["scores"]["random"]["precision_at_k_pooled"]
