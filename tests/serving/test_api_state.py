"""`ServingState.refresh` in memory, with fake sources: what happens when the model source
cannot be read (a registry that is down)."""

from __future__ import annotations

from datetime import UTC, datetime

import pandas as pd

from serving.api_state import LatestFeatures, ServedModel, ServeOptions, ServingState
from serving.policy import PolicyConfig, Tier
from tests.serving.test_score import fake_model, hand_frame


class Features:
    root = "memory"

    def fingerprint(self) -> str:
        return "f1"

    def load(self) -> LatestFeatures:
        frame = hand_frame()
        latest = frame[frame["ts"] == frame["ts"].max()].reset_index(drop=True)
        return LatestFeatures(latest, "f1", pd.Timestamp(latest["ts"].max()))


class DownRegistry:
    """The tracking server does not answer; the last champion is in the local cache."""

    def __init__(self, cached: bool) -> None:
        self.cached, self.loads = cached, 0

    def fingerprint(self) -> str:
        raise ConnectionError("Connection refused")

    def load(self) -> ServedModel:
        self.loads += 1
        if not self.cached:
            raise ConnectionError("Connection refused; and no cached champion")
        return ServedModel(fake_model(), "7", {"source": "registry:cache"}, datetime.now(UTC))


def state(source) -> ServingState:
    options = ServeOptions(
        data_root="memory",
        tiers=PolicyConfig(tiers=(Tier("watch", 0.2, 0.1),)),
        max_top_features=0,
        features_max_age_s=0,
    )
    return ServingState(options, source, Features())  # type: ignore[arg-type]


def test_a_registry_that_is_down_at_start_serves_the_cached_champion():
    s = state(DownRegistry(cached=True))
    outcome = s.refresh()
    assert outcome.model_version == fake_model().version and outcome.error is None
    assert s.snapshot.fleet is not None and len(s.snapshot.fleet.records) == 3
    assert s.readiness() == (True, [])


def test_a_registry_that_is_down_with_no_cache_is_not_ready_and_says_why():
    source = DownRegistry(cached=False)
    s = state(source)
    s.refresh()
    ready, reasons = s.readiness()
    assert not ready and "model not loaded" in reasons[0] and "Connection refused" in reasons[0]
    s.refresh()
    assert source.loads == 1  # the same unreachable source is not loaded again every poll


def test_a_registry_that_goes_down_while_serving_keeps_the_model():
    source = DownRegistry(cached=True)
    s = state(source)
    s.refresh()
    served = s.snapshot.served
    s.refresh()
    assert s.snapshot.served is served and source.loads == 1
    assert "Connection refused" in (s.model_error or "")


def test_an_uncalibrated_model_is_served_with_a_warning_and_says_so(caplog):
    import logging
    from dataclasses import replace

    from models.calibration import Calibration
    from serving.api_state import calibration_payload

    with caplog.at_level(logging.WARNING, logger="gpufail.serve"):
        s = state(DownRegistry(cached=True))
        s.refresh()
    assert "has no calibration" in caplog.text and "served uncalibrated" in caplog.text
    assert calibration_payload(s.snapshot.served.model) == {"calibrated": False, "calibration": None}
    start, end = pd.Timestamp("2026-01-01", tz="UTC"), pd.Timestamp("2026-01-08", tz="UTC")
    calibration = Calibration("platt", {"slope": 0.8, "offset": -0.2}, start, end, 5000, 40)
    payload = calibration_payload(replace(fake_model(), calibration=calibration))
    assert payload["calibrated"] is True
    assert payload["calibration"]["method"] == "platt" and payload["calibration"]["n_positives"] == 40
    assert payload["calibration"]["slice_start"] == start.isoformat()
