"""The optional dependency groups: each role's commands import nothing outside its own install
(checked by running them with every other installed distribution refused at import), and the
Makefile, CI and the Dockerfile install from the one lock."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from tests.cli import GPUFAIL, gpufail_env
from tests.deploy.installs import as_installed, closure

ROOT = Path(__file__).parents[2]
XID_LINE = "2026-01-01T00:00:00+00:00 gpu-node-017 kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=python3, GPU has fallen off the bus.\n"


def run(cmd, env, **kwargs):
    base = {k: v for k, v in gpufail_env().items() if k != "PYTHONPATH"}
    return subprocess.run(cmd, env=base | env, capture_output=True, text=True, timeout=300, **kwargs)


def test_the_collect_install_holds_no_training_serving_or_dev_stack():
    collect = closure(["collect"])
    assert {"pyarrow", "pydantic", "click", "nvidia-ml-py", "prometheus-client"} <= collect
    for heavy in (
        "polars",
        "mlflow",
        "mlflow-skinny",
        "dask",
        "scikit-learn",
        "lightgbm",
        "pandas",
        "fastapi",
        "pytest",
        "ipykernel",
    ):
        assert heavy not in collect, heavy


def test_the_blocker_refuses_what_an_install_lacks(tmp_path):
    env = as_installed(["collect"], tmp_path / "site")
    refused = run([sys.executable, "-c", "import pandas"], env)
    assert refused.returncode == 1 and "No module named 'pandas' (not in this install)" in refused.stderr
    assert run([sys.executable, "-c", "import pyarrow.dataset, pynvml"], env).returncode == 0
    assert "No module named 'polars'" in run([sys.executable, "-c", "import polars"], env).stderr


def test_gpufail_help_and_collect_need_only_the_collect_extra(tmp_path):
    env = as_installed(["collect"], tmp_path / "site")
    helped = run([*GPUFAIL, "--help"], env)
    assert helped.returncode == 0 and "collect" in helped.stdout, helped.stderr
    log = tmp_path / "kern.log"
    log.write_text(XID_LINE)
    env |= {
        "GPUFAIL_COLLECT__KERNEL_LOG_SOURCE": "files",
        "GPUFAIL_COLLECT__KERNEL_LOG_PATHS": json.dumps([str(log)]),
        "GPUFAIL_COLLECT__NODE": "gpu-node-017",
        "GPUFAIL_COLLECT__DCGM_EXPORTER_URL": "http://127.0.0.1:9/metrics",  # nothing listens: a failed source
    }
    cmd = [*GPUFAIL, "collect", "--once", "--source", "kernel-log,nvml,dcgm-exporter", "--out", str(tmp_path / "d")]
    collected = run(cmd, env)
    assert "not in this install" not in collected.stdout + collected.stderr
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert "kernel-log 1 ok, 1 rows" in collected.stdout


def test_a_command_of_another_extra_names_it_in_one_line_in_a_collect_install(tmp_path):
    env = as_installed(["collect"], tmp_path / "site")
    data = tmp_path / "d"
    data.mkdir()
    done = run([*GPUFAIL, "train", "--data", str(data), "--model-out", str(tmp_path / "m")], env)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("gpufail: error: gpufail train needs the Python module ")
    assert done.stderr.rstrip().endswith("pip install 'gpufail[train]' (the 'train' extra)")


@pytest.mark.slow
def test_gpufail_serve_needs_only_the_serve_extra(tmp_path):
    from tests.serving.api_server import serve_test_fleet

    server = serve_test_fleet(tmp_path, env=as_installed(["serve"], tmp_path / "site"))
    try:
        assert httpx.get(server.url + "/readyz", timeout=30).status_code == 200
        gpus = httpx.get(server.url + "/v1/gpus/at-risk", params={"top": 3, "top_features": 2}, timeout=30)
        assert gpus.status_code == 200, gpus.text
        assert "gpufail_ready 1.0" in httpx.get(server.url + "/metrics", timeout=30).text
        assert httpx.get(server.url + "/", timeout=30).status_code == 200  # the operator's pages
    finally:
        server.stop()
    assert "not in this install" not in server.logs()


def test_make_ci_and_the_lock_cover_every_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["optional-dependencies"]) == {"collect", "serve", "train", "dev"}
    makefile = (ROOT / "Makefile").read_text()
    assert "--all-extras -o requirements.lock" in makefile, "make lock resolves every extra into the one lock"
    assert "-r requirements.lock" in makefile
    locked = {
        line.split("==")[0].strip().lower()
        for line in (ROOT / "requirements.lock").read_text().splitlines()
        if "==" in line
    }
    from packaging.utils import canonicalize_name

    missing = sorted(
        closure(["collect", "serve", "train", "dev"]) - {canonicalize_name(n) for n in locked} - {"gpufail"}
    )
    assert missing == [], f"in pyproject.toml but not in requirements.lock (run make lock): {missing}"


def test_the_wheel_holds_the_product_packages_and_no_benchmarks_or_tests(tmp_path):
    """benchmarks/ and tests/ run from a checkout; the wheel (and so the images) leaves them out."""
    import shutil
    import zipfile

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    skip = shutil.ignore_patterns("__pycache__", "fixtures", "*.egg-info")
    for package in ("gpufail", "ingest", "features", "models", "serving", "benchmarks", "tests"):
        shutil.copytree(ROOT / package, source / package, ignore=skip)
    # Offline, with this environment's setuptools: the build backend the project names.
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    built = run([sys.executable, "-c", build, str(tmp_path / "dist")], {}, cwd=source)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = tmp_path / "dist" / built.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/")[0] for name in archive.namelist()}
    assert top == {"gpufail", "ingest", "features", "models", "serving", "gpufail-0.1.0.dist-info"}
