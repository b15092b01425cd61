"""kill -9 of a gpufail command at chosen points of its work, for the fault-injection tests.

A point is the n-th call, counted from the start of the command, to an operation that changes
something outside the process: a rename, a removal, an fsync, a write to a file opened through
fsspec (every store write goes through it), a subprocess (`scontrol`, ...). At point n the
process sends itself SIGKILL just before the operation, as kill -9 from outside would find it:
no `finally`, no `atexit`, no flush. A run without a point counts the operations
(`count_points`), so a test can draw its points among them with a seeded generator.

The command runs in a child of a forkserver that has already imported gpufail and its heavy
libraries, so that a dozen killed runs cost less than a second each instead of the seconds of
a fresh interpreter's imports. The child gets the environment and working folder given, runs
`gpufail.cli.main` with the arguments, and exits with its status (-9 when killed).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PRELOAD = [
    "gpufail.cli",
    "gpufail.config",
    "gpufail.publishing",
    "features.build",
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


def run(
    args: Sequence[str], *, kill_at: int | None = None, env: Mapping[str, str] | None = None, timeout: float = 120
) -> tuple[int, int]:
    """Run `gpufail ARGS` in a fresh child; with `kill_at`, SIGKILL it at that point. Returns
    (exit status, points counted before the kill or the end)."""
    ctx = _context()
    reader, writer = ctx.Pipe(duplex=False)
    # Files by name: the child is forked from the forkserver, which does not have our descriptors.
    with tempfile.TemporaryDirectory(prefix="gpufail-kill-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        child = ctx.Process(
            target=_child, args=(list(args), kill_at, dict(env or {}), os.getcwd(), writer, str(out), str(err))
        )
        child.start()
        writer.close()
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


def count_points(args: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """How many kill points a clean run of `gpufail ARGS` passes (it runs the command)."""
    status, points = run(args, env=env)
    assert status == 0, f"gpufail {' '.join(args)} exited {status} in a clean run"
    return points


def _child(
    args: list[str], kill_at: int | None, env: dict[str, str], cwd: str, writer: Any, out: str, err: str
) -> None:
    os.environ.update(env)
    os.chdir(cwd)
    for path, fd in ((out, 1), (err, 2)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    counter = {"n": 0}

    def point() -> None:
        counter["n"] += 1
        if kill_at is not None and counter["n"] >= kill_at:
            writer.send(counter["n"])
            os.kill(os.getpid(), signal.SIGKILL)

    def counted(fn):
        def wrapper(*a, **kw):
            point()
            return fn(*a, **kw)

        return wrapper

    for name in ("rename", "replace", "remove", "unlink", "fsync"):
        setattr(os, name, counted(getattr(os, name)))
    subprocess.run = counted(subprocess.run)
    from fsspec.implementations.local import LocalFileOpener

    LocalFileOpener.write = counted(LocalFileOpener.write)

    from gpufail.cli import main

    sys.argv = ["gpufail", *args]
    try:
        main()
    except SystemExit as exc:
        writer.send(counter["n"])
        raise SystemExit(exc.code if isinstance(exc.code, int) else 1) from None
    writer.send(counter["n"])


def visible_files(root: Path, dataset: str) -> list[Path]:
    """The part files readers see (hidden temporary and staged files excluded)."""
    return sorted(p for p in (root / dataset).rglob("*.parquet") if not p.name.startswith((".", "_")))
