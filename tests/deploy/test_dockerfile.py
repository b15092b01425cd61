"""The Dockerfile (no container engine here to build it): each image installs gpufail with
extras the project defines, from requirements.lock, runs as a user other than root, and starts
the entry point the package installs with a command the CLI has."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from gpufail.cli import COMMANDS

ROOT = Path(__file__).parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            current = line.split()[-1] if " AS " in line.upper() else f"stage{len(found)}"
            found[current] = []
        if current is not None:
            found[current].append(line)
    return found


def instruction(stage: list[str], keyword: str) -> list[str]:
    return [line.split(None, 1)[1] for line in stage if line.split()[0].upper() == keyword]


def test_multi_stage_with_a_collector_and_a_full_target():
    found = stages()
    assert {"collector", "full"} <= set(found) and len(found) >= 4


def test_each_image_installs_its_extras_from_the_lock():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    installs = re.findall(r"uv pip install [^\n]*", re.sub(r"\\\n\s*", " ", DOCKERFILE))
    assert len(installs) == 2
    wanted = {"collect": {"collect"}, "collect,serve,train": {"collect", "serve", "train"}}
    for install in installs:
        assert "--constraint requirements.lock" in install
        [chosen] = re.findall(r'"\.\[([a-z,]+)\]"', install)
        assert set(chosen.split(",")) <= extras and set(chosen.split(",")) in wanted.values()
    copied = [
        line.split()[1:-1] for s in stages().values() for line in s if line.startswith("COPY ") and "--from" not in line
    ]
    for sources in copied:
        for source in sources:
            assert (ROOT / source.rstrip("/")).exists(), source
    assert any("requirements.lock" in sources for sources in copied)


def test_the_images_run_the_packages_entry_point_as_an_unprivileged_user():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    found = stages()
    for target, extras in (("collector", "build-collector"), ("full", "build-full")):
        stage = found[target]
        [user] = instruction(stage, "USER")
        assert user.split(":")[0] not in ("0", "root")
        [entry] = instruction(stage, "ENTRYPOINT")
        [cmd] = instruction(stage, "CMD")
        assert json.loads(entry) == ["gpufail"] and "gpufail" in scripts
        assert json.loads(cmd)[0] in COMMANDS
        assert any(f"--from={extras} /opt/gpufail /opt/gpufail" in line for line in stage)
    assert json.loads(instruction(found["collector"], "CMD")[0]) == ["collect"]


def test_the_build_context_leaves_out_the_venv_and_data():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "demo-data", "tests"} <= set(ignored)
    copied = {
        line.split()[1].rstrip("/")
        for s in stages().values()
        for line in s
        if line.startswith("COPY ") and "--from" not in line
    }
    assert not copied & set(ignored)


def test_the_full_image_ships_the_feature_kernels_compiled_where_its_user_can_use_them():
    # numba reads a cache folder only where it can write (else it falls back to an empty one in
    # the user's home): the folder precompile filled, owned by the user the image runs as.
    found = stages()
    build, full = found["build-full"], found["full"]
    [built_into] = [e.split("=", 1)[1] for e in instruction(build, "ENV") if e.startswith("NUMBA_CACHE_DIR=")]
    assert any("-m gpufail.precompile" in run for run in instruction(build, "RUN"))
    assert build.index(next(line for line in build if "gpufail.precompile" in line)) > build.index(
        next(line for line in build if line.startswith("ENV NUMBA_CACHE_DIR"))
    )
    [user] = instruction(full, "USER")
    assert f"COPY --from=build-full --chown={user} {built_into} {built_into}" in full
    assert f"NUMBA_CACHE_DIR={built_into}" in instruction(full, "ENV")
