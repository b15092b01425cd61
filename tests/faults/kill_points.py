"""kill -9 of a gpufail command at chosen points of its work, for the fault-injection tests.

A point is the n-th call, counted from the start of the command, to an operation that changes
something outside the process: a rename, a removal, an fsync, the first write to a file opened
through fsspec (every store write goes through it; a kill after more of its writes leaves the
same partial temporary file), a subprocess (`scontrol`, ...). At point n the
process sends itself SIGKILL just before the operation, as kill -9 from outside would find it:
no `finally`, no `atexit`, no flush. A run without a point counts the operations
(`count_points`). `plan` takes the points (each a boundary between writes: every one, or a
seeded choice of them) and adds kills from outside (SIGKILL from the parent) after delays drawn
by the same seeded generator within a clean run's duration, which land in the computing between
writes. Whatever the machine's speed, a kill at a point lands at the same place; a delayed kill
may land anywhere, which is what it is for, and the tests' assertions hold wherever it lands.

The command runs in a child of a forkserver that has already imported gpufail and its heavy
libraries, so that a killed run costs about what the command's own work costs instead of the
seconds of a fresh interpreter's imports. The child gets this process's environment (with `env`
on top; None unsets) and working folder, calls `setup` (a module-level function, e.g. one that makes a
command's batches small) when given, runs `gpufail.cli.main` with the arguments, and exits with
its status (-9 when killed).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ingest.journal import commit_view
from ingest.store import Store

PRELOAD = [
    "gpufail.cli",
    "gpufail.config",
    "serving.publishing",
    "ingest.collect.daemon",
    "ingest.kernel_log_import",
    "features.runner",
    "models.explain",
    "models.train",
    "models.treeshap",
    "joblib",
    "pdb",
    "serving.predictions",
    "serving.publish",
    "serving.publishers.log",
    "serving.publishers.slurm",
    "lightgbm",
    "polars",
    "pyarrow.parquet",
    "pandas",
]


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@dataclass(frozen=True)
class Kill:
    """Where to kill a run: at a point (from inside), or after a delay (from outside)."""

    point: int | None = None
    after_s: float | None = None

    def __str__(self) -> str:
        return f"point {self.point}" if self.point is not None else f"kill -9 after {self.after_s:.3f}s"


def plan(
    args: Sequence[str],
    kills: int,
    seed: int,
    env: Mapping[str, str | None] | None = None,
    setup: Callable[[], None] | None = None,
    *,
    delays: int = 0,
) -> list[Kill]:
    """Kills of `gpufail ARGS`: `kills` of its kill points (a seeded choice when it has more;
    every one when `GPUFAIL_KILL_EVERY_POINT=1`, for a thorough run), then `delays` kills after
    delays drawn by the same seed within a clean run's duration (more when the command has
    fewer points than `kills`). Runs the command once, cleanly, to count and time it."""
    began = time.monotonic()
    status, points = run(args, env=env, setup=setup)
    took = time.monotonic() - began
    assert status == 0, f"gpufail {' '.join(args)} exited {status} in a clean run"
    rng = random.Random(seed)
    if os.environ.get("GPUFAIL_KILL_EVERY_POINT") == "1" or points <= kills:
        chosen = list(range(1, points + 1))
    else:
        chosen = sorted(rng.sample(range(1, points + 1), kills))
    delayed = sorted(rng.uniform(0.0, took) for _ in range(delays + max(0, kills - points)))
    return [Kill(point=p) for p in chosen] + [Kill(after_s=d) for d in delayed]


def run(
    args: Sequence[str],
    *,
    kill: Kill | None = None,
    env: Mapping[str, str | None] | None = None,
    setup: Callable[[], None] | None = None,
    timeout: float = 120,
) -> tuple[int, int]:
    """Run `gpufail ARGS` in a fresh child, killed as `kill` says. Returns (exit status, kill
    points passed); the status is -9 when killed (a run that ended before a delayed kill
    exits as it would)."""
    kill_at = kill.point if kill is not None else None
    ctx = _context()
    reader, writer = ctx.Pipe(duplex=False)
    # Files by name: the child is forked from the forkserver, which does not have our descriptors.
    with tempfile.TemporaryDirectory(prefix="gpufail-kill-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        child = ctx.Process(
            target=_child,
            args=(list(args), kill_at, _environment(env), os.getcwd(), writer, str(out), str(err), setup),
        )
        child.start()
        writer.close()
        if kill is not None and kill.after_s is not None:
            child.join(kill.after_s)
            # kill(), not os.kill: the child may end between the two calls, and the forkserver
            # (its parent) then reaps it at once; kill() ignores a process that is gone.
            if child.is_alive():
                child.kill()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise TimeoutError(f"gpufail {' '.join(args)} did not finish within {timeout}s")
        # The child's output, through this process's streams (where pytest captures it).
        for path, target in ((out, sys.stdout), (err, sys.stderr)):
            target.write(path.read_text(errors="replace") if path.exists() else "")
            target.flush()
    points = 0
    while reader.poll():
        try:
            points = reader.recv()
        except EOFError:
            break
    reader.close()
    return int(child.exitcode or 0), points


def _environment(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """This process's environment with `env` on top (a None value unsets the variable)."""
    merged: dict[str, str | None] = {**os.environ, **(env or {})}
    return {k: v for k, v in merged.items() if v is not None}


def count_points(
    args: Sequence[str], env: Mapping[str, str | None] | None = None, setup: Callable[[], None] | None = None
) -> int:
    """How many kill points a clean run of `gpufail ARGS` passes (it runs the command)."""
    status, points = run(args, env=env, setup=setup)
    assert status == 0, f"gpufail {' '.join(args)} exited {status} in a clean run"
    return points


def _child(
    args: list[str],
    kill_at: int | None,
    env: dict[str, str],
    cwd: str,
    writer: Any,
    out: str,
    err: str,
    setup: Callable[[], None] | None,
) -> None:
    # This process's environment, as a subprocess would get it (not the forkserver's, from its start).
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for path, fd in ((out, 1), (err, 2)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    if setup is not None:
        setup()
    counter = {"n": 0}
    counting = threading.Lock()  # writes on several threads (features) count one at a time

    def point() -> None:
        with counting:
            counter["n"] += 1
            if kill_at is not None and counter["n"] >= kill_at:
                writer.send(counter["n"])
                os.kill(os.getpid(), signal.SIGKILL)

    def counted(fn):
        def wrapper(*a, **kw):
            if not _numba_cache(a):
                point()
            return fn(*a, **kw)

        return wrapper

    for name in ("rename", "replace", "remove", "unlink", "fsync"):
        setattr(os, name, counted(getattr(os, name)))
    subprocess.run = counted(subprocess.run)
    from fsspec.implementations.local import LocalFileOpener

    plain_write = LocalFileOpener.write

    # Marked on the file itself: an id() set would miss a new file that reuses a closed one's id.
    def first_write_counted(self: Any, *a: Any, **kw: Any) -> Any:
        if not getattr(self, "_kill_point_counted", False):
            self._kill_point_counted = True
            point()
        return plain_write(self, *a, **kw)

    LocalFileOpener.write = first_write_counted

    from gpufail.cli import main

    sys.argv = ["gpufail", *args]
    try:
        main()
    except SystemExit as exc:
        writer.send(counter["n"])
        raise SystemExit(exc.code if isinstance(exc.code, int) else 1) from None
    writer.send(counter["n"])


def _numba_cache(args: tuple[Any, ...]) -> bool:
    """Whether an operation writes numba's cache of compiled kernels: only a run that finds the
    cache empty does, so counting it would move every later point between the planning run and
    the killed ones."""
    return any(isinstance(a, str | os.PathLike) and str(a).endswith((".nbi", ".nbc")) for a in args)


def visible_files(root: Path, dataset: str) -> list[Path]:
    """The part files readers see (hidden temporary and staged files excluded)."""
    return sorted(p for p in (root / dataset).rglob("*.parquet") if not p.name.startswith((".", "_")))


def hidden_files(root: Path) -> list[str]:
    """Hidden files anywhere under the data root (a write in flight, or one a crash cut short),
    but the hidden names a finished commit keeps for readers while its replaced files linger
    (`linger_s` in `ingest.journal`: compaction, a features rebuild)."""
    kept = lingering(root)
    return sorted(name for name in (str(p.relative_to(root)) for p in root.rglob(".*")) if name not in kept)


def lingering(root: Path) -> set[str]:
    """What the commits readers still apply keep for them (`ingest.journal.commit_view`): the
    hidden names of new files whose visible name exists (the commit finished, its replaced
    files linger), and the replaced files themselves, which carry earlier commits' hidden names."""
    view = commit_view(Store.open(str(root)))
    kept = {
        f"{folder}/{hidden}"
        for folder, names in view.added.items()
        for final, hidden in names.items()
        if (root / folder / final).exists()
    }
    return kept | {relative for relative in view.removed if (root / relative).exists()}
