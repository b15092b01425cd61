"""`gpufail publish` with `[publish] policy = "cost"`: the settings, the hint state kept with the
policy state (and through --reset-breaker), and bad settings refused at load with one line."""

import json
from datetime import UTC, datetime, timedelta

import pytest

from gpufail.config import load_settings
from ingest.errors import ConfigError, InputError
from ingest.store import Store
from serving.predictions import newest_snapshot, write_snapshot
from serving.publish import read_audit
from serving.publishing import make_publisher, publish_latest, read_policy_state, write_policy_state
from tests.serving.test_predictions import scored


@pytest.fixture
def store(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    frame = scored(risk=0.01)
    frame.loc[frame["node"] == "n0", "risk"] = 0.3
    write_snapshot(store, frame, now=datetime(2026, 1, 6, tzinfo=UTC))
    return store


@pytest.fixture
def settings(tmp_path):
    now = datetime.now(UTC)
    # n0 runs 2 of the 512 GPUs of a job that checkpointed 2 hours ago.
    nodes = {"n0": 2, **{f"x{i}": 2 for i in range(255)}}
    doc = {
        "jobs": [
            {
                "id": "j1",
                "nodes": nodes,
                "start": (now - 5 * timedelta(hours=1)).isoformat(),
                "checkpoint_at": (now - timedelta(hours=2)).isoformat(),
            }
        ]
    }
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(doc))
    config = tmp_path / "gpufail.toml"
    config.write_text(f'[publish]\npolicy = "cost"\njobs_url = "{path}"\n[publish.cost]\ncheckpoint_time = "2m"\n')
    return load_settings(config, environ={}).publish


def live(settings):
    return settings.options(target="log", dry_run=False, shadow=False)


def test_a_cost_run_tells_the_job_and_keeps_the_hint_with_the_policy_state(store, settings):
    latest = newest_snapshot(store).frame
    outcome, _ = publish_latest(store, latest, live(settings))
    hint = next(r for r in outcome.rows if r.action == "checkpoint")
    assert hint.jobs == ("j1",) and hint.result == "recorded: checkpoint hint to job j1 (no scheduler)"
    saved = store.read_state("publish-log")
    assert set(saved["checkpoint_hints"]) == {"j1"}
    audit = read_audit(store.path("actions"), fs=store.fs)
    assert "checkpoint" in set(audit["action"]) and set(audit["policy"]) == {"cost"}
    # The next run within the checkpoint interval holds the hint.
    again, _ = publish_latest(store, latest, live(settings))
    assert [r.action for r in again.rows if r.jobs == ("j1",) and r.action.startswith("checkpoint")] == [
        "checkpoint_held"
    ]
    # --reset-breaker and --adopt rewrite the policy state: the hints stay.
    write_policy_state(store, "publish-log", read_policy_state(store, "publish-log"))
    assert store.read_state("publish-log")["checkpoint_hints"] == saved["checkpoint_hints"]


def test_a_dry_run_does_not_advance_the_hint_state(store, settings):
    publish_latest(store, newest_snapshot(store).frame, settings.options(target="log", dry_run=True))
    assert store.read_state("publish-log") is None


def test_a_broken_hint_state_is_one_line_naming_the_file(store, settings):
    store.write_state(
        "publish-log", {"version": 1, "nodes": {}, "breaker": {}, "checkpoint_hints": ["j1"], "audit": None}
    )
    with pytest.raises(InputError, match=r"_state/publish-log.json: checkpoint_hints is not"):
        publish_latest(store, newest_snapshot(store).frame, live(settings))


def test_the_settings_reach_the_policy_and_the_publishers(tmp_path, settings):
    options = live(settings)
    actions = options.actions
    assert actions is not None
    assert actions.policy == "cost" and actions.cost.checkpoint_time == timedelta(minutes=2)
    store = Store.create(str(tmp_path / "d"))
    slurm = make_publisher(
        settings.model_copy(
            update={"slurm_checkpoint_signal": "SIGTERM", "slurm_standby_users": ["alice"]}
        ).publisher_config(),
        "slurm",
        store,
    )
    assert (slurm.checkpoint_signal, slurm.standby_users) == ("SIGTERM", ("alice",))
    assert make_publisher(options.publisher, "log", store).jobs_url == settings.jobs_url


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[publish]\npolicy = "cheapest"\n', r"\[publish\] policy.*'tiers' or 'cost'"),
        ("[publish]\nplacement_levels = -1\n", r"\[publish\] placement_levels.*greater than or equal to 0"),
        ('[publish]\nslurm_checkpoint_signal = "usr 1"\n', r"\[publish\] slurm_checkpoint_signal"),
        ("[publish]\nslurm_standby_users = []\n", r"\[publish\] slurm_standby_users"),
        ("[publish.cost]\navoid_share = 2\n", r"\[publish\] cost.avoid_share.*less than or equal to 1"),
        ('[publish.cost]\nhorizon = "0h"\n', r"\[publish\] cost.horizon: expected a duration above zero"),
        ("[publish.cost]\nrestart = 1\n", r"\[publish\] cost.restart: unknown key"),
    ],
)
def test_bad_cost_settings_are_refused_at_load_with_one_line(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        load_settings(path, environ={})
    assert "\n" not in str(err.value)
