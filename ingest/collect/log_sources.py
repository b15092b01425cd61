"""Where the live kernel-log collector reads lines from: `/dev/kmsg`, the systemd journal, or
plain log files being appended to (syslog and its rotations).

Each source is a `LogSource`: `read(cursor, max_lines)` returns the complete lines written
after `cursor` (None: from the start of what the source still holds), at most `max_lines` of
them, and the cursor after them. A cursor is a small JSON-able dict that the collector stores
in the data root once the events it covers are flushed; the source never stores anything.

Every line handed out is in a form `ingest.kernel_log_parser` parses (a kmsg record, or a journal
entry rewritten as `<ISO time> <message>`), so the one parser serves the batch and live paths.
Failures to read become one `CollectorError` naming the source.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from ingest.collect.base import CollectorError
from ingest.line_stream import CappedLines

Cursor = dict[str, Any]

# One read of /dev/kmsg returns one record; the kernel caps a record at 1 KiB of text plus the
# dictionary lines, so 8 KiB never truncates one (a short buffer would give EINVAL).
KMSG_READ_SIZE = 8192
# A file is read in chunks of this size; only complete lines are handed out.
FILE_CHUNK = 1 << 20
# The first bytes of a file, hashed, tell "the same file grown" from "a new file at the same
# inode" (inodes are reused) and from a file truncated and rewritten (copytruncate).
HEAD_BYTES = 256


@dataclass
class LogChunk:
    """Lines read from a source in one call, and the cursor just after the last of them."""

    lines: list[str]
    cursor: Cursor
    lost: int = 0
    """Records the source overwrote before they could be read (kmsg ring-buffer overruns)."""
    boot_time: datetime | None = None
    """Wall-clock time of boot, for sources whose stamps count from boot (kmsg, `[uptime]`)."""
    exhausted: bool = True
    """False when `max_lines` stopped the read before the end of what is available."""
    cut: int = 0
    """Lines longer than `ingest.line_stream.MAX_LINE_BYTES`, handed out cut to that length."""


class LogSource(Protocol):
    name: str
    """"kmsg", "journal" or "files": the `source` column of the rows is `collect:<name>`."""

    def read(self, cursor: Cursor | None, max_lines: int) -> LogChunk:
        """Complete lines after `cursor`, at most `max_lines`. Raise only `CollectorError`."""
        ...

    def close(self) -> None: ...


# -- /dev/kmsg -----------------------------------------------------------------------------


def system_boot_time() -> datetime:
    """When this machine booted: now minus CLOCK_MONOTONIC, the clock kmsg stamps count in."""
    now = datetime.now(UTC)
    return now - timedelta(seconds=time.clock_gettime(time.CLOCK_MONOTONIC))


def read_boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str:
    """The kernel's id of the current boot; kmsg sequence numbers restart with every boot."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "unknown"


class KmsgSource:
    """Records of `/dev/kmsg`, read without blocking.

    The cursor is `{"boot_id", "seq"}`: sequence numbers only grow within one boot, so records
    at or below the cursor's are skipped, and a cursor from an earlier boot is ignored. Reading
    stops at EAGAIN (nothing new). EPIPE means the ring buffer overwrote records we had not
    read; the gap in sequence numbers says exactly how many, they are counted as `lost`, and
    reading goes on with the oldest record still there.
    """

    name = "kmsg"

    def __init__(
        self,
        path: str = "/dev/kmsg",
        *,
        boot_id: Callable[[], str] = read_boot_id,
        boot_time: Callable[[], datetime] = system_boot_time,
        open_device: Callable[[str], KmsgDevice] | None = None,
    ) -> None:
        self.path = path
        self._boot_id = boot_id
        self._boot_time = boot_time
        self._open_device = open_device or FdDevice
        self._device: KmsgDevice | None = None
        self._last_seq: int | None = None

    def read(self, cursor: Cursor | None, max_lines: int) -> LogChunk:
        boot_id = self._boot_id()
        after = cursor.get("seq") if cursor and cursor.get("boot_id") == boot_id else None
        device = self._open()
        lines: list[str] = []
        lost = 0
        last = self._last_seq if self._last_seq is not None else after
        exhausted = True
        while True:
            if len(lines) >= max_lines:
                exhausted = False
                break
            try:
                raw = device.read(KMSG_READ_SIZE)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue  # overwritten records: the sequence gap of the next record counts them
            except InterruptedError:
                continue
            except OSError as exc:
                raise CollectorError(f"kernel-log collector: reading {self.path} failed ({exc.strerror})") from None
            if not raw:
                break
            record = raw.decode("utf-8", "replace")
            header, _, text = record.partition(";")
            seq = _kmsg_seq(header)
            if seq is None:
                continue  # not a kmsg record; the parser would reject it anyway
            if after is not None and seq <= after:
                continue
            if last is not None and seq > last + 1:
                lost += seq - last - 1
            last = seq
            # Continuation lines (" SUBSYSTEM=pci", " DEVICE=+pci:...") follow the message;
            # the message itself has its newlines escaped as \x0a by the kernel.
            lines.append(f"{header};{text.split(chr(10), 1)[0]}")
        self._last_seq = last
        new_cursor = {"boot_id": boot_id, "seq": last} if last is not None else dict(cursor or {})
        return LogChunk(lines, new_cursor, lost=lost, boot_time=self._boot_time(), exhausted=exhausted)

    def _open(self) -> KmsgDevice:
        if self._device is None:
            try:
                self._device = self._open_device(self.path)
            except OSError as exc:
                raise CollectorError(
                    f"kernel-log collector: cannot open {self.path} ({exc.strerror}); expected a readable "
                    "/dev/kmsg (root, or CAP_SYSLOG with kernel.dmesg_restrict=1)"
                ) from None
        return self._device

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
            self._device = None


class KmsgDevice(Protocol):
    """The calls `KmsgSource` makes on /dev/kmsg: one record per `read`, BlockingIOError when
    there is nothing new, BrokenPipeError when records were overwritten."""

    def read(self, size: int) -> bytes: ...

    def close(self) -> None: ...


class FdDevice:
    """/dev/kmsg opened without blocking."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

    def read(self, size: int) -> bytes:
        return os.read(self._fd, size)

    def close(self) -> None:
        os.close(self._fd)


def _kmsg_seq(header: str) -> int | None:
    fields = header.split(",", 3)
    if len(fields) < 3 or not fields[1].isdigit():
        return None
    return int(fields[1])


# -- the systemd journal -------------------------------------------------------------------


class JournalSource:
    """Kernel messages of the systemd journal, through `journalctl -o json`.

    The cursor is journald's own `__CURSOR` of the last entry read, passed back with
    `--after-cursor`. Kernel entries are selected with `_TRANSPORT=kernel` rather than `-k`,
    because `-k` implies `-b` (this boot only) and would skip what the previous boot logged
    after our last read; without a cursor (the first run) only the current boot is read.
    Each entry becomes `<ISO time> <MESSAGE>`, stamped with its `__REALTIME_TIMESTAMP`.
    """

    name = "journal"

    def __init__(self, *, executable: str = "journalctl", timeout_s: float = 60.0) -> None:
        self.executable = executable
        self.timeout_s = timeout_s

    def read(self, cursor: Cursor | None, max_lines: int) -> LogChunk:
        exe = shutil.which(self.executable)
        if exe is None:
            raise CollectorError(
                f"kernel-log collector: {self.executable} not found; expected systemd's journalctl on PATH"
            )
        args = [exe, "_TRANSPORT=kernel", "--output=json", "--no-pager", "--quiet"]
        after = cursor.get("cursor") if cursor else None
        args += [f"--after-cursor={after}"] if after else ["--boot"]
        lines: list[str] = []
        last_cursor = after
        exhausted = True
        deadline = time.monotonic() + self.timeout_s
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            for line_no, raw in enumerate(proc.stdout, start=1):
                if len(lines) >= max_lines:
                    exhausted = False
                    break
                if time.monotonic() > deadline:
                    exhausted = False  # the rest comes next time, from the cursor
                    break
                entry = _journal_entry(raw, line_no, self.executable)
                last_cursor = entry.get("__CURSOR", last_cursor)
                line = _journal_line(entry)
                if line is not None:
                    lines.append(line)
            if not exhausted:
                proc.terminate()
            stderr = proc.stderr.read()
            status = proc.wait()
        if exhausted and status != 0:
            raise CollectorError(
                f"kernel-log collector: {' '.join(args[1:])} exited with status {status}: "
                f"{stderr.strip()[:300] or 'no message'}"
                + (
                    "; if the cursor is the problem, delete the kernel-log entry of _state/collect-<node>.json"
                    if after
                    else ""
                )
            )
        new_cursor = {"cursor": last_cursor} if last_cursor else {}
        return LogChunk(lines, new_cursor, exhausted=exhausted)

    def close(self) -> None:
        pass


def _journal_entry(raw: str, line_no: int, executable: str) -> dict[str, Any]:
    try:
        entry = json.loads(raw)
    except ValueError:
        entry = None
    if not isinstance(entry, dict):
        raise CollectorError(
            f"kernel-log collector: {executable} output line {line_no}: not a JSON object "
            f"({raw.strip()[:80]!r}); expected `journalctl -o json` entries"
        )
    return entry


def _journal_line(entry: dict[str, Any]) -> str | None:
    """`<ISO time> <message>` for an entry with a message and a time, else None."""
    message = entry.get("MESSAGE")
    if isinstance(message, list):  # journald stores non-UTF-8 messages as a byte array
        message = bytes(b for b in message if isinstance(b, int) and 0 <= b < 256).decode("utf-8", "replace")
    stamp = entry.get("__REALTIME_TIMESTAMP")
    if not isinstance(message, str) or not str(stamp or "").isdigit():
        return None
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=int(str(stamp)))
    return f"{moment.isoformat()} {message.splitlines()[0] if message else ''}"


# -- plain files ---------------------------------------------------------------------------


@dataclass
class _FilePosition:
    dev: int
    ino: int
    offset: int
    head: str  # sha256 of the first HEAD_BYTES bytes, as far as they were read

    def as_json(self) -> dict[str, Any]:
        return {"dev": self.dev, "ino": self.ino, "offset": self.offset, "head": self.head}


class FileSource:
    """Plain log files being appended to (`/var/log/kern.log`, `/var/log/syslog`).

    The cursor holds, per configured path, the device and inode of the file read, the byte
    offset reached and a hash of the file's first bytes. Only complete lines are read: a line
    still being written waits for its newline. When the path is rotated (renamed to
    `kern.log.1`, a new `kern.log` created), the rest of the old file is read first from the
    rotated copy in the same folder (found by inode), then the new file from its start. A file
    truncated in place (copytruncate) or replaced by another is read from its start. Rotated
    copies already compressed cannot be finished; `gpufail ingest kernel-log` reads those.
    """

    name = "files"

    def __init__(self, paths: Sequence[str]) -> None:
        if not paths:
            raise ValueError("FileSource needs at least one path")
        self.paths = list(paths)
        self._cut = 0  # lines cut in the current `read`

    def read(self, cursor: Cursor | None, max_lines: int) -> LogChunk:
        positions: dict[str, Any] = dict((cursor or {}).get("files", {}))
        lines: list[str] = []
        exhausted = True
        self._cut = 0
        for path in self.paths:
            budget = max_lines - len(lines)
            if budget <= 0:
                exhausted = False
                break
            saved = positions.get(path)
            position, more = self._read_path(path, _position(saved), budget, lines)
            if position is not None:
                positions[path] = position.as_json()
            exhausted = exhausted and not more
        return LogChunk(lines, {"files": positions}, exhausted=exhausted, cut=self._cut)

    def _read_path(
        self, path: str, saved: _FilePosition | None, budget: int, out: list[str]
    ) -> tuple[_FilePosition | None, bool]:
        try:
            current = os.stat(path)
        except FileNotFoundError:
            return saved, False  # rotated away and not yet recreated: nothing to read now
        except OSError as exc:
            raise CollectorError(f"kernel-log collector: cannot stat {path} ({exc.strerror})") from None
        if saved is not None and (saved.dev, saved.ino) != (current.st_dev, current.st_ino):
            rotated = _find_rotated(Path(path), saved)
            if rotated is not None:
                before = len(out)
                old_position, more = self._read_file(rotated, saved, budget, out)
                budget -= len(out) - before
                if more or budget <= 0:
                    return old_position, True
            saved = None  # the rotated copy is finished (or gone): go on with the new file
        position = saved if saved is not None and self._same_content(path, saved, current) else None
        if position is None:
            position = _FilePosition(current.st_dev, current.st_ino, 0, "")
        return self._read_file(path, position, budget, out)

    def _same_content(self, path: str, saved: _FilePosition, current: os.stat_result) -> bool:
        if current.st_size < saved.offset:
            return False  # truncated
        return _head_hash(path, min(saved.offset, HEAD_BYTES)) == saved.head

    def _read_file(self, path: str, position: _FilePosition, budget: int, out: list[str]) -> tuple[_FilePosition, bool]:
        taken = 0
        more = False
        try:
            with open(path, "rb") as fh:
                fh.seek(position.offset)
                # Each line cut to `MAX_LINE_BYTES` as it is read: a crash's line of hundreds of
                # megabytes is never held whole (`ingest.line_stream`).
                lines = CappedLines(fh, start=position.offset, chunk_bytes=FILE_CHUNK, incomplete_last=False)
                offset, cut = position.offset, 0
                for raw in lines:
                    if taken >= budget:
                        more = True  # complete lines are left for the next read
                        break
                    out.append(raw.decode("utf-8", "replace"))
                    offset, cut = lines.offset, lines.cut
                    taken += 1
                self._cut += cut
        except OSError as exc:
            raise CollectorError(f"kernel-log collector: cannot read {path} ({exc.strerror})") from None
        # The head hash covers the first HEAD_BYTES bytes once the file is that long; until
        # then it covers what has been read, so it is recomputed only while the file is short.
        head = position.head if position.offset >= HEAD_BYTES else _head_hash(path, min(offset, HEAD_BYTES))
        return _FilePosition(position.dev, position.ino, offset, head), more

    def close(self) -> None:
        pass


def _position(saved: Any) -> _FilePosition | None:
    if not isinstance(saved, dict):
        return None
    try:
        return _FilePosition(int(saved["dev"]), int(saved["ino"]), int(saved["offset"]), str(saved["head"]))
    except (KeyError, TypeError, ValueError):
        return None


def _head_hash(path: str, length: int) -> str:
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read(length)).hexdigest()
    except OSError:
        return ""


def _find_rotated(path: Path, saved: _FilePosition) -> str | None:
    """The file in `path`'s folder, named like a rotation of it, that has the saved inode."""
    try:
        siblings = list(path.parent.iterdir())
    except OSError:
        return None
    for sibling in siblings:
        if sibling == path or not sibling.name.startswith(path.name):
            continue
        try:
            st = sibling.stat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (saved.dev, saved.ino) and st.st_size >= saved.offset:
            return str(sibling)
    return None
