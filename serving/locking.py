"""One run at a time: an exclusive `flock` on a local file, for the jobs that must not overlap
(`gpufail nightly`, `gpufail publish`).

The kernel releases a `flock` when its holder dies, kill -9 included, so a crash never leaves a
stale lock behind and nobody has to delete a lock file by hand. The holder writes its pid and
start time into the file, so that a refused run can say who holds it.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from ingest.errors import GpufailError


class LockBusy(GpufailError):
    """Another run holds the lock (after waiting as long as allowed)."""


@contextmanager
def exclusive_lock(
    path: Path,
    what: str,
    *,
    wait_s: float = 0.0,
    error: type[GpufailError] = LockBusy,
    poll_s: float = 0.1,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created with its folder if needed) while the block
    runs. When another process holds it, try again every `poll_s` for up to `wait_s` seconds,
    then raise `error` naming `what` runs, the lock file and its holder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = clock() + max(wait_s, 0.0)
    with open(path, "a+") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if clock() >= deadline:
                    holder = _holder(path)
                    waited = f"; waited {wait_s:g}s" if wait_s > 0 else ""
                    raise error(
                        f"another {what} holds the lock {path}{f' ({holder})' if holder else ''}{waited}; "
                        "runs must not overlap (wait for it to finish)"
                    ) from None
                sleep(poll_s)
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(f"pid {os.getpid()} since {datetime.now(UTC):%Y-%m-%d %H:%M:%S}Z\n")
            fh.flush()
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
