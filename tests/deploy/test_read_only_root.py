"""gpufail in an image with a read-only root (the manifests' readOnlyRootFilesystem): numba
caches compiled kernels only in a folder it can write. With the code, the home and
NUMBA_CACHE_DIR all read-only, `gpufail features` compiles the kernels without caching them
instead of failing; and a copy of a filled cache (what the pods' init container makes of the
image's) is used as it is, compiling nothing.

Read-only here means a read-only bind mount in a private mount namespace (`unshare -m`): it
stops root too, unlike chmod. Where that is not permitted the test is skipped, with the reason."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ingest.simulator.run import simulate
from ingest.store import Store

ROOT = Path(__file__).parents[2]
GPUFAIL = Path(sys.executable).parent / "gpufail"


@pytest.fixture(scope="module")
def raw_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small fleet's telemetry, without features."""
    root = tmp_path_factory.mktemp("raw") / "data"
    simulate(root, "demo", seed=5, progress=False, nodes=2, days=3)
    return root


def fresh_copy(raw: Path, folder: Path) -> Path:
    shutil.copytree(raw, folder)
    return folder


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFAIL_", "NUMBA_", "XDG_"))}
    return env | {"PYTHONDONTWRITEBYTECODE": "1"} | extra


def read_only_run(read_only: list[Path], command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`command` with each folder of `read_only` bind-mounted read-only onto itself, in a mount
    namespace of its own (the rest of the machine sees nothing)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs root and unshare(1) to mount folders read-only in a private mount namespace")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not allowed here: {probe.stderr.strip()}")
    mounts = [
        f"mount --bind {shlex.quote(str(p))} {shlex.quote(str(p))} && mount -o remount,bind,ro {shlex.quote(str(p))}"
        for p in read_only
    ]
    script = " && ".join([*mounts, "exec " + shlex.join(command)])
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",
    )


def kernel_files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_features_run_with_code_home_and_numba_cache_read_only(raw_root, tmp_path):
    data = fresh_copy(raw_root, tmp_path / "data")
    home, cache = tmp_path / "home", tmp_path / "numba-cache"
    home.mkdir()
    cache.mkdir()
    env = clean_env(HOME=str(home), NUMBA_CACHE_DIR=str(cache))
    done = read_only_run([ROOT, home, cache], [str(GPUFAIL), "features", "--data", str(data), "--quiet"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "numba: no writable cache folder" in done.stderr and "compiled in this process, not cached" in done.stderr
    assert Store.open(str(data)).dates("buckets")
    assert kernel_files(cache) == {} and kernel_files(home) == {}
    # The read-only mounts held: the same command where the cache folder can be written fills it.
    again = subprocess.run(
        [str(GPUFAIL), "features", "--data", str(fresh_copy(raw_root, tmp_path / "data2")), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "numba: no writable cache folder" not in again.stderr
    assert any(name.endswith(".nbc") for name in kernel_files(cache))


@pytest.mark.slow
def test_a_copy_of_a_filled_cache_is_used_as_it_is(raw_root, tmp_path):
    """The pods' init container copies the image's compiled kernels (`cp -a`) into an emptyDir
    that NUMBA_CACHE_DIR names: numba loads them from the copy and compiles nothing."""
    built, copied = tmp_path / "image-cache", tmp_path / "pod-cache"
    first = subprocess.run(
        [str(GPUFAIL), "features", "--data", str(fresh_copy(raw_root, tmp_path / "d1")), "--quiet"],
        env=clean_env(NUMBA_CACHE_DIR=str(built)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    copied.mkdir()
    subprocess.run(["cp", "-a", f"{built}/.", f"{copied}/"], check=True)
    before = kernel_files(copied)
    assert any(name.endswith(".nbc") for name in before)
    second = subprocess.run(
        [str(GPUFAIL), "features", "--data", str(fresh_copy(raw_root, tmp_path / "d2")), "--quiet"],
        env=clean_env(NUMBA_CACHE_DIR=str(copied)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert kernel_files(copied) == before
