"""The publish flow around the policy: one run at a time, and a state and audit committed so
that a run stopped at any point records its decisions once or not at all."""

from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import pytest

import serving.publish
from gpufail.config import load_settings
from ingest.store import Store
from serving.locking import LockBusy, exclusive_lock
from serving.predictions import newest_snapshot, write_snapshot
from serving.publish import read_audit
from serving.publishing import publish_latest, publish_lock_path, publish_mode
from tests.cli import gpufail
from tests.serving.test_predictions import scored

SETTINGS = load_settings(None, environ={}).publish


def test_publish_mode_a_dry_run_wins_over_shadow():
    assert publish_mode(True, True) == "dry-run"
    assert publish_mode(False, True) == "shadow"
    assert publish_mode(False, False) == "live"


def test_the_lock_of_a_local_root_is_in_its_state_folder_else_on_this_machine(tmp_path):
    local = Store.create(str(tmp_path / "data"))
    assert publish_lock_path(local) == tmp_path / "data" / "_state" / "publish.lock"
    remote = Store.create("memory://fleet-a")
    assert publish_lock_path(remote).name.startswith("gpufail-publish-")
    assert publish_lock_path(remote) != publish_lock_path(Store.create("memory://fleet-b"))


def test_a_run_that_finds_the_lock_held_waits_for_it_and_then_runs(tmp_path):
    import fcntl

    path = tmp_path / "x.lock"
    waited: list[float] = []
    with exclusive_lock(path, "`x`", wait_s=5, sleep=waited.append):
        pass
    assert waited == []  # free: taken at once
    # Held through another open file, as by another process: polled until it is released.
    with open(path, "a+") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)

        def release(seconds: float) -> None:
            waited.append(seconds)
            fcntl.flock(other, fcntl.LOCK_UN)

        with exclusive_lock(path, "`x`", wait_s=5, sleep=release):
            assert waited == [0.1]


def test_a_run_refused_by_the_lock_names_the_file_and_its_holder(tmp_path):
    path = tmp_path / "x.lock"
    clock = iter([0.0, 0.5, 1.0, 1.5])
    second = exclusive_lock(path, "`x`", wait_s=1.0, sleep=lambda _: None, clock=lambda: next(clock))
    with exclusive_lock(path, "`x`"), pytest.raises(LockBusy) as refused, second:
        pass
    assert str(refused.value).startswith(f"another `x` holds the lock {path} (pid ")
    assert "; waited 1s; runs must not overlap" in str(refused.value)


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


def test_a_run_stopped_after_its_commit_is_finished_by_the_next_one(store, monkeypatch):
    real = serving.publish.finish_audit
    monkeypatch.setattr(serving.publish, "finish_audit", _raise)
    with pytest.raises(KeyboardInterrupt):
        _publish(store)
    assert read_audit(store.path("actions")).empty  # staged, not yet visible
    assert store.read_state("publish-log")["nodes"]["c1/n0"]["applied"] == "drain_now"  # committed
    monkeypatch.setattr(serving.publish, "finish_audit", real)
    _, path = _publish(store)
    rows = read_audit(store.path("actions"))
    assert len(rows) == 4 and list(rows["action"]).count("raise") == 1  # 2 nodes x 2 runs
    assert Path(path).exists() and not list(Path(store.path("actions")).rglob(".pending-*"))


def test_a_run_stopped_before_its_commit_leaves_nothing_and_the_rerun_is_a_clean_run(store, monkeypatch):
    real = Store.write_state

    def stopped(self, name, state):
        if name == "publish-log":
            raise KeyboardInterrupt
        return real(self, name, state)

    monkeypatch.setattr(Store, "write_state", stopped)
    with pytest.raises(KeyboardInterrupt):
        _publish(store)
    assert list(Path(store.path("actions")).rglob(".pending-*"))  # staged, never committed
    monkeypatch.setattr(Store, "write_state", real)
    _publish(store)
    rows = read_audit(store.path("actions"))
    assert sorted(zip(rows["node"], rows["action"], strict=True)) == [("n0", "raise"), ("n1", "keep")]
    assert not list(Path(store.path("actions")).rglob(".pending-*"))


def test_a_shadow_run_never_removes_what_a_live_run_committed(store, monkeypatch):
    real = serving.publish.finish_audit
    monkeypatch.setattr(serving.publish, "finish_audit", _raise)
    with pytest.raises(KeyboardInterrupt):
        _publish(store)
    monkeypatch.setattr(serving.publish, "finish_audit", real)
    publish_latest(store, newest_snapshot(store).frame, SETTINGS.options(target="log", dry_run=False, shadow=True))
    assert len(list(Path(store.path("actions")).rglob(".pending-*"))) == 1  # the live run's, kept
    _publish(store)
    rows = read_audit(store.path("actions"))
    assert pd.Series(rows["mode"]).value_counts().to_dict() == {"live": 4, "shadow": 2}


def _raise(*args, **kwargs):
    raise KeyboardInterrupt


def test_reset_breaker_closes_it_under_the_lock_and_keeps_the_record_of_the_last_run(store):
    from serving.publishing import publish_lock

    _publish(store)
    state = store.read_state("publish-log")
    state["breaker"]["tripped_at"], state["breaker"]["reason"] = "2026-01-06T00:00:00+00:00", "too many"
    store.write_state("publish-log", state)
    args = ["publish", "--data", store.root, "--to", "log", "--no-dry-run", "--reset-breaker", "--lock-wait", "0"]
    with publish_lock(store):
        busy = gpufail(*args)
    assert busy.returncode == 2 and "holds the lock" in busy.stderr
    done = gpufail(*args)
    assert done.returncode == 0, done.stderr
    assert "circuit breaker reset; it was open since 2026-01-06 00:00Z (too many)" in done.stdout
    after = store.read_state("publish-log")
    assert after["breaker"]["tripped_at"] is None and after["audit"] == state["audit"] is not None
