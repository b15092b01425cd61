"""`gpufail ingest kernel-log`: kernel-log files -> the `xid_events` dataset.

Read the lines of each file not ingested before, parse and deduplicate them
(`ingest.kernel_log_parser`); map every incident's PCI bus id to the GPU that sat there at that time
(from the `telemetry` dataset of the same store, read once per run); then, in batches of
files, write the rows and record how far each file was read.

Never replay: old events replayed after a restart are a top complaint about existing tools. The state `_state/kernel_log_ingest.json` remembers,
per file, how many (decompressed) bytes were ingested and a fingerprint of those bytes. A file
whose content is unchanged is skipped; a file that grew is read from where the last run
stopped; a rotated file (`syslog` renamed `syslog.1`, later gzipped, or copied and truncated,
or copied to another folder or name) is recognised by its content, not its name or place, so
its lines are not read twice either. When a path comes to hold other content (a new log after
the rotation), the entry of what it held is kept, for its rotated copies to be recognised
cycles later. Lines without a host take their node from the file's name, so content with such
lines is the same incidents only in a file of the same node (or of the same rotation family).

A file that cannot be read (a corrupt or cut gzip, a disk error) is skipped and listed in the
summary (`unreadable_files`), and the others are ingested: one bad file must not stop every
night's ingest. Nothing of it is recorded, so a run after it is repaired reads it.

Exactly once. A batch's rows and the state that records its files as read are one commit of
the store's journal (`ingest.journal`): a run killed at any point, or stopped by a full or
read-only disk, has committed whole batches and nothing else, so the rerun reads again exactly
the files of the batches that were not committed, and ends with the rows of a clean run.

A moved or copied data root re-reads nothing: files inside the data root (`raw/kernel-log/`)
are named in the state by their path relative to it; files elsewhere by their absolute path.
A state written by older versions (absolute paths only) is converted when read.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import multiprocessing
import os
import re
import zlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from pathlib import Path, PurePosixPath
from typing import IO, Any

import pyarrow as pa

from ingest.errors import InputError, StoreError
from ingest.kernel_log_parser import ParseStats, XidIncident, deduplicate, parse_lines, resolve_tz
from ingest.line_stream import MAX_LINE_BYTES, CappedLines
from ingest.schema import TIMESTAMP, xid_events_schema
from ingest.store import Store
from ingest.time_bounds import EARLIEST_PLAUSIBLE, plausible
from ingest.xid_gpus import map_to_gpus

DATASET = "xid_events"
STATE_NAME = "kernel_log_ingest"
# 2: files inside the data root are named relative to it (1: absolute paths only).
STATE_VERSION = 2
# Oldest entries are dropped beyond this, so the state file of a long-lived fleet stays small.
MAX_STATE_ENTRIES = 20_000
# The fingerprint hashes this much at the start and at the end of the ingested bytes: enough to
# tell one log from another and to notice truncation or rewriting, without re-reading gigabytes
# of a growing syslog on every run.
FINGERPRINT_SPAN = 64 * 1024
# Entries are looked up by a hash of this much of their start (`_ContentIndex`).
PREFIX_SPAN = 4096
# The state names an entry whose path now holds other content by this and the entry's `seq`
# (no path is named so: paths in the state are absolute or relative to the data root).
RETIRED_PREFIX = "ingested-content:"
# Log files whose events and state are committed together, in one step.
COMMIT_FILES = 500

MAX_REJECTED_REPORTED = 20
MAX_UNREADABLE_KEPT = 20
# Files are parsed in worker processes only when there is this much to read: starting a
# process (a fresh interpreter importing pyarrow) costs about a second.
PARALLEL_MIN_BYTES = 4 << 20
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class IngestSummary:
    """What one `ingest_kernel_logs` call did."""

    files: int = 0  # files read (at least partly)
    lines: int = 0  # new lines read
    xid_lines: int = 0  # XID records parsed (Xid lines and off-the-bus messages)
    incidents: int = 0  # rows written to xid_events
    rejected: int = 0  # malformed Xid lines and non-text lines
    long_lines: int = 0  # lines longer than `MAX_LINE_BYTES`, cut to it as they were read
    untimed: int = 0  # XID records whose stamp could not be placed in time (not written)
    implausible: int = 0  # XID records dated before 2010 or ahead of the wall clock (not written)
    placed: int = 0  # XID lines with no stamp at all, placed at the capture time given
    unmapped: int = 0  # incidents written with no gpu_index (bus id not found in telemetry)
    unmapped_bus_ids: list[str] = field(default_factory=list)  # "node pci_bus_id"
    skipped_files: list[str] = field(default_factory=list)  # already ingested, unchanged
    rejected_examples: list[str] = field(default_factory=list)  # "file:line: reason"
    # Files that could not be read (a corrupt or cut gzip, a disk error): "file: reason". They
    # are skipped, nothing of them is recorded, and the next run tries them again.
    unreadable_files: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        text = (
            f"{self.files} files, {self.lines:,} lines, {self.xid_lines:,} XID lines -> "
            f"{self.incidents:,} incidents; {self.rejected:,} rejected lines, "
            f"{self.untimed:,} untimed XID lines, {self.unmapped:,} unmapped incidents, "
            f"{len(self.skipped_files)} files unchanged"
        )
        if self.implausible:
            text += (
                f"; {self.implausible:,} XID lines dated before {EARLIEST_PLAUSIBLE:%Y} or ahead of this machine's "
                "clock left out"
            )
        if self.long_lines:
            text += f"; {self.long_lines:,} lines longer than {MAX_LINE_BYTES:,} bytes cut to that length"
        if self.placed:
            text += f"; {self.placed:,} unstamped XID lines placed at the capture time (--time)"
        if self.untimed:
            text += (
                " (untimed: kmsg and [uptime] stamps need the boot time (--boot-time), "
                "lines with no stamp the capture time (--time))"
            )
        if self.rejected_examples:
            text += f" (first rejected: {self.rejected_examples[0]})"
        if self.unreadable_files:
            text += (
                f"; {len(self.unreadable_files)} unreadable files skipped, expected plain or gzip text "
                f"(first: {self.unreadable_files[0]})"
            )
        return text

    def unreadable(self, path: Path, exc: BaseException) -> None:
        """Count a file that could not be read; the run goes on with the others."""
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        self.unreadable_files.append(f"{path}: {reason}")

    def merge(self, part: IngestSummary) -> None:
        """Add the counts of one file's parse (done in another process) to this run's."""
        self.files += part.files
        self.lines += part.lines
        self.xid_lines += part.xid_lines
        self.rejected += part.rejected
        self.long_lines += part.long_lines
        self.untimed += part.untimed
        self.implausible += part.implausible
        self.placed += part.placed
        room = MAX_REJECTED_REPORTED - len(self.rejected_examples)
        self.rejected_examples += part.rejected_examples[: max(0, room)]
        self.unreadable_files += part.unreadable_files


def ingest_kernel_logs(
    store: Store,
    paths: list[Path],
    *,
    cluster: str,
    dedup_window: timedelta,
    node: str | None = None,
    boot_time: datetime | None = None,
    tz: str | tzinfo | None = None,
    reference_time: datetime | None = None,
    workers: int = 1,
    capture_time: datetime | None = None,
    now: datetime | None = None,
) -> IngestSummary:
    """Ingest kernel-log files (plain or gzip) into `xid_events`; see the module docstring.

    - node: the node of lines whose format has no host field (default: the file name stem).
    - boot_time: places `/dev/kmsg` and `[uptime]` stamps; without it their XIDs are untimed.
    - capture_time: places lines with no stamp at all (plain dmesg payloads, `journalctl -o
      cat`); without it their XIDs are untimed.
    - tz: time zone of naive stamps (`dmesg -T`, journal short); UTC by default.
    - reference_time: for year-less journal stamps; default: each file's modification time.
    - now: the wall clock (default: this machine's); lines dated more than a day after it, or
      before 2010, are left out and counted (`ingest.time_bounds`).
    - workers: processes parsing files at once (a fleet's node logs are independent); the rows
      and the summary are the same as with one.
    """
    try:
        zone = resolve_tz(tz)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    paths = list(dict.fromkeys(Path(p) for p in paths))  # a path given twice is read once
    for path in paths:
        _check_readable(path)
    with store.journal(STATE_NAME, [DATASET]) as journal:
        state = _load_state(store, journal.state)
        summary = IngestSummary()
        todo = []
        index = _ContentIndex(state["files"])
        for path in paths:
            node_of_file = node or node_from_filename(path.name)
            try:
                stat = path.stat()
                compressed = _is_gzip(path)
                scan = _resume_point(store, state, index, path, compressed, node_of_file)
            except _READ_ERRORS as exc:
                summary.unreadable(path, exc)
                continue
            if scan.unchanged:
                summary.skipped_files.append(str(path))
            else:
                todo.append(_FileToParse(path, compressed, stat, scan))
        # Parse every file first, then map all events to GPUs in one pass, so that telemetry is
        # read once per run rather than once per file; then commit batch by batch.
        options = _ParseOptions(
            cluster, dedup_window, node, boot_time, zone, reference_time, capture_time, now or datetime.now(UTC)
        )
        parsed = [result for result in _parse_files(todo, options, summary, workers) if result is not None]
        _drop_copies(parsed)
        # The files this run could not read, for the operator's metric (`serving.api_metrics`):
        # committed with the run's rows, or alone when nothing else changed.
        unreadable = (summary.unreadable_files[:MAX_UNREADABLE_KEPT], len(summary.unreadable_files))
        changed = (state.get("unreadable_files", []), state.get("unreadable_count", 0)) != unreadable
        state["unreadable_files"], state["unreadable_count"] = unreadable
        if changed and not parsed:
            journal.commit(state, {})
        tables = [p.table for p in parsed if p.table is not None]
        sizes = [t.num_rows for t in tables]
        mapped = iter(_split(map_to_gpus(store, pa.concat_tables(tables), cluster), sizes) if tables else [])
        # One commit per batch of files: one file per date and one state update. Per log file, a
        # fleet of thousands of node logs made thousands of tiny Parquet files per day and
        # rewrote the growing state file as often (quadratic).
        for first in range(0, len(parsed), COMMIT_FILES):
            batch = parsed[first : first + COMMIT_FILES]
            tables = [next(mapped) for result in batch if result.table is not None]
            for result in batch:
                _remember(store, state, result)
            table = pa.concat_tables(tables) if tables else None
            journal.commit(state, {DATASET: table} if table is not None else {})
            if table is not None:
                summary.incidents += table.num_rows
                _count_unmapped(table, summary)
    return summary


# -- one file ------------------------------------------------------------------------------


@dataclass
class _FileScan:
    """Where to start reading a file (bytes and lines already ingested), or that nothing is new."""

    offset: int = 0
    lines: int = 0
    unchanged: bool = False
    resumed: dict[str, Any] | None = None  # the state's entry of the content read up to `offset`


@dataclass
class _ParsedFile:
    path: Path
    compressed: bool
    stat: os.stat_result
    end: int  # bytes (decompressed) read up to
    lines: int  # lines read up to `end`
    table: pa.Table | None  # xid_events rows, GPUs not yet mapped; None when there are none
    scan: _FileScan  # where reading started
    default_node: str  # the node of lines without a host
    hostless: bool  # whether content up to `end` has incidents that took `default_node`
    head_sha256: str  # of the first `FINGERPRINT_SPAN` bytes up to `end`


@dataclass(frozen=True)
class _ParseOptions:
    """What every file of a run is parsed with (see `ingest_kernel_logs`)."""

    cluster: str
    dedup_window: timedelta
    node: str | None
    boot_time: datetime | None
    tz: tzinfo
    reference_time: datetime | None
    capture_time: datetime | None = None
    now: datetime | None = None  # the wall clock, that bounds the time of lines


@dataclass(frozen=True)
class _FileToParse:
    path: Path
    compressed: bool
    stat: os.stat_result
    scan: _FileScan


def _parse_files(
    todo: list[_FileToParse], options: _ParseOptions, summary: IngestSummary, workers: int
) -> list[_ParsedFile | None]:
    """`_parse_file` of each file, in order, on `workers` processes when there is enough to read.
    Each file's counts are added to `summary` in file order, so the report does not depend on
    which process finished first."""
    big_enough = sum(f.stat.st_size for f in todo) >= PARALLEL_MIN_BYTES
    if workers > 1 and len(todo) > 1 and big_enough:
        # Spawned, not forked: the parent's pyarrow thread pools do not survive a fork.
        context = multiprocessing.get_context("spawn")
        workers = min(workers, len(todo))
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            chunk = max(1, len(todo) // (4 * workers))
            results = list(pool.map(_parse_file, todo, itertools.repeat(options), chunksize=chunk))
    else:
        results = [_parse_file(f, options) for f in todo]
    for _, part in results:
        summary.merge(part)
    return [parsed for parsed, _ in results]


def _parse_file(todo: _FileToParse, options: _ParseOptions) -> tuple[_ParsedFile | None, IngestSummary]:
    """The new incidents of one file (None when the file is to be left as it is), with the
    file's own counts."""
    path, compressed, stat, scan = todo.path, todo.compressed, todo.stat, todo.scan
    summary = IngestSummary()
    stats = ParseStats()
    default_node = options.node or node_from_filename(path.name)
    mtime = datetime.fromtimestamp(stat.st_mtime, UTC)
    try:
        with _open(path, compressed) as fh:
            fh.seek(scan.offset)
            reader = _LineReader(fh, scan.offset)
            records = parse_lines(
                reader,
                boot_time=options.boot_time,
                reference_time=options.reference_time or mtime,
                tz=options.tz,
                stats=stats,
                first_line_no=scan.lines + 1,
                capture_time=options.capture_time,
            )
            incidents = list(deduplicate(records, options.dedup_window, node=default_node))
            end = reader.offset
            summary.long_lines += reader.cut
            fh.seek(0)
            head_sha256 = hashlib.sha256(fh.read(min(end, FINGERPRINT_SPAN))).hexdigest()
    except _READ_ERRORS as exc:
        summary.unreadable(path, exc)
        return None, summary
    summary.files += 1
    summary.lines += stats.lines
    summary.xid_lines += stats.xid_records
    summary.rejected += stats.rejected
    for rejected in stats.rejected_lines:
        if len(summary.rejected_examples) < MAX_REJECTED_REPORTED:
            summary.rejected_examples.append(f"{path}:{rejected.line_no}: {rejected.reason}")
    timed = [i for i in incidents if i.ts is not None]
    if options.now is not None:
        # A garbled or unset stamp (1970, 2099): kept out, and counted.
        kept = [i for i in timed if plausible(i.ts, options.now)]  # type: ignore[arg-type]
        summary.implausible += sum(i.repeat_count for i in timed) - sum(i.repeat_count for i in kept)
        timed = kept
    untimed = sum(i.repeat_count for i in incidents if i.ts is None)
    summary.untimed += untimed
    if options.capture_time is not None:
        # Only a line with no stamp of its own takes the capture time to the microsecond.
        placed_at = options.capture_time.astimezone(UTC)
        summary.placed += sum(i.repeat_count for i in timed if i.ts == placed_at)
    if untimed and not timed:
        # Nothing could be placed in time (kmsg or uptime stamps without a boot time): leave the
        # file unread, so that a run given the boot time ingests it in full.
        return None, summary
    table = events_table(timed, cluster=options.cluster, source=f"file:{path.name}") if timed else None
    # Whether a copy of this content under another node's name holds other incidents (module
    # notes). An entry written before this was recorded is taken to have such lines.
    before = scan.resumed is not None and scan.resumed.get("node", default_node) is not None
    hostless = before or any(i.node == default_node for i in incidents)
    parsed = _ParsedFile(
        path, compressed, stat, end, scan.lines + stats.lines, table, scan, default_node, hostless, head_sha256
    )
    return parsed, summary


# A corrupt or cut gzip stream, a disk error, a file removed since it was listed.
_READ_ERRORS = (OSError, EOFError, zlib.error, gzip.BadGzipFile)


def _drop_copies(parsed: list[_ParsedFile]) -> None:
    """Drop the rows of a file whose newly read content is also read, in this run, from a
    longer copy of it (a rotated file and its copy under another name or folder, both new):
    the copy's rows are those of the same lines. Its state is still recorded, so that it is
    not read again either."""
    groups: dict[str, list[_ParsedFile]] = {}
    for result in parsed:
        if result.table is not None:
            groups.setdefault(result.head_sha256, []).append(result)
    for group in groups.values():
        group.sort(key=lambda r: r.end, reverse=True)
        for i, shorter in enumerate(group):
            for longer in group[:i]:
                if longer.table is not None and _contains(longer, shorter):
                    shorter.table = None
                    break


def _contains(longer: _ParsedFile, shorter: _ParsedFile) -> bool:
    """Whether `longer` read, from its start or earlier, the very bytes `shorter` read, and
    with them the same incidents (the same node for lines without a host)."""
    if longer.scan.offset > shorter.scan.offset or longer.end < shorter.end:
        return False
    if shorter.hostless and shorter.default_node != longer.default_node:
        return False
    with _open(longer.path, longer.compressed) as a, _open(shorter.path, shorter.compressed) as b:
        return _fingerprint(a, shorter.end) == _fingerprint(b, shorter.end)


def _split(table: pa.Table, sizes: list[int]) -> Iterator[pa.Table]:
    offset = 0
    for size in sizes:
        yield table.slice(offset, size)
        offset += size


def _check_readable(path: Path) -> None:
    if not path.exists():
        raise InputError(f"kernel log {path}: no such file")
    if not path.is_file():
        raise InputError(f"kernel log {path}: not a regular file (expected a log file, plain or gzip)")
    if not os.access(path, os.R_OK):
        raise InputError(f"kernel log {path}: not readable (permission denied)")


# logrotate's suffixes: a number, or `dateext`'s date (`-%Y%m%d`, or a `dateformat` adding the
# hour or the seconds: `-%Y%m%d%H`, `-%Y%m%d-%s`).
_ROTATION = re.compile(r"^(?P<stem>.+?)(?:\.(?:log|txt)(?:\.\d+|-\d{8}(?:-?\d+)?)?)?(?:\.gz)?$")


def node_from_filename(name: str) -> str:
    """`gpu-node-007.log`, `gpu-node-007.log.1`, `gpu-node-007.log.2.gz` -> `gpu-node-007`."""
    m = _ROTATION.match(name)
    return m["stem"] if m else name


_ROTATION_SUFFIX = re.compile(r"(?:\.gz|\.[0-9]+|-[0-9]{8}(?:-?[0-9]+)?)$")


def rotation_family(path: Path) -> str:
    """`/var/log/syslog.2.gz`, `/var/log/syslog.1` and `/var/log/syslog` -> `/var/log/syslog`:
    the names logrotate gives one log over time."""
    name = path.name
    while (shorter := _ROTATION_SUFFIX.sub("", name)) != name and shorter:
        name = shorter
    return str(path.resolve().parent / name)


def _is_gzip(path: Path) -> bool:
    # By content, not name: logrotate's `delaycompress` leaves `*.log.1` plain and gzips later.
    with open(path, "rb") as fh:
        return fh.read(2) == _GZIP_MAGIC


def _open(path: Path, compressed: bool) -> IO[bytes]:
    return gzip.open(path, "rb") if compressed else open(path, "rb")  # type: ignore[return-value]


class _LineReader:
    """Decoded lines of a binary stream, each cut to `MAX_LINE_BYTES` as it is read
    (`ingest.line_stream`), counting the bytes consumed and the lines cut.

    Undecodable bytes become U+FFFD, which the parser counts as a rejected line, so a binary
    file is reported instead of crashing the run. A last line without a newline is read too:
    copies of logs often lack the final newline.
    """

    def __init__(self, fh: IO[bytes], offset: int) -> None:
        self._lines = CappedLines(fh, start=offset)

    @property
    def offset(self) -> int:
        return self._lines.offset

    @property
    def cut(self) -> int:
        return self._lines.cut

    def __iter__(self) -> Iterator[str]:
        return map(_decode, self._lines)


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


# -- never replay: the state ---------------------------------------------------------------


def _load_state(store: Store, state: dict[str, Any] | None) -> dict[str, Any]:
    """The committed state, converted to this version's; a fresh one when there is none."""
    if state is None:
        return {"version": STATE_VERSION, "seq": 0, "files": {}}
    version = state.get("version")
    if version not in (1, STATE_VERSION) or not isinstance(state.get("files"), dict):
        # Starting afresh would ingest every file again: refuse instead.
        raise StoreError(
            f"{store.path('_state', STATE_NAME + '.json')}: kernel-log state of version {version!r} "
            f"is not understood; expected version 1 or {STATE_VERSION} with a 'files' object"
        )
    if version == 1:
        state = {**state, "version": STATE_VERSION, "files": _relocate_v1_entries(store, state["files"])}
    return state


def _locator(store: Store, path: Path) -> str:
    """The state's name for a file: its path relative to the data root when it lies inside the
    root (so that a moved or copied root keeps its state), else its absolute path."""
    resolved = path.resolve()
    root = _local_root(store)
    if root is not None and resolved.is_relative_to(root):
        return resolved.relative_to(root).as_posix()
    return str(resolved)


def _local_root(store: Store) -> Path | None:
    return Path(store.path()).resolve() if store.is_local else None


def _relocate_v1_entries(store: Store, entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Version 1 named every file by absolute path. Files under the data root are renamed
    relative to it. A file elsewhere keeps its name, and when the root holds a file at the same
    path's tail (the root was copied or moved before the upgrade) that path is named too: the
    fingerprint still decides whether its content is the one ingested."""
    root = _local_root(store)
    converted: dict[str, dict[str, Any]] = {}
    for key, entry in entries.items():
        absolute = PurePosixPath(key)
        if root is not None and absolute.is_relative_to(root):
            relative: str | None = absolute.relative_to(root).as_posix()
        else:
            relative = _tail_under(root, absolute)
            converted[key] = entry
        if relative is not None:
            family = PurePosixPath(relative).parent / PurePosixPath(str(entry.get("family", key))).name
            converted[relative] = {**entry, "family": family.as_posix()}
    return converted


def _tail_under(root: Path | None, key: PurePosixPath) -> str | None:
    """The longest tail of the absolute path `key` that names a file under `root`, if any."""
    if root is None:
        return None
    for start in range(1, len(key.parts)):
        tail = PurePosixPath(*key.parts[start:])
        if (root / tail).is_file():
            return tail.as_posix()
    return None


def _fingerprint(fh: IO[bytes], end: int) -> str | None:
    """Hash of `end` and of the first and last `FINGERPRINT_SPAN` bytes before `end`; None
    when the stream is shorter than `end` (the file was truncated or replaced)."""
    fh.seek(0)
    head = fh.read(min(end, FINGERPRINT_SPAN))
    tail_start = max(end - FINGERPRINT_SPAN, len(head))
    fh.seek(tail_start)
    tail = fh.read(end - tail_start)
    if len(head) < min(end, FINGERPRINT_SPAN) or len(tail) < end - tail_start:
        return None
    digest = hashlib.sha256(str(end).encode())
    digest.update(head)
    digest.update(tail)
    return digest.hexdigest()


def _resume_point(
    store: Store, state: dict[str, Any], index: _ContentIndex, path: Path, compressed: bool, node: str
) -> _FileScan:
    """Where reading `path` starts: after the longest already-ingested content it begins with.

    Candidates are the entry of this path and every entry with the same first bytes, wherever
    its file lay and whatever it was called (a rotated, compressed, renamed or copied file);
    each is checked by fingerprint at its own offset. Content whose lines took their node from
    the file's name (no host in the line) is the same incidents only for a file of the same
    node, so such an entry serves only files of its node (`node`: the node of host-less lines)
    or of its own rotation family.
    """
    key = _locator(store, path)
    entries: dict[str, dict[str, Any]] = state["files"]
    stat = path.stat()
    own = entries.get(key)
    if own and own.get("raw_size") == stat.st_size and own.get("raw_mtime_ns") == stat.st_mtime_ns:
        # Same size and mtime as last time: confirm with the fingerprint of the whole content
        # (cheap: two 64 KiB reads) before calling it unchanged.
        with _open(path, compressed) as fh:
            if _fingerprint(fh, own["offset"]) == own["fingerprint"] and _at_eof(fh, own["offset"]):
                return _FileScan(own["offset"], own["lines"], unchanged=True, resumed=own)
    family = _locator(store, Path(rotation_family(path)))
    with _open(path, compressed) as fh:
        head = fh.read(FINGERPRINT_SPAN)
        found = index.candidates(head, family) + ([own] if own else [])
        candidates = sorted(
            (e for e in found if e is own or (_head_matches(e, head) and _same_node(e, family, node))),
            key=lambda e: e["offset"],
            reverse=True,
        )
        for entry in candidates:
            if _fingerprint(fh, entry["offset"]) == entry["fingerprint"]:
                return _FileScan(entry["offset"], entry["lines"], unchanged=_at_eof(fh, entry["offset"]), resumed=entry)
    return _FileScan()


class _ContentIndex:
    """The state's entries by their first bytes (`PREFIX_SPAN`), so that finding the entries a
    file may continue costs a hash or two, not one per entry of the state (tens of thousands).
    Entries written before the prefix was recorded are found by their rotation family."""

    def __init__(self, entries: dict[str, dict[str, Any]]) -> None:
        self._by_prefix: dict[tuple[int, str], list[dict[str, Any]]] = {}
        self._by_family: dict[str, list[dict[str, Any]]] = {}
        for entry in entries.values():
            if "prefix_sha256" in entry:
                self._by_prefix.setdefault((entry["prefix_len"], entry["prefix_sha256"]), []).append(entry)
            else:
                self._by_family.setdefault(str(entry.get("family")), []).append(entry)
        self._lengths = sorted({length for length, _ in self._by_prefix})

    def candidates(self, head: bytes, family: str) -> list[dict[str, Any]]:
        found = list(self._by_family.get(family, []))
        for length in self._lengths:
            if length > len(head):
                break
            found += self._by_prefix.get((length, hashlib.sha256(head[:length]).hexdigest()), [])
        return found


def _same_node(entry: dict[str, Any], family: str, node: str) -> bool:
    """Whether the incidents of `entry`'s content are those of the same content in a file of
    `family` whose host-less lines are of `node`. Entries written before `node` was recorded
    serve their rotation family only."""
    if entry.get("family") == family:
        return True
    return "node" in entry and entry["node"] in (None, node)


def _head_matches(entry: dict[str, Any], head: bytes) -> bool:
    length = entry["head_len"]
    return len(head) >= length > 0 and hashlib.sha256(head[:length]).hexdigest() == entry["head_sha256"]


def _at_eof(fh: IO[bytes], offset: int) -> bool:
    fh.seek(offset)
    return not fh.read(1)


def _remember(store: Store, state: dict[str, Any], result: _ParsedFile) -> None:
    with _open(result.path, result.compressed) as fh:
        fingerprint = _fingerprint(fh, result.end)
        fh.seek(0)
        head = fh.read(min(result.end, FINGERPRINT_SPAN))
    key = _locator(store, result.path)
    files: dict[str, dict[str, Any]] = state["files"]
    previous = files.get(key)
    resumed = result.scan.resumed
    if previous is not None and (resumed is None or previous.get("seq") != resumed.get("seq")):
        # The path now holds other content (the log was rotated away and a new one started,
        # or copytruncate emptied it): what it held was ingested, and its rotated copies must
        # still be recognised, so its entry is kept under a name no path has.
        files[f"{RETIRED_PREFIX}{previous['seq']}"] = previous
    state["seq"] = state.get("seq", 0) + 1
    files[key] = {
        "path": str(result.path),
        "family": _locator(store, Path(rotation_family(result.path))),
        "node": result.default_node if result.hostless else None,
        "compressed": result.compressed,
        "raw_size": result.stat.st_size,
        "raw_mtime_ns": result.stat.st_mtime_ns,
        "offset": result.end,
        "lines": result.lines,
        "fingerprint": fingerprint,
        "head_len": len(head),
        "head_sha256": hashlib.sha256(head).hexdigest(),
        "prefix_len": min(len(head), PREFIX_SPAN),
        "prefix_sha256": hashlib.sha256(head[:PREFIX_SPAN]).hexdigest(),
        "seq": state["seq"],
    }
    if len(files) > MAX_STATE_ENTRIES:
        oldest = sorted(files, key=lambda k: files[k]["seq"])
        for k in oldest[: len(files) - MAX_STATE_ENTRIES]:
            del files[k]


# -- rows ----------------------------------------------------------------------------------


def events_table(incidents: list[XidIncident], *, cluster: str, source: str) -> pa.Table:
    """`xid_events` rows for `incidents`, sorted by time, GPUs not yet mapped (`map_to_gpus`)."""
    n = len(incidents)
    schema = xid_events_schema()
    columns = {
        "ts": pa.array([i.ts for i in incidents], TIMESTAMP),
        "last_ts": pa.array([i.last_ts for i in incidents], TIMESTAMP),
        "cluster": pa.array([cluster] * n, pa.string()),
        "node": pa.array([i.node for i in incidents], pa.string()),
        "pci_bus_id": pa.array([i.pci_bus_id for i in incidents], pa.string()),
        "gpu_index": pa.nulls(n, pa.int16()),
        "gpu_uuid": pa.array([i.gpu_uuid for i in incidents], pa.string()),
        "xid": pa.array([i.xid for i in incidents], pa.int32()),
        "pid": pa.array([i.pid for i in incidents], pa.int64()),
        "process": pa.array([i.process for i in incidents], pa.string()),
        "message": pa.array([i.message for i in incidents], pa.string()),
        "source": pa.array([source] * n, pa.string()),
        "repeat_count": pa.array([i.repeat_count for i in incidents], pa.int32()),
    }
    return pa.table(columns, schema=schema).sort_by([("ts", "ascending")])


def _count_unmapped(table: pa.Table, summary: IngestSummary) -> None:
    unmapped = table.filter(table["gpu_index"].is_null())
    summary.unmapped += unmapped.num_rows
    seen = set(summary.unmapped_bus_ids)
    for node, pci in zip(unmapped["node"].to_pylist(), unmapped["pci_bus_id"].to_pylist(), strict=True):
        name = f"{node} {pci}"
        if name not in seen:
            seen.add(name)
            summary.unmapped_bus_ids.append(name)
