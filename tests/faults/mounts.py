"""Small file systems for fault tests: a tmpfs of a given size (writes beyond it fail with
ENOSPC, as on a full disk) that can be remounted read-only (EROFS, which stops root too, unlike
chmod). Mounting needs root and a kernel or container that permits it; elsewhere the tests that
need it are skipped, with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` mounted at `path` (created), unmounted on exit."""
    if shutil.which("mount") is None:
        pytest.skip("needs the `mount` command to mount a tmpfs")
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs (ENOSPC and read-only faults)")
    path.mkdir(parents=True, exist_ok=True)
    _mount_or_skip(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)])
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def remount(path: Path, mode: str) -> None:
    """Remount the tmpfs at `path` read-only ("ro") or writable ("rw")."""
    _mount_or_skip(["mount", "-o", f"remount,{mode}", str(path)])


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def fill_leaving(path: Path, free: int) -> Path:
    """Fill the file system of `path` with one file until `free` bytes are left; delete the
    file to free the space again."""
    filler = path / "filler"
    with open(filler, "wb") as fh:
        remaining = free_bytes(path) - free
        block = b"\0" * (1 << 16)
        while remaining > 0:
            remaining -= fh.write(block[: min(len(block), remaining)])
    return filler


def _mount_or_skip(command: list[str]) -> None:
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"`{' '.join(command)}` is not permitted here: {done.stderr.strip()}")
