"""gpufail sets polars' allocator (jemalloc) up before polars loads (`gpufail/__init__.py`)."""

import os
import shutil
import subprocess
import sys

import pytest

from gpufail import polars_allocator_settings


def _run(code: str, env: dict[str, str], prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*(prefix or []), sys.executable, "-c", code], env=env, capture_output=True, text=True)


def _env_without_setting() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "_RJEM_MALLOC_CONF"}


def test_settings_keep_freed_pages_and_give_one_arena_per_core():
    settings = dict(item.split(":") for item in polars_allocator_settings(3).split(","))
    assert settings["dirty_decay_ms"] == "20000" and settings["oversize_threshold"] == "0"
    assert settings["narenas"] == "3"
    assert dict(item.split(":") for item in polars_allocator_settings(0).split(","))["narenas"] == "1"


def test_polars_allocator_runs_with_the_settings_when_gpufail_is_imported_first():
    # jemalloc reads its settings once, at its first allocation; printing its statistics at exit
    # shows which options it actually runs with.
    code = (
        "import os, gpufail; os.environ['_RJEM_MALLOC_CONF'] += ',stats_print:true'; "
        "import polars as pl; pl.DataFrame({'a': [1, 2]}).sum()"
    )
    done = _run(code, _env_without_setting())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "opt.dirty_decay_ms: 20000" in done.stderr
    assert "opt.oversize_threshold: 0" in done.stderr
    assert f"opt.narenas: {len(os.sched_getaffinity(0))}" in done.stderr


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is not installed")
def test_arenas_follow_the_cores_the_process_may_use():
    code = "import os, gpufail; print(os.environ['_RJEM_MALLOC_CONF'])"
    done = _run(code, _env_without_setting(), prefix=["taskset", "-c", "0"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("narenas:1")


def test_a_setting_already_in_the_environment_wins():
    code = "import os, gpufail; print(os.environ['_RJEM_MALLOC_CONF'])"
    done = _run(code, {**_env_without_setting(), "_RJEM_MALLOC_CONF": "narenas:3"})
    assert done.stdout.strip() == "narenas:3"
