"""`FeatureSpec`: the settings that shape features, their stored form and fingerprint, and the
check that the grid, the windows and the horizon fit together (the one the configuration makes)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from features.spec import (
    DEFAULT_WINDOWS,
    FeatureSpec,
    FeatureSpecError,
    FeatureSpecMismatch,
    inconsistencies,
    require_spec,
    spec_mismatch,
)
from ingest.errors import InputError
from ingest.xid_catalog import default_failure_xids

H = timedelta(hours=1)
CUSTOM = FeatureSpec(
    grid=timedelta(minutes=15),
    windows=[timedelta(minutes=15), H, 6 * H],
    max_silence=12 * H,
    xid_since_cap=240 * H,
    horizon=6 * H,
    failure_xids=[79, 48, 79],
    merge_window=timedelta(minutes=90),
    lost_after=None,
)


def test_the_defaults_are_the_documented_settings():
    spec = FeatureSpec()
    assert (spec.grid, spec.windows, spec.horizon) == (H, DEFAULT_WINDOWS, 24 * H)
    assert (spec.max_silence, spec.merge_window, spec.lost_after) == (24 * H, 6 * H, 6 * H)
    assert spec.failure_xids == default_failure_xids()


@pytest.mark.parametrize("spec", [FeatureSpec(), CUSTOM], ids=["default", "custom"])
def test_the_stored_form_reads_back_as_the_same_spec_through_json(spec):
    text = json.dumps(spec.to_json())
    again = FeatureSpec.from_json(json.loads(text))
    assert again == spec and hash(again) == hash(spec)
    assert again.fingerprint == spec.fingerprint


def test_the_stored_form_is_written_in_the_configurations_units():
    assert CUSTOM.to_json() == {
        "grid": "15m",
        "windows": ["15m", "1h", "6h"],
        "max_silence": "12h",
        "xid_since_cap": "10d",
        "horizon": "6h",
        "failure_xids": [48, 79],
        "merge_window": "90m",
        "lost_after": None,
    }


def test_the_fingerprint_is_pinned():
    # A change here means stored specs (features manifests, models) no longer match their settings.
    assert CUSTOM.fingerprint == "bba24128dfc25a85"


def test_equal_settings_are_equal_specs_however_they_were_given():
    as_given = FeatureSpec(windows=[H, 6 * H], failure_xids=(79, 48, 48))
    assert as_given == FeatureSpec(windows=(H, 6 * H), failure_xids=[48, 79])
    assert as_given.fingerprint == FeatureSpec(windows=(H, 6 * H), failure_xids=[48, 79]).fingerprint
    assert FeatureSpec(windows=[6 * H, H]) != FeatureSpec(windows=[H, 6 * H])  # the column order differs
    assert FeatureSpec(horizon=12 * H).fingerprint != FeatureSpec().fingerprint


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"grid": 7 * H},
            "feature spec: grid: expected a grid that divides a day, such as '15m', '1h' or '1d', got '7h'",
        ),
        (
            {"windows": [timedelta(minutes=90)]},
            'feature spec: windows: each window must be a multiple of the grid \'1h\', got ["90m"]; e.g. windows = ["2h"]',
        ),
        ({"windows": [H, H]}, 'feature spec: windows: expected distinct windows, got ["1h", "1h"]'),
        (
            {"horizon": timedelta(minutes=90)},
            "feature spec: horizon: expected a multiple of the grid '1h', got '90m'; e.g. horizon = \"2h\"",
        ),
        ({"windows": []}, "feature spec: windows: expected at least one window, got none"),
        ({"lost_after": timedelta(0)}, "feature spec: lost_after: expected a duration above zero, got"),
        ({"merge_window": -H}, "feature spec: merge_window: expected a duration of zero or more"),
        ({"failure_xids": ["79"]}, "feature spec: failure_xids: expected a list of whole XID codes"),
        ({"grid": 3600}, "feature spec: grid: expected a duration above zero, got 3600"),
    ],
)
def test_settings_that_do_not_fit_are_refused_in_one_line(settings, expected):
    with pytest.raises(FeatureSpecError) as refused:
        FeatureSpec(**settings)
    assert str(refused.value).startswith(expected) and "\n" not in str(refused.value)
    assert isinstance(refused.value, InputError) and isinstance(refused.value, ValueError)


def test_the_configuration_refuses_with_the_specs_own_check(tmp_path):
    from gpufail.config import load_settings
    from ingest.errors import ConfigError

    (problem,) = inconsistencies(H, [timedelta(minutes=90)], 24 * H, grid_name="GRID")
    assert problem.field == "windows"
    path = tmp_path / "c.toml"
    path.write_text('[features]\nwindows = ["90m"]\n')
    with pytest.raises(ConfigError) as refused:
        load_settings(path, environ={})
    same = inconsistencies(H, [timedelta(minutes=90)], 24 * H, grid_name="[features] grid '1h'")[0].message
    assert str(refused.value) == f"config file {path}: [features] windows: {same}"


def test_the_settings_make_the_spec_and_its_defaults_are_the_specs():
    from gpufail.config import Settings, load_settings

    assert Settings().feature_spec() == FeatureSpec()
    settings = load_settings(
        environ={
            "GPUFAIL_FEATURES__GRID": "15m",
            "GPUFAIL_FEATURES__WINDOWS": '["15m", "1h", "6h"]',
            "GPUFAIL_FEATURES__MAX_SILENCE": "12h",
            "GPUFAIL_LABELS__HORIZON": "6h",
            "GPUFAIL_LABELS__FAILURE_XIDS": "[79, 48]",
            "GPUFAIL_LABELS__MERGE_WINDOW": "90m",
            "GPUFAIL_LABELS__LOST_AFTER": "3h",
        }
    )
    assert settings.feature_spec() == FeatureSpec(
        grid=timedelta(minutes=15),
        windows=[timedelta(minutes=15), H, 6 * H],
        max_silence=12 * H,
        horizon=6 * H,
        failure_xids=[48, 79],
        merge_window=timedelta(minutes=90),
        lost_after=3 * H,
    )


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ("1h", "m.json: spec: expected an object of feature settings, got str"),
        ({**FeatureSpec().to_json(), "bucket": "1h"}, "m.json: spec: expected the keys"),
        ({k: v for k, v in FeatureSpec().to_json().items() if k != "horizon"}, "no ['horizon']"),
        ({**FeatureSpec().to_json(), "horizon": 24}, "m.json: spec: horizon: expected a duration with a unit"),
        ({**FeatureSpec().to_json(), "windows": "1h"}, "m.json: spec: windows: expected a list of durations"),
        ({**FeatureSpec().to_json(), "grid": "7h"}, "m.json: spec: grid: expected a grid that divides a day"),
    ],
)
def test_a_damaged_stored_spec_is_named(data, expected):
    with pytest.raises(FeatureSpecError) as refused:
        FeatureSpec.from_json(data, "m.json: spec")
    assert str(refused.value).startswith("m.json: spec: ") and expected in str(refused.value)


def test_a_mismatch_names_both_fingerprints_and_each_differing_setting():
    built, wanted = FeatureSpec(), FeatureSpec(windows=[H, 6 * H], horizon=12 * H)
    assert [name for name, _, _ in built.differences(wanted)] == ["windows", "horizon"]
    error = spec_mismatch(built=built, wanted=wanted, features="d: the features", user="model m needs", remedy="fix")
    assert isinstance(error, FeatureSpecMismatch) and isinstance(error, InputError)
    assert str(error) == (
        f"d: the features were built with feature spec {built.fingerprint}, but model m needs feature spec "
        f'{wanted.fingerprint}; they differ in windows (["1h", "6h", "1d", "7d"] against ["1h", "6h"]), '
        'horizon ("1d" against "12h"); fix'
    )
    require_spec(None, wanted, features="d", user="u", remedy="r")  # not recorded: nothing to check against
    require_spec(FeatureSpec(windows=(H, 6 * H), horizon=12 * H), wanted, features="d", user="u", remedy="r")
    with pytest.raises(FeatureSpecMismatch):
        require_spec(built, wanted, features="d", user="u", remedy="r")


def test_the_fail_slow_window_is_a_setting_of_the_spec_that_keeps_the_fingerprints_of_specs_before_it():
    from datetime import timedelta

    from features.spec import FeatureSpec

    default = FeatureSpec()
    # Specs written before the setting computed the same 24 h fail-slow features: same name.
    assert "fail_slow_window" not in default.to_json() and default.fingerprint == "4cb18ea777e6665c"
    assert default.fail_slow_label == "24h"
    assert FeatureSpec.from_json(default.to_json()) == default
    off = FeatureSpec(fail_slow_window=None)
    assert off.fail_slow_label is None and off.to_json()["fail_slow_window"] is None
    assert FeatureSpec.from_json(off.to_json()) == off and off.fingerprint != default.fingerprint
    assert default.differences(off) == [("fail_slow_window", "1d", None)]
    six = FeatureSpec(fail_slow_window=timedelta(hours=6))
    assert six.fail_slow_label == "6h" and FeatureSpec.from_json(six.to_json()) == six
    # A window the build does not compute gives no fail-slow features.
    assert FeatureSpec(fail_slow_window=timedelta(hours=12)).fail_slow_label is None
