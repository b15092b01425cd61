"""`ServingState.refresh` in memory, with fake sources: what happens when the model source
cannot be read (a registry that is down)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pandas as pd

from features.spec import FeatureSpec
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


# -- the model's feature spec against the features' ---------------------------------------------

OTHER = FeatureSpec(windows=[timedelta(hours=1), timedelta(hours=6)])


class SpecFeatures(Features):
    """The features of a store whose manifest records `spec`; change it to publish new ones."""

    def __init__(self, spec: FeatureSpec | None) -> None:
        self.spec, self.version = spec, 1

    def fingerprint(self) -> str:
        return f"f{self.version}"

    def load(self) -> LatestFeatures:
        return replace(super().load(), fingerprint=self.fingerprint(), spec=self.spec)


class SpecModels:
    """A model folder whose model carries `spec`; change it to publish a new model."""

    def __init__(self, spec: FeatureSpec) -> None:
        self.spec, self.version = spec, 1

    def fingerprint(self) -> str:
        return f"m{self.version}"

    def load(self) -> ServedModel:
        model = replace(fake_model(), params={"v": self.version}, feature_spec=self.spec)
        return ServedModel(model, self.fingerprint(), {"source": "path"}, datetime.now(UTC))


def spec_state(models: SpecModels, features: SpecFeatures) -> ServingState:
    options = ServeOptions(
        data_root="memory",
        tiers=PolicyConfig(tiers=(Tier("watch", 0.2, 0.1),)),
        max_top_features=0,
        features_max_age_s=0,
    )
    return ServingState(options, models, features)  # type: ignore[arg-type]


def test_a_model_of_another_spec_than_the_features_is_not_served_and_says_why():
    s = spec_state(SpecModels(OTHER), SpecFeatures(FeatureSpec()))
    s.refresh()
    ready, reasons = s.readiness()
    assert not ready and s.snapshot.served is None
    assert reasons[0].startswith(
        f"model not loaded: memory: the features were built with feature spec {FeatureSpec().fingerprint}, but "
        f"model {replace(fake_model(), params={'v': 1}).version} needs feature spec {OTHER.fingerprint}; "
        "they differ in windows ("
    )


def test_a_new_model_of_another_spec_is_rejected_and_the_old_one_keeps_serving():
    models = SpecModels(FeatureSpec())
    s = spec_state(models, SpecFeatures(FeatureSpec()))
    s.refresh()
    served = s.snapshot.served
    assert served is not None and s.readiness() == (True, [])
    models.spec, models.version = OTHER, 2
    outcome = s.refresh()
    assert s.snapshot.served is served and not outcome.changed
    assert outcome.error is not None and f"needs feature spec {OTHER.fingerprint}" in outcome.error
    assert s.readiness() == (True, [])


def test_new_features_of_another_spec_are_not_taken_and_the_old_ones_keep_serving():
    features = SpecFeatures(FeatureSpec())
    s = spec_state(SpecModels(FeatureSpec()), features)
    s.refresh()
    before = s.snapshot.features
    features.spec, features.version = OTHER, 2
    s.refresh()
    assert s.snapshot.features is before and s.snapshot.fleet is not None
    assert f"the features were built with feature spec {OTHER.fingerprint}" in (s.features_error or "")
    # Features whose spec was not recorded (built before specs were) are taken.
    features.spec, features.version = None, 3
    s.refresh()
    assert s.snapshot.features is not before and s.features_error is None
