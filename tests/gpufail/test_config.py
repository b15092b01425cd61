from datetime import timedelta
from pathlib import Path

import pytest

from gpufail.config import Settings, format_duration, load_settings, parse_duration
from ingest.errors import ConfigError
from ingest.xid_catalog import default_failure_xids

EXAMPLE = Path(__file__).parents[2] / "gpufail.example.toml"


def test_the_documented_example_file_states_exactly_the_defaults():
    assert load_settings(EXAMPLE, environ={}) == Settings()


def test_defaults_without_a_file():
    settings = load_settings(environ={})
    assert settings.labels.horizon == timedelta(hours=24)
    assert settings.labels.failure_xids == list(default_failure_xids())
    assert settings.publish.dry_run is True


def test_file_values_override_defaults_and_environment_overrides_the_file(tmp_path):
    path = tmp_path / "gpufail.toml"
    path.write_text('[labels]\nhorizon = "12h"\n[model]\ntop_k = 20\n')
    settings = load_settings(path, environ={"GPUFAIL_MODEL__TOP_K": "5", "GPUFAIL_LABELS__FAILURE_XIDS": "[48, 79]"})
    assert settings.labels.horizon == timedelta(hours=12)
    assert settings.model.top_k == 5
    assert settings.labels.failure_xids == [48, 79]


def test_config_path_can_come_from_the_environment(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[store]\nroot = "s3://fleet/data"\n')
    assert load_settings(environ={"GPUFAIL_CONFIG": str(path)}).store.root == "s3://fleet/data"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[labels]\nhorizn = "12h"\n', r"\[labels\] horizn: unknown key"),
        ('[lables]\nhorizon = "12h"\n', r"\[lables\]: unknown table"),
        (
            '[labels]\nhorizon = "soon"\n',
            r"bad.toml: \[labels\] horizon: expected a duration.*'soon'",
        ),
        ("[model]\ntop_k = 0\n", r"\[model\] top_k.*greater than 0, got 0"),
        ("[model]\nmax_negatives_per_positive = 0\n", r"\[model\] max_negatives_per_positive.*greater than 0, got 0"),
        ('[model]\nkind = "magic"\n', r"\[model\] kind.*'lightgbm', 'xgboost', .*'parallel' or 'cascade'"),
        ('[model]\ncalibration = "spline"\n', r"\[model\] calibration.*'platt', 'beta' or 'isotonic', got 'spline'"),
        ('[model]\ncalibration_window = "0s"\n', r"\[model\] calibration_window: expected a duration above zero"),
        ("[evaluate]\nalarm_budgets = []\n", r"\[evaluate\] alarm_budgets.*at least 1 item"),
        ("[evaluate]\nalarm_budgets = [1, 0]\n", r"\[evaluate\] alarm_budgets.1.*greater than 0, got 0"),
        ('[evaluate]\nlong_horizon = "0h"\n', r"\[evaluate\] long_horizon: expected a duration above zero"),
        ('[evaluate]\nlong_horizon = "soon"\n', r"\[evaluate\] long_horizon: expected a duration"),
        ("[evaluate]\nlong_horizon = 24\n", r"\[evaluate\] long_horizon: expected a duration with a unit"),
        # One definition of an alarm (one per GPU episode, judged within the windows): the old
        # re-arming and look-back keys are refused, not silently ignored.
        ('[evaluate]\nalarm_lookback = "2d"\n', r"\[evaluate\] alarm_lookback"),
        ("[evaluate]\nseeds = [1, 2, 1]\n", r"\[evaluate\] seeds: .*expected each seed once, got \[1\]"),
        ("[evaluate]\nseeds = [-1]\n", r"\[evaluate\] seeds.0.*greater than or equal to 0"),
        (
            "[publish.tiers.avoid]\nenter = 0.1\nexit = 0.05\nbudget_per_day = 0\n",
            r"\[publish\] tiers.avoid.budget_per_day.*greater than 0, got 0",
        ),
        ("[labels\n", "not valid TOML"),
    ],
)
def test_bad_configuration_names_the_file_key_and_expectation(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        load_settings(path, environ={})
    assert "bad.toml" in str(err.value)


def test_bad_environment_override_is_named():
    with pytest.raises(ConfigError, match="GPUFAIL_HORIZON: expected GPUFAIL_<TABLE>__<KEY>"):
        load_settings(environ={"GPUFAIL_HORIZON": "12h"})
    with pytest.raises(
        ConfigError, match=r"^environment variable GPUFAIL_LABELS__HORIZON \(\[labels\] horizon\): expected a duration"
    ):
        load_settings(environ={"GPUFAIL_LABELS__HORIZON": "forever"})


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nowhere.toml: not found"):
        load_settings(tmp_path / "nowhere.toml", environ={})


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30), ("5m", 300), ("24h", 86400), ("7d", 604800), ("1w", 604800), ("1.5h", 5400)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)
    assert parse_duration(format_duration(timedelta(seconds=seconds))) == timedelta(seconds=seconds)


@pytest.mark.parametrize("number", [12, 12.5, 0])
def test_a_duration_needs_a_unit(number):
    # `horizon = 12` was read as 12 seconds.
    with pytest.raises(ValueError, match=f"got {number} \\(a number without a unit\\)"):
        parse_duration(number)


def test_a_bare_number_for_a_duration_is_refused_at_load_naming_the_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[labels]\nhorizon = 12\n")
    with pytest.raises(ConfigError, match=r"c.toml: \[labels\] horizon: expected a duration with a unit"):
        load_settings(path, environ={})
    with pytest.raises(ConfigError, match=r"GPUFAIL_LABELS__HORIZON \(\[labels\] horizon\).* got 12 "):
        load_settings(environ={"GPUFAIL_LABELS__HORIZON": "12"})


def test_a_daily_grid_needs_daily_windows_and_says_which(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[features]\ngrid = "1d"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(path, environ={})
    assert str(err.value) == (
        "[features] windows (default): each window must be a multiple of [features] grid '1d' (set in config file "
        f'{path}), got ["1h", "6h"]; e.g. windows = ["1d", "7d"]'
    )
    path.write_text('[features]\ngrid = "1d"\nwindows = ["1d", "7d", "28d"]\n')
    settings = load_settings(path, environ={})
    assert settings.features.windows == [timedelta(days=d) for d in (1, 7, 28)]


def test_the_horizon_is_a_whole_number_of_grid_steps():
    with pytest.raises(
        ConfigError, match=r"\[labels\] horizon.*multiple of \[features\] grid '1h'.*got '90m'; e.g. horizon = \"2h\""
    ):
        load_settings(environ={"GPUFAIL_LABELS__HORIZON": "90m"})


def test_a_non_utf8_file_or_override_is_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b'[labels]\nhorizon = "1\xe9h"\n')
    with pytest.raises(ConfigError, match=r"c.toml: not UTF-8 text \(byte 0xe9 at offset 21\)"):
        load_settings(path, environ={})
    with pytest.raises(ConfigError, match=r"GPUFAIL_STORE__ROOT: not UTF-8 text \(byte 0xe9 at offset 3\)"):
        load_settings(environ={"GPUFAIL_STORE__ROOT": "dat\udce9"})


def test_settings_are_immutable_so_no_stage_can_change_another_stages_view():
    settings = load_settings(environ={})
    with pytest.raises(Exception, match="frozen"):
        settings.model.top_k = 3  # type: ignore[misc]


def test_a_file_name_with_braces_is_named_as_it_is(tmp_path):
    with pytest.raises(ConfigError, match=r"\{x\}.toml: not found$"):
        load_settings(tmp_path / "{x}.toml", environ={})
    with pytest.raises(ConfigError, match=r"\{x\}.toml \(GPUFAIL_CONFIG\): not found$"):
        load_settings(environ={"GPUFAIL_CONFIG": str(tmp_path / "{x}.toml")})


def test_calibration_alarm_and_budget_settings_reach_the_options_the_commands_take(tmp_path):
    path = tmp_path / "gpufail.toml"
    path.write_text(
        '[model]\ncalibration = "isotonic"\ncalibration_window = "3d"\n'
        '[evaluate]\nlong_horizon = "48h"\ntest_days = 10\n'
        "[publish.tiers.avoid]\nenter = 0.25\nexit = 0.15\nbudget_per_day = 2\n"
    )
    settings = load_settings(path, environ={})
    train = settings.train_options()
    assert (train.calibration, train.calibration_window) == ("isotonic", timedelta(days=3))
    assert settings.nightly_options(str(tmp_path)).train.calibration == "isotonic"
    plan = settings.walk_forward_plan()
    assert (plan.calibration, plan.calibration_window, plan.test_days) == ("isotonic", timedelta(days=3), 10)
    assert settings.walk_forward_plan(test_days=4).test_days == 4
    rules = settings.alarm_rules()
    assert (rules.horizon, rules.long_horizon) == (timedelta(hours=24), timedelta(hours=48))
    tiers = {t.name: t for t in settings.publish.policy_config().tiers}
    assert tiers["avoid"].budget_per_day == 2 and tiers["watch"].budget_per_day is None
    assert settings.publish_options().policy.tiers == settings.publish.policy_config().tiers


def test_the_fail_slow_settings_reach_the_feature_spec_and_the_policy():
    from datetime import timedelta

    from gpufail.config import Settings

    default = Settings()
    assert default.feature_spec().fail_slow_window == timedelta(hours=24)
    assert default.publish.policy_config().fail_slow_threshold == 0.05
    off = Settings.model_validate({"features": {"fail_slow": False}, "publish": {"fail_slow": False}})
    assert off.feature_spec().fail_slow_window is None and off.publish.policy_config().fail_slow_threshold is None
    six = Settings.model_validate({"features": {"fail_slow_window": "6h"}, "publish": {"fail_slow_threshold": 0.1}})
    assert six.feature_spec().fail_slow_label == "6h" and six.publish.policy_config().fail_slow_threshold == 0.1


def test_a_command_may_check_only_the_tables_it_reads(tmp_path):
    path = tmp_path / "gpufail.toml"
    path.write_text('[evaluate]\ntest_days = "two weeks"\n[publish]\ntarget = "slurm"\n')
    settings = load_settings(path, environ={}, tables=("store", "publish"))
    assert settings.publish.target == "slurm"
    assert settings.store == Settings().store  # not set anywhere: its defaults
    with pytest.raises(AttributeError):
        settings.evaluate  # noqa: B018 - set but not checked: absent, never its defaults
    with pytest.raises(AttributeError):
        settings.serve  # noqa: B018 - neither named nor set: absent too (no defaults made)
    with pytest.raises(ConfigError, match=r"\[evaluate\] test_days"):
        load_settings(path, environ={})
    with pytest.raises(ConfigError, match=r"GPUFAIL_PUBLISH__TARGET \(\[publish\] target\)"):
        load_settings(path, environ={"GPUFAIL_PUBLISH__TARGET": "fax"}, tables=("publish",))
    path.write_text("[evaulate]\ntest_days = 3\n")
    with pytest.raises(ConfigError, match=r"\[evaulate\]: unknown table"):
        load_settings(path, environ={}, tables=("publish",))


def test_every_table_s_problems_are_named_at_once_in_table_order(tmp_path):
    path = tmp_path / "gpufail.toml"
    path.write_text('[serve]\nport = "x"\n[bogus]\na = 1\n[store]\nroot = 5\n')
    with pytest.raises(ConfigError) as raised:
        load_settings(path, environ={})
    message = str(raised.value)
    assert message.index("[store] root") < message.index("[serve] port") < message.index("[bogus]: unknown table")
