"""The publish flow around the policy: one run at a time, and a state and audit committed so
that a run stopped at any point records its decisions once or not at all."""

from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import pytest

from gpufail.config import load_settings
from ingest.journal import Journal
from ingest.store import Store
from serving.predictions import newest_snapshot, write_snapshot
from serving.publish import read_audit
from serving.publishing import publish_latest, publish_mode
from tests.ingest.test_journal import killed_process
from tests.serving.test_predictions import scored

SETTINGS = load_settings(None, environ={}).publish


def test_publish_mode_a_dry_run_wins_over_shadow():
    assert publish_mode(True, True) == "dry-run"
    assert publish_mode(False, True) == "shadow"
    assert publish_mode(False, False) == "live"


@pytest.fixture
def store(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    frame = scored(risk=0.1)
    frame.loc[0, "risk"] = 0.9  # n0 is raised to drain_now
    write_snapshot(store, frame, now=datetime(2026, 1, 6, tzinfo=UTC))
    return store


def _publish(store):
    latest = newest_snapshot(store).frame
    return publish_latest(store, latest, SETTINGS.options(target="log", dry_run=False, shadow=False))


def hidden(store):
    return sorted(p.name for p in Path(store.path()).rglob(".*"))


def killed_after_the_commit(monkeypatch):
    """The run dies right after its commit (the state's rename), before the audit file's."""
    killed_process(monkeypatch)
    real = Journal._finish

    def finish(self, record):
        if record.get("files") and self.name.startswith("publish-"):
            raise KeyboardInterrupt
        return real(self, record)

    monkeypatch.setattr(Journal, "_finish", finish)


def test_a_run_killed_after_its_commit_counts_whole_and_the_next_one_finishes_it(store, monkeypatch):
    killed_after_the_commit(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        _publish(store)
    monkeypatch.undo()
    assert [n.split(".")[1] for n in hidden(store)] == ["pending"]  # not yet renamed,
    assert len(read_audit(store.path("actions"))) == 2  # but committed: its rows count
    assert store.read_state("publish-log")["nodes"]["c1/n0"]["applied"] == "drain_now"
    _, path = _publish(store)
    rows = read_audit(store.path("actions"))
    assert len(rows) == 4 and list(rows["action"]).count("raise") == 1  # 2 nodes x 2 runs
    assert Path(path).exists() and hidden(store) == []


def test_a_run_killed_before_its_commit_leaves_nothing_and_the_rerun_is_a_clean_run(store, monkeypatch):
    real = Store.write_state

    def stopped(self, name, state, **options):
        if name == "publish-log":
            raise KeyboardInterrupt
        return real(self, name, state, **options)

    monkeypatch.setattr(Store, "write_state", stopped)
    killed_process(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        _publish(store)
    monkeypatch.undo()
    assert [n.split(".")[1] for n in hidden(store)] == ["pending"]  # written, never committed
    assert read_audit(store.path("actions")).empty and store.read_state("publish-log") is None
    _publish(store)
    rows = read_audit(store.path("actions"))
    assert sorted(zip(rows["node"], rows["action"], strict=True)) == [("n0", "raise"), ("n1", "keep")]
    assert hidden(store) == []


def test_a_shadow_run_never_removes_what_a_live_run_committed(store, monkeypatch):
    killed_after_the_commit(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        _publish(store)
    monkeypatch.undo()
    publish_latest(store, newest_snapshot(store).frame, SETTINGS.options(target="log", dry_run=False, shadow=True))
    assert len(hidden(store)) == 1  # the live run's, kept
    _publish(store)
    rows = read_audit(store.path("actions"))
    assert pd.Series(rows["mode"]).value_counts().to_dict() == {"live": 4, "shadow": 2}
    assert hidden(store) == []


def test_a_dry_run_records_its_decisions_and_leaves_the_state_as_it_was(store):
    _publish(store)
    before = store.read_state("publish-log")
    publish_latest(store, newest_snapshot(store).frame, SETTINGS.options(target="log", dry_run=True, shadow=False))
    assert store.read_state("publish-log") == before
    assert pd.Series(read_audit(store.path("actions"))["mode"]).value_counts().to_dict() == {"live": 2, "dry-run": 2}


def test_reset_breaker_closes_it_under_the_lock_and_keeps_the_rest_of_the_state(store):
    from click.testing import CliRunner

    from gpufail.cli import cli
    from serving.publishing import policy_journal

    _publish(store)
    state = store.read_state("publish-log")
    state["breaker"]["tripped_at"], state["breaker"]["reason"] = "2026-01-06T00:00:00+00:00", "too many"
    store.write_state("publish-log", state)
    args = ["publish", "--data", store.root, "--to", "log", "--no-dry-run", "--reset-breaker", "--lock-wait", "0"]
    with policy_journal(store, "publish-log-shadow"):  # any publish run holds the one lock
        busy = CliRunner().invoke(cli, args)
    assert busy.exit_code != 0 and "another `gpufail publish` holds the lock" in str(busy.exception)
    done = CliRunner().invoke(cli, args)
    assert (
        done.exit_code == 0 and "circuit breaker reset; it was open since 2026-01-06 00:00Z (too many)" in done.output
    )
    after = store.read_state("publish-log")
    assert after["breaker"]["tripped_at"] is None and after["nodes"] == state["nodes"]
    assert len(read_audit(store.path("actions"))) == 2
