"""Fixtures of the fake libnvidia-ml.so.1 (tests/fake_nvml), for the collector tests and the fault
suite: a plugin of the root conftest, so that one process loads one library (pynvml loads it once)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fake_nvml.build import FakeNvml, NoCompiler, build_fake_nvml
from tests.fake_nvml.scenario import Scenario


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> FakeNvml:
    try:
        library = build_fake_nvml(tmp_path_factory.mktemp("fake_nvml"))
    except NoCompiler as exc:
        pytest.skip(f"fake libnvidia-ml.so.1 not built: {exc}")
    return FakeNvml(library)


@pytest.fixture
def use_scenario(
    fake_nvml: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[Scenario], FakeNvml]:
    def use(scenario: Scenario) -> FakeNvml:
        monkeypatch.setenv("FAKE_NVML_CONFIG", str(scenario.write(tmp_path / "scenario.txt")))
        return fake_nvml

    return use
