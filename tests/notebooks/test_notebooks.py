"""The exploratory notebooks (`notebooks/*.ipynb`): committed without outputs, each opening
with the question it answers, and each executed from top to bottom against a small simulated
store (built once per session through the real CLI), within a time budget."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from ingest.simulator.run import simulate
from ingest.store import Store
from tests.cli import gpufail, gpufail_env

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = ["01_fleet_and_telemetry", "02_failure_precursors", "03_models", "04_actions"]
PROJECT_PACKAGES = ("ingest", "features", "models", "serving", "gpufail")

NOTEBOOK_BUDGET_S = 300
"""Seconds one notebook may take on the small store (about 30-90 s on 2 idle cores; the
machines CI shares are slower)."""
CELL_TIMEOUT_S = 240

# Small enough to build in well under a minute, large enough that every training window of
# the walk-forward holds failures: 8 nodes (~70 GPUs) for 16 days at 30-minute samples, with
# failures accelerated so that ~30 happen.
FLEET = {"nodes": 8, "days": 16, "sample_interval_s": 1800, "acceleration": 100.0}
# What keeps the walk-forwards (the report's and the notebooks' own) short: a 2-day test period,
# 7-day windows, two contenders, few trees, few bootstrap draws, one process.
CONFIG = """
[model]
train_window = "7d"

[nightly]
params = { n_estimators = 30 }

[evaluate]
test_days = 2.0
train_window = "7d"
negative_fraction = 0.2
bootstrap_samples = 50
jobs = 1

[[evaluate.contenders]]
name = "lightgbm static"
kind = "lightgbm"
mode = "static"
params = { n_estimators = 30 }

[[evaluate.contenders]]
name = "lightgbm sliding"
kind = "lightgbm"
mode = "sliding"
params = { n_estimators = 30 }

"""


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def test_the_four_notebooks_are_there():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs_or_execution_counts(path):
    notebook = _read(path)
    nbformat.validate(notebook)
    for i, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [], f"{path.name} cell {i}: has outputs; clear them before committing"
        assert cell.execution_count is None, f"{path.name} cell {i}: has an execution count; clear it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_opens_with_the_question_and_imports_the_project(path):
    notebook = _read(path)
    first = notebook.cells[0]
    assert first.cell_type == "markdown" and "**Question:" in first.source, (
        f"{path.name}: the first cell must be markdown saying what question the notebook answers"
    )
    code = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    assert any(f"from {p}." in code for p in PROJECT_PACKAGES), f"{path.name}: imports none of the project's packages"
    assert "GPUFAIL_DATA" not in code, f"{path.name}: the data root comes from [store] root (GPUFAIL_STORE__ROOT)"


@pytest.fixture(scope="session")
def small_store(tmp_path_factory) -> tuple[Path, Path]:
    """A simulated fleet taken through the demo pipeline with the real CLI (in this process):
    kernel logs ingested, features, the walk-forward report, a model, its scores and a
    dry-run publish. Returns (data root, config file)."""
    base = tmp_path_factory.mktemp("notebooks")
    data, config = base / "fleet", base / "gpufail.toml"
    config.write_text(CONFIG)
    simulate(data, "demo", seed=3, progress=False, **FLEET)
    steps = [
        ["ingest", "kernel-log"],
        ["features", "--quiet"],
        ["evaluate", "--report", str(data / "out" / "report"), "--quiet"],
        ["train", "--model-out", str(data / "out" / "model")],
        ["score", "--model", str(data / "out" / "model")],
        ["publish", "--to", "log", "--dry-run"],
    ]
    for step in steps:
        result = gpufail("--config", str(config), *step, "--data", str(data))
        assert result.returncode == 0, f"gpufail {' '.join(step)}: {result.stderr}"
    return data, config


def _execute(notebook: nbformat.NotebookNode, data: Path, config: Path | None) -> None:
    """Run `notebook` in a fresh kernel of this interpreter, from the notebooks folder, with
    the data root and configuration in its environment (not in this process's)."""
    env = gpufail_env()
    env["GPUFAIL_STORE__ROOT"] = str(data)
    if config is not None:
        env["GPUFAIL_CONFIG"] = str(config)
    # Inline figures, whatever backend the caller's environment names.
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute(env=env)


def _images(notebook: nbformat.NotebookNode) -> list[bytes]:
    return [
        base64.b64decode(output["data"]["image/png"])
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if "image/png" in output.get("data", {})
    ]


@pytest.mark.slow
@pytest.mark.timeout(NOTEBOOK_BUDGET_S + 60)  # the first test also pays for building the store
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_on_a_small_store_within_its_budget(path, small_store):
    data, config = small_store
    notebook = _read(path)
    started = time.monotonic()
    _execute(notebook, data, config)
    elapsed = time.monotonic() - started
    assert elapsed < NOTEBOOK_BUDGET_S, f"{path.name} took {elapsed:.0f} s, over its budget of {NOTEBOOK_BUDGET_S} s"
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o["output_type"] == "error"]
    assert not errors
    images = _images(notebook)
    assert len(images) >= 3, f"{path.name}: expected at least 3 plots, got {len(images)}"
    assert all(image.startswith(b"\x89PNG") for image in images)


@pytest.mark.slow
def test_models_notebook_without_a_report_says_what_to_run(tmp_path):
    # Only the set-up cells: the report is looked for before anything is computed.
    notebook = _read(NOTEBOOK_DIR / "03_models.ipynb")
    code = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code"]
    notebook.cells = notebook.cells[: code[0] + 1]
    data = tmp_path / "empty"
    Store.create(str(data))
    with pytest.raises(CellExecutionError) as raised:
        _execute(notebook, data, None)
    assert "metrics.json: not found; run `gpufail evaluate --data" in str(raised.value)
