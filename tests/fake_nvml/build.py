"""Compile the fake libnvidia-ml.so.1 and load it where pynvml will find it."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

LIBRARY_NAME = "libnvidia-ml.so.1"
SOURCE = Path(__file__).with_name("fake_nvml.c")


class NoCompiler(RuntimeError):
    """No C compiler on this machine, so the fake library cannot be built."""


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile fake_nvml.c into `out_dir/libnvidia-ml.so.1` (soname libnvidia-ml.so.1)."""
    compiler = find_compiler()
    if compiler is None:
        raise NoCompiler("no C compiler: set CC or install gcc to build the fake libnvidia-ml.so.1")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIBRARY_NAME
    command = [compiler, "-shared", "-fPIC", "-O2", "-std=c11", "-Wall", "-Wextra"]
    command += [f"-Wl,-soname,{LIBRARY_NAME}", "-o", str(target), str(SOURCE)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the fake NVML library failed: {' '.join(command)}\n{result.stderr}")
    return target


class FakeNvml:
    """The fake library loaded in this process, with its test-only counters."""

    def __init__(self, library: Path) -> None:
        # Once a library with soname libnvidia-ml.so.1 is loaded, the dynamic loader hands the same
        # object to pynvml's own CDLL("libnvidia-ml.so.1"), so pynvml's loading code runs unchanged.
        self.path = library
        self._lib = ctypes.CDLL(str(library))
        self._lib.fake_nvml_call_count.restype = ctypes.c_ulonglong
        self._lib.fake_nvml_call_count.argtypes = [ctypes.c_char_p]
        self._lib.fake_nvml_last_wait_timeout_ms.restype = ctypes.c_int
        import pynvml

        if pynvml.nvmlLib is not None and getattr(pynvml.nvmlLib, "_handle", None) != self._lib._handle:
            raise RuntimeError("pynvml already loaded another libnvidia-ml.so.1 in this process")

    def call_count(self, function: str) -> int:
        """How often the collector called an NVML function since the scenario was loaded."""
        return int(self._lib.fake_nvml_call_count(function.encode()))

    def last_wait_timeout_ms(self) -> int:
        """The timeout of the last nvmlEventSetWait_v2 call; -1 if there was none."""
        return int(self._lib.fake_nvml_last_wait_timeout_ms())
