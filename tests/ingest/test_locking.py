"""`ingest.locking`: one run at a time, by an exclusive `flock` that waits or names its holder;
and where a journal's lock lives (`ingest.journal.lock_path`)."""

import fcntl

import pytest

from ingest.journal import lock_path
from ingest.locking import LockBusy, exclusive_lock
from ingest.store import Store


def test_the_lock_of_a_local_root_is_in_its_state_folder_else_on_this_machine(tmp_path):
    local = Store.create(str(tmp_path / "data"))
    assert lock_path(local, "publish") == tmp_path / "data" / "_state" / "publish.lock"
    remote = Store.create("memory://fleet-a")
    assert lock_path(remote, "publish").name.startswith("gpufail-publish-")
    assert lock_path(remote, "publish") != lock_path(Store.create("memory://fleet-b"), "publish")


def test_a_run_that_finds_the_lock_held_waits_for_it_and_then_runs(tmp_path):
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
