"""XID events from kernel-log text, in every format the NVIDIA driver's lines reach us in.

The driver prints one line per XID (docs/kernel-logs.md):

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.

but that line arrives wrapped in whatever prefix the collecting tool adds: `/dev/kmsg` records,
`dmesg` with uptime, ctime or ISO stamps, journald's short format (possibly with a localized
month), RFC 3339 syslog, or nothing at all. This module recognises the prefix, turns its stamp
into a UTC time where that is possible, and parses the NVRM payload: the code is the leading
integer, whatever follows it (a comma, a space, key=value fields; see `_XID_HEAD`).

Everything here is a pure function of text and of the times the caller passes in (boot time,
reference time, time zone): no files, no clock. `ingest.kernel_log_import` does the I/O.

Two things are not one-line-one-event:
- `NVRM: GPU at PCI:0000:0b:00: GPU-<uuid>` banners say which GPU sits at a bus id; later
  records of that bus id carry the UUID.
- A GPU can fall off the bus with no Xid line at all, only a multi-line "The NVIDIA GPU
  <bus id> ... has fallen off the bus" message; that becomes an XID 79 record, because for
  labelling it is the same event.

Floods (hundreds of thousands of identical lines) are folded by `deduplicate`, which streams
and keeps only the incidents still open.

A message longer than `MAX_MESSAGE_CHARS` is stored cut to that length, ending in a note of
its full length (`ParseStats.truncated_messages` counts them): one garbled or hostile line
must not put megabytes into every incident row and cache that repeats it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ingest.schema import normalise_pci_bus_id

OFF_BUS_XID = 79
OFF_BUS_MESSAGE = "GPU has fallen off the bus (from the NVRM off-the-bus text; the driver printed no Xid line)"

# How many later NVRM lines may separate "The NVIDIA GPU <bus id>" from "fallen off the bus":
# the driver prints the message as 2-3 lines, and other GPUs' lines may interleave.
OFF_BUS_LOOKAHEAD = 6

# A huge garbage file must not make the parser hold one entry per bad line.
MAX_REJECTED_KEPT = 1000

# Longest message kept whole; a longer one keeps this many characters and then
# `TRUNCATED_NOTE` with its full length. The real messages among the test fixtures are at most
# 158 characters long.
MAX_MESSAGE_CHARS = 4096
TRUNCATED_NOTE = " [truncated: {:,} characters]"

# Slack allowed when inferring the year of a year-less stamp: clocks of the writer and of the
# reader differ, and a log copied just after midnight on Dec 31 must not go back a year.
YEAR_INFERENCE_SLACK = timedelta(days=1)

# Month abbreviations as `%b` prints them (glibc), lower-cased and without a trailing dot.
# journald's short format uses the locale of whoever ran journalctl, so a log pasted from a
# Polish machine says `kwi 15 07:56:59` for April 15. Kept as data, one row per locale.
MONTH_ABBREVIATIONS: dict[str, tuple[str, ...]] = {
    "en": ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"),
    "de": ("jan", "feb", "mär", "apr", "mai", "jun", "jul", "aug", "sep", "okt", "nov", "dez"),
    "fr": ("janv", "févr", "mars", "avr", "mai", "juin", "juil", "août", "sept", "oct", "nov", "déc"),
    "es": ("ene", "feb", "mar", "abr", "may", "jun", "jul", "ago", "sept", "oct", "nov", "dic"),
    "it": ("gen", "feb", "mar", "apr", "mag", "giu", "lug", "ago", "set", "ott", "nov", "dic"),
    "pt": ("jan", "fev", "mar", "abr", "mai", "jun", "jul", "ago", "set", "out", "nov", "dez"),
    "nl": ("jan", "feb", "mrt", "apr", "mei", "jun", "jul", "aug", "sep", "okt", "nov", "dec"),
    "pl": ("sty", "lut", "mar", "kwi", "maj", "cze", "lip", "sie", "wrz", "paź", "lis", "gru"),
    "ru": ("янв", "фев", "мар", "апр", "мая", "июн", "июл", "авг", "сен", "окт", "ноя", "дек"),
    "zh_ja": tuple(f"{m}月" for m in range(1, 13)),
    "ko": tuple(f"{m}월" for m in range(1, 13)),
}
# Older or newer glibc releases spell a few months differently.
MONTH_VARIANTS: dict[str, int] = {"avril": 4, "mrz": 3, "mae": 3, "sep": 9, "май": 5, "märz": 3}


def _month_table() -> dict[str, int]:
    table = dict(MONTH_VARIANTS)
    for locale, names in MONTH_ABBREVIATIONS.items():
        if len(names) != 12:
            raise ValueError(f"MONTH_ABBREVIATIONS[{locale!r}]: expected 12 names, got {len(names)}")
        for number, name in enumerate(names, start=1):
            if table.setdefault(name, number) != number:
                raise ValueError(f"month abbreviation {name!r} ({locale}) means two different months")
    return table


MONTHS: dict[str, int] = _month_table()


# -- records -------------------------------------------------------------------------------


@dataclass(slots=True)
class XidRecord:
    """One XID line (or off-the-bus message) as read from the log."""

    ts: datetime | None  # UTC; None when the format's stamp cannot be placed in time
    host: str | None  # from the line's prefix, for formats that carry one
    pci_bus_id: str  # normalised, `0000:3b:00`
    xid: int
    pid: int | None
    process: str | None
    message: str
    gpu_uuid: str | None  # from an earlier `GPU at PCI:...` banner of the same bus id
    line_no: int
    log_format: str


@dataclass(slots=True)
class RejectedLine:
    line_no: int
    reason: str


@dataclass(slots=True)
class ParseStats:
    """Counts for one parsed stream; `rejected_lines` keeps the first `MAX_REJECTED_KEPT`.
    `truncated_messages`: Xid lines whose message (or process name) was cut to
    `MAX_MESSAGE_CHARS`."""

    lines: int = 0
    xid_records: int = 0
    rejected: int = 0
    rejected_lines: list[RejectedLine] = field(default_factory=list)
    truncated_messages: int = 0

    def reject(self, line_no: int, reason: str) -> None:
        self.rejected += 1
        if len(self.rejected_lines) < MAX_REJECTED_KEPT:
            self.rejected_lines.append(RejectedLine(line_no, reason))


# -- prefixes: which tool wrote the line, and when ----------------------------------------

_ISO = r"(?P<iso>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,](?P<frac>\d+))?(?:Z|[+-]\d\d:?\d\d)?)"
_UPTIME_TAIL = r"(?:\[\s*\d+\.\d+\] *)?"  # syslog copies of kernel lines often keep the uptime


@dataclass(frozen=True, slots=True)
class _TimeContext:
    boot_time: datetime | None
    reference_time: datetime | None
    tz: tzinfo
    capture_time: datetime | None = None


def _ts_none(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    return None


def _ts_capture(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    # A line with no stamp at all (a plain dmesg payload, `journalctl -o cat`): the time it
    # was captured, when the user gives it.
    return ctx.capture_time


def _ts_kmsg(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    # /dev/kmsg stamps are microseconds of CLOCK_MONOTONIC since boot.
    if ctx.boot_time is None:
        return None
    usec = m["usec"]
    if len(usec) > _MAX_STAMP_DIGITS:
        return None
    return _after_boot(ctx.boot_time, 0, int(usec))


def _micros(frac: str) -> int:
    """Microseconds of a fraction's digits, truncated past six as `fromisoformat` does."""
    return int(frac) if len(frac) == 6 else int(frac[:6].ljust(6, "0"))


def _ts_uptime(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    if ctx.boot_time is None:
        return None
    sec, frac = m.group("sec", "frac")
    if len(sec) > _MAX_STAMP_DIGITS:
        return None
    return _after_boot(ctx.boot_time, int(sec), _micros(frac))


# More digits than a stamp since boot can have (a century of microseconds has 16): a garbled
# line, which gets no time rather than an overflow.
_MAX_STAMP_DIGITS = 18


def _after_boot(boot_time: datetime, seconds: int, micros: int) -> datetime | None:
    try:
        return boot_time + timedelta(0, seconds, micros)  # positional: 2x faster than keywords
    except OverflowError:
        return None


def _ts_ctime(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    month = MONTHS.get(m["mon"].lower().rstrip("."))
    if month is None:
        return None
    hour, minute, second = (int(x) for x in m["hms"].split(":"))
    try:
        return datetime(int(m["year"]), month, int(m["day"]), hour, minute, second, tzinfo=ctx.tz).astimezone(UTC)
    except (ValueError, OverflowError):  # no such day; a zone taking it past year 1 or 9999
        return None


def _ts_iso(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    return _iso_to_utc(m["iso"], ctx.tz)


def _iso_to_utc(stamp: str, tz: tzinfo) -> datetime | None:
    try:
        moment = datetime.fromisoformat(stamp)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=tz)
        return moment.astimezone(UTC)
    except (ValueError, OverflowError):  # no such day; a zone taking it past year 1 or 9999
        return None


def _ts_journal(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    month = MONTHS.get(m["mon"].lower().rstrip("."))
    if month is None or ctx.reference_time is None:
        return None
    hour, minute, second = (int(x) for x in m["hms"].split(":"))
    return infer_year(month, int(m["day"]), hour, minute, second, ctx.reference_time, ctx.tz)


def infer_year(
    month: int, day: int, hour: int, minute: int, second: int, reference_time: datetime, tz: tzinfo = UTC
) -> datetime | None:
    """The UTC time of a year-less local stamp: the latest year in which it is not after
    `reference_time` (plus a day of slack), as syslog readers do. None for an impossible date.

    Starting one year after the reference lets a stamp of Jan 1 00:10 read on Dec 31 23:50 (a
    clock a little ahead) land in the next year instead of almost a year back. Feb 29 searches
    back to the last leap year.
    """
    limit = _aware(reference_time) + YEAR_INFERENCE_SLACK
    for year in range(limit.year + 1, limit.year - 8, -1):
        try:
            moment = datetime(year, month, day, hour, minute, second, tzinfo=tz).astimezone(UTC)
        except (ValueError, OverflowError):
            continue
        if moment <= limit:
            return moment
    return None


@dataclass(frozen=True, slots=True)
class _Prefix:
    name: str
    pattern: re.Pattern[str]  # the prefix alone, matched against the text before "NVRM:"
    timestamp: Callable[[re.Match[str], _TimeContext], datetime | None]
    has_host: bool
    # Stamps with one-second resolution repeat thousands of times in a flood: cache them.
    cache_ts: bool
    # For the line cache (`_Shape`): the group whose digits change from line to line and move
    # the time (a fraction of a second; kmsg: a count of microseconds), whether they do move it
    # (journal's fraction does not), and a group whose digits change on every line without
    # entering the time (kmsg's sequence number), which must come before it.
    frac_group: str
    frac_in_ts: bool
    frac_is_micros: bool
    counter_group: str | None


def _prefix(
    name: str,
    source: str,
    timestamp: Callable[[re.Match[str], _TimeContext], datetime | None],
    *,
    has_host: bool = False,
    cache_ts: bool = False,
    frac_group: str = "frac",
    frac_in_ts: bool = True,
    frac_is_micros: bool = False,
    counter_group: str | None = None,
) -> _Prefix:
    return _Prefix(
        name=name,
        pattern=re.compile(source),
        timestamp=timestamp,
        has_host=has_host,
        cache_ts=cache_ts,
        frac_group=frac_group,
        frac_in_ts=frac_in_ts,
        frac_is_micros=frac_is_micros,
        counter_group=counter_group,
    )


# Tried in this order at first, then the last successful one first: one file almost always
# holds one format, so the first try usually matches. No two of them match the same text, so
# the order changes speed only.
PREFIXES: tuple[_Prefix, ...] = (
    _prefix("bare", r"\s*(?:<\d+>)?\s*", _ts_capture),
    _prefix(
        "kmsg",
        r"(?P<pri>\d+),(?P<seq>\d+),(?P<usec>\d+),[^;]*;",
        _ts_kmsg,
        frac_group="usec",
        frac_is_micros=True,
        counter_group="seq",
    ),
    _prefix("dmesg_uptime", r"(?:<\d+>)?\[\s*(?P<sec>\d+)\.(?P<frac>\d+)\]\s*", _ts_uptime),
    _prefix(
        "dmesg_ctime",
        r"\[(?:[^\W\d]+ +)?(?P<mon>[^\W\d]+\.?) +(?P<day>\d{1,2}) (?P<hms>\d\d:\d\d:\d\d) (?P<year>\d{4})\]\s*",
        _ts_ctime,
        cache_ts=True,
    ),
    _prefix("dmesg_iso", rf"(?:[a-z]+ *: *[a-z]+ *: *)?{_ISO}\s+", _ts_iso),
    _prefix("rfc3339_syslog", rf"{_ISO} +(?P<host>\S+) +kernel: *{_UPTIME_TAIL}", _ts_iso, has_host=True),
    _prefix("journal_noprefix", rf"\s*kernel: *{_UPTIME_TAIL}", _ts_none),
    _prefix(
        "journal",
        r"\s*(?P<mon>\S+) +(?P<day>\d{1,2}) (?P<hms>\d\d:\d\d:\d\d)(?:\.(?P<frac>\d+))? +"
        rf"(?:(?P<host>[^\s\[]\S*) +)??(?:kernel: *)?{_UPTIME_TAIL}",
        _ts_journal,
        has_host=True,
        cache_ts=True,
        frac_in_ts=False,
    ),
)


# -- NVRM payloads -------------------------------------------------------------------------

# Everything of an Xid line up to its code. What follows the code varies with the driver:
#   `79, pid=1234, name=python3, GPU has fallen off the bus.`   (the classic shape)
#   `149, NETIR_LINK_EVT/NETIR_LINK_DOWN Fatal XC0 i0 Link 08 (...)` (no pid, no name)
#   `79 Recommended Action=CONTACT_SUPPORT`                     (a space, then key=value fields)
#   `119, pid=1582259 Recommended Action=COMPONENT_RESET`       (the same after the pid)
#   `46`                                                        (the code alone)
# so the code is the leading integer, and the rest, less pid and name, is the message.
_XID_HEAD = re.compile(r"NVRM: Xid *\((?:PCI:)?(?P<pci>[^)]*)\): *")
_XID_FORM = "Xid line not of the form 'NVRM: Xid (PCI:dddd:bb:dd): <code>[, pid=..., name=...] <message>'"
_BANNER = re.compile(r"NVRM: GPU at (?:PCI:)?(?P<pci>[0-9a-fA-F]+:[0-9a-fA-F]+:[0-9a-fA-F.]+): (?P<uuid>GPU-[^\s,;]+)")
_PCI = r"(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)"
_OFF_BUS_START = re.compile(rf"NVRM: The NVIDIA GPU {_PCI}")
_OFF_BUS_ONE_LINE = re.compile(rf"NVRM: GPU {_PCI}:? .*fallen off the bus")
_UNKNOWN = ("<unknown>", "'<unknown>'", "")
_NOT_TEXT = "not text (NUL or undecodable bytes)"
_ASCII_DIGITS = "0123456789"
# The `xid_events` columns these go to: xid is int32, pid int64.
_MAX_XID = 2**31 - 1
_MAX_PID = 2**63 - 1

# What an Xid line's payload says: (bus id, xid, pid, process, message).
_Fields = tuple[str, int, int | None, str | None, str]

# Bounds on the per-parser caches (timestamps, payloads, lines): entries, and the length of a
# text kept as a key, so that neither a long log nor a few huge lines can fill the memory.
_CACHE_LIMIT = 4096
_CACHED_TEXT_MAX = 2 * MAX_MESSAGE_CHARS


def _parse_xid(body: str) -> tuple[_Fields, bool] | str:
    """(fields, whether the message was cut to `MAX_MESSAGE_CHARS`) of an `NVRM: Xid ...` text,
    or why it is not a well-formed one."""
    m = _XID_HEAD.match(body)
    if m is None:
        return _XID_FORM
    rest = body[m.end() :]
    after = rest.lstrip(_ASCII_DIGITS)
    code = rest[: len(rest) - len(after)]
    if not code or not (after == "" or after[0] == "," or after[0].isspace()):
        words = rest.split(",", 1)[0].split(None, 1)
        token = words[0] if words else ""
        return f"Xid code {token!r} is not a number"
    if len(code) > len(str(_MAX_XID)) or int(code) > _MAX_XID:
        return f"Xid code {code[:20]} out of range: expected at most {_MAX_XID}"
    xid = int(code)
    try:
        pci = normalise_pci_bus_id(m["pci"])
    except ValueError as exc:
        return str(exc)
    pid, process, message = _split_fields(after[1:] if after.startswith(",") else after)
    truncated = len(message) > MAX_MESSAGE_CHARS or (process is not None and len(process) > MAX_MESSAGE_CHARS)
    if truncated:
        message = _bounded(message)
        process = None if process is None else _bounded(process)
    return (pci, xid, pid, process, message), truncated


def _bounded(text: str) -> str:
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[:MAX_MESSAGE_CHARS] + TRUNCATED_NOTE.format(len(text))


def _split_fields(text: str) -> tuple[int | None, str | None, str]:
    """`pid=12, name=python3, Ch 00000008` -> (12, "python3", "Ch 00000008").

    Process names may hold ':' '[' '.' and spaces (`nvc:[driver]`, `ray::WorkerDict`) but not
    ','. A pid is digits: one followed by a space and more (`pid=1582259 Recommended
    Action=...`) keeps the more in the message.
    """
    text = text.strip()
    pid: int | None = None
    process: str | None = None
    if text.startswith("pid="):
        value, comma, after = text[4:].partition(",")
        value = value.strip()
        number, space, more = value.partition(" ")
        # A garbled pid loses the pid only: the XID itself is still worth keeping.
        if number.isascii() and number.isdigit() and len(number) <= len(str(_MAX_PID)) and int(number) <= _MAX_PID:
            pid = int(number)
        text = (more.strip() + comma + after if space else after).lstrip()
    if text.startswith("name="):
        value, _, text = text[5:].partition(",")
        value = value.strip()
        process = None if value in _UNKNOWN else value
    return pid, process, text.strip()


# -- the parser ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Shape:
    """The layout of a line the parser has read in full, for reading the next ones without it.

    In a flood, consecutive lines differ only in the digits of their prefix's sub-second field
    (`[103304.000100]`, `...T04:41:44,000100+00:00`) and, for kmsg, of the sequence number.
    Python's regex engine treats every ASCII digit alike (no prefix pattern names a particular
    digit), so a line equal to an already read one outside those digit fields, with as many
    ASCII digits inside them, takes the same path through the prefix's regex: same format,
    host, bus id, code and message. Only the time changes, by the fraction's change: stamps
    count whole seconds and zone offsets are whole seconds too, so the time at a zero fraction
    plus the fraction is exact.

    Such a line is `head`, counter digits, `mid`, fraction digits, then one of the texts in
    `tails`, which gives what the line says. Without a fraction, `frac_start == frac_end` is
    where the payload starts and `head` is the whole prefix.
    """

    head: str
    counter_start: int  # kmsg's sequence number; -1 for the other formats
    counter_end: int
    mid: str
    frac_start: int
    frac_end: int
    # The fraction's microseconds are int(digits) * scale // shrink: 6 digits -> 1 // 1,
    # 3 digits -> 1000 // 1, 9 digits -> 1 // 1000 (truncated, as `fromisoformat` does),
    # kmsg's count of microseconds -> 1 // 1, a fraction the time ignores (journal) -> 0 // 1.
    scale: int
    shrink: int
    tails: dict[str, _Tail] = field(default_factory=dict)

    def layout(self) -> tuple[str, int, int, str, int, int, int, int]:
        return (
            self.head,
            self.counter_start,
            self.counter_end,
            self.mid,
            self.frac_start,
            self.frac_end,
            self.scale,
            self.shrink,
        )


_Key = tuple[str | None, str, int]  # (node, bus id, xid): what `deduplicate` folds by

# What a line's text after the fraction says: its incident key, the GPU's UUID (from a
# banner), the time at a zero fraction (UTC, and in microseconds since the epoch; None when the
# format cannot place it), then host, fields and log format for its record.
_Tail = tuple[_Key, str | None, int | None, tuple[datetime | None, str | None, _Fields, str]]


def _no_shape() -> _Shape:
    """A layout no line has (`shrink` is never 0): every look-up misses until `_learn`."""
    return _Shape("", -1, -1, "", 0, 0, 0, 0)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US = timedelta(microseconds=1)


def _to_us(moment: datetime) -> int:
    """Microseconds since the epoch: integers compare and add several times faster than
    datetimes, which is what `deduplicate` does once per flood line."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - _EPOCH) // _ONE_US


def _from_us(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


_MAX_US = _to_us(datetime.max.replace(tzinfo=UTC))


@dataclass(slots=True)
class _PendingOffBus:
    pci_bus_id: str
    ts: datetime | None
    line_no: int
    log_format: str
    nvrm_lines_left: int


class KernelLogParser:
    """The state of one parse: banner UUIDs, half-seen off-bus messages, and caches.

    `parse_lines` drives it; one parser reads one stream, in log order. Every line goes the
    same way: `scan` looks it up in the shape of the last Xid line read in full (`_Shape`),
    which in a flood the next line nearly always has, and reads it in full (`_read`) when it
    is not there, which teaches the shape that line's layout.
    """

    def __init__(
        self,
        *,
        boot_time: datetime | None = None,
        reference_time: datetime | None = None,
        tz: str | tzinfo | None = None,
        capture_time: datetime | None = None,
    ) -> None:
        self._ctx = _TimeContext(
            # In UTC, so that uptime and kmsg records are in UTC like the others.
            boot_time=_aware(boot_time).astimezone(UTC) if boot_time is not None else None,
            reference_time=_aware(reference_time) if reference_time is not None else None,
            tz=resolve_tz(tz),
            capture_time=_aware(capture_time).astimezone(UTC) if capture_time is not None else None,
        )
        self.stats = ParseStats()
        self._prefixes = list(PREFIXES)
        self._uuids: dict[tuple[str | None, str], str] = {}
        self._pending: dict[str | None, _PendingOffBus] = {}
        self._ts_cache: dict[str, datetime | None] = {}
        self._payloads: dict[str, tuple[_Fields, bool] | str] = {}
        self._shape = _no_shape()
        self._node: str | None = None  # stands in for a missing host in incident keys

    def scan(self, lines: Iterable[str], first_line_no: int, folder: _Folder | None) -> Iterator[Any]:
        """The XID records of `lines`; with a `folder`, the incidents it closes instead.

        The loop is shaped for CPython's costs (a call, an allocation or a datetime sum each
        cost as much as several string tests): a line without "NVRM:" (almost every line of a
        real log) costs one substring test; a line of the shape costs a slice, a dictionary
        look-up, a `startswith` and the digit tests, and, when folding, one `_Folder.fold`
        call that only bumps its incident's count. Everything else goes through `_read`.
        """
        stats = self.stats
        reject = stats.reject
        read = self._read
        add: Callable[[XidRecord], None] | None = None
        fold: Callable[[_Key, int, str | None], bool] | None = None
        done: list[XidIncident] = []
        if folder is not None:
            add, fold, done = folder.add, folder.fold, folder.done
            if folder.node != self._node:
                self._node = folder.node
                self._shape = _no_shape()  # its keys were made with another node
        shape = self._shape
        head, counter_start, counter_end, mid, frac_start, frac_end, scale, shrink = shape.layout()
        tails_get = shape.tails.get
        rescale = scale != 1 or shrink != 1
        line_no = first_line_no - 1
        hits = 0  # Xid lines of the shape, added to `stats` at the end
        try:
            for line_no, line in enumerate(lines, start=first_line_no):
                if "NVRM:" not in line:
                    if "\x00" in line or "\ufffd" in line:
                        reject(line_no, _NOT_TEXT)
                    continue
                tail = tails_get(line[frac_end:])
                micros = 0
                if tail is not None:
                    if not line.startswith(head):
                        tail = None
                    elif frac_end != frac_start:
                        frac = line[frac_start:frac_end]
                        # `isdecimal` is what the regex's `\d` accepts: the counter's digits
                        # never enter the time, so non-ASCII ones change nothing; the fraction's
                        # would, so they go to `_read`.
                        if not (frac.isascii() and frac.isdigit()) or (
                            counter_end >= 0
                            and not (line[counter_start:counter_end].isdecimal() and line.startswith(mid, counter_end))
                        ):
                            tail = None
                        else:
                            micros = int(frac)
                            if rescale:
                                micros = micros * scale // shrink
                if tail is None:
                    record = read(line, line_no)
                    if self._shape is not shape:
                        shape = self._shape
                        head, counter_start, counter_end, mid, frac_start, frac_end, scale, shrink = shape.layout()
                        tails_get = shape.tails.get
                        rescale = scale != 1 or shrink != 1
                    if record is None:
                        continue
                else:
                    hits += 1
                    key, uuid, base_us, facts = tail
                    if fold is not None:
                        if base_us is not None:
                            if fold(key, base_us + micros, uuid):
                                continue
                        elif folder is not None and folder.fold_untimed(key, uuid):
                            continue
                    ts, host, (pci, xid, pid, process, message), log_format = facts
                    if micros and ts is not None:
                        ts += timedelta(0, 0, micros)  # positional: 2x faster than keywords
                    record = XidRecord(ts, host, pci, xid, pid, process, message, uuid, line_no, log_format)
                if add is None:
                    yield record
                else:
                    add(record)
                    if done:
                        yield from done
                        done.clear()
        finally:
            stats.lines += line_no - first_line_no + 1
            stats.xid_records += hits

    def _read(self, line: str, line_no: int) -> XidRecord | None:
        """Parse one line that mentions NVRM in full: its prefix by regex, then its payload."""
        cut = line.find("NVRM:")
        found = self._match_prefix(line[:cut])
        if found is None:
            spec, m, fmt, ts, host = None, None, "unknown", None, None
        else:
            spec, m = found
            ts = self._timestamp(spec, m) if spec.cache_ts else spec.timestamp(m, self._ctx)
            host = m["host"] if spec.has_host else None
            fmt = "journal_nohost" if spec.has_host and host is None else spec.name
        body = line[cut:].rstrip("\r\n")
        if body.startswith("NVRM: Xid"):
            parsed = self._payloads.get(body)
            if parsed is None:
                parsed = _parse_xid(body)
                if len(body) <= _CACHED_TEXT_MAX:
                    if len(self._payloads) >= _CACHE_LIMIT:
                        self._payloads.clear()
                    self._payloads[body] = parsed
            if isinstance(parsed, str):
                self.stats.reject(line_no, parsed)
                return None
            fields, truncated = parsed
            self.stats.xid_records += 1
            if truncated:
                self.stats.truncated_messages += 1
            pci, xid, pid, process, message = fields
            record = XidRecord(ts, host, pci, xid, pid, process, message, self._uuids.get((host, pci)), line_no, fmt)
            # Not learnt when cut: a line read through the shape would not be counted as cut.
            if m is not None and spec is not None and not truncated and len(line) <= _CACHED_TEXT_MAX:
                self._learn(line, cut, spec, m, record, fields)
            return record
        if "GPU at " in body:
            self._banner(body, host)
            return None
        return self._off_bus(body, ts, host, line_no, fmt)

    def _match_prefix(self, text: str) -> tuple[_Prefix, re.Match[str]] | None:
        prefixes = self._prefixes
        for i, spec in enumerate(prefixes):
            m = spec.pattern.fullmatch(text)
            if m is not None:
                if i:
                    prefixes.insert(0, prefixes.pop(i))
                return spec, m
        return None

    def _timestamp(self, spec: _Prefix, m: re.Match[str]) -> datetime | None:
        key = m.group()
        if len(key) > _CACHED_TEXT_MAX:
            return spec.timestamp(m, self._ctx)
        try:
            return self._ts_cache[key]
        except KeyError:
            pass
        if len(self._ts_cache) >= _CACHE_LIMIT:
            self._ts_cache.clear()
        ts = self._ts_cache[key] = spec.timestamp(m, self._ctx)
        return ts

    def _learn(self, line: str, cut: int, spec: _Prefix, m: re.Match[str], record: XidRecord, fields: _Fields) -> None:
        """Remember what `line`, an Xid line just read in full, says, under its layout."""
        frac_start, frac_end = m.span(spec.frac_group) if spec.frac_group in spec.pattern.groupindex else (-1, -1)
        counter_start, counter_end = m.span(spec.counter_group) if spec.counter_group is not None else (-1, -1)
        scale, shrink, micros = 0, 1, 0
        if frac_start < 0:
            frac_start = frac_end = head_end = cut
            counter_start = counter_end = -1
        else:
            frac = line[frac_start:frac_end]
            digits = frac_end - frac_start
            if (
                not frac.isascii()
                or digits > _MAX_STAMP_DIGITS
                or counter_start > frac_start
                or not line[counter_start:counter_end].isascii()
            ):
                return
            head_end = frac_start if counter_start < 0 else counter_start
            if spec.frac_in_ts:
                if spec.frac_is_micros:
                    scale = 1
                elif digits <= 6:
                    scale = 10 ** (6 - digits)
                else:
                    scale, shrink = 1, 10 ** (digits - 6)
                micros = int(frac) * scale // shrink
        layout = (
            line[:head_end],
            counter_start,
            counter_end,
            line[counter_end:frac_start] if counter_start >= 0 else "",
            frac_start,
            frac_end,
            scale,
            shrink,
        )
        shape = self._shape
        if shape.layout() != layout or len(shape.tails) >= _CACHE_LIMIT:
            shape = self._shape = _Shape(*layout)
        ts = record.ts
        if ts is not None:
            ts -= timedelta(0, 0, micros)
            if _to_us(ts) + 10 ** (frac_end - frac_start) * scale // shrink > _MAX_US:
                return  # a line of the layout could be past year 9999
        key = (record.host or self._node, record.pci_bus_id, record.xid)
        facts = (ts, record.host, fields, record.log_format)
        shape.tails[line[frac_end:]] = (key, record.gpu_uuid, None if ts is None else _to_us(ts), facts)

    def _banner(self, body: str, host: str | None) -> None:
        m = _BANNER.match(body)
        if m is not None:
            # A banner we cannot read costs only the UUID, not the events.
            with contextlib.suppress(ValueError):
                self._uuids[(host, normalise_pci_bus_id(m["pci"]))] = m["uuid"]
                self._shape.tails.clear()  # they hold the UUIDs known before

    def _off_bus(self, body: str, ts: datetime | None, host: str | None, line_no: int, fmt: str) -> XidRecord | None:
        pending = self._pending.get(host)
        if "fallen off the bus" in body:
            m = _OFF_BUS_START.match(body) or _OFF_BUS_ONE_LINE.match(body)
            if m is not None:
                return self._off_bus_record(m["pci"], ts, host, line_no, fmt)
            if pending is not None:
                del self._pending[host]
                return self._off_bus_record(pending.pci_bus_id, pending.ts, host, pending.line_no, pending.log_format)
            return None
        m = _OFF_BUS_START.match(body)
        if m is not None:
            self._pending[host] = _PendingOffBus(m["pci"], ts, line_no, fmt, OFF_BUS_LOOKAHEAD)
        elif pending is not None:
            pending.nvrm_lines_left -= 1
            if pending.nvrm_lines_left <= 0:
                del self._pending[host]
        return None

    def _off_bus_record(
        self, raw_pci: str, ts: datetime | None, host: str | None, line_no: int, fmt: str
    ) -> XidRecord | None:
        try:
            pci = normalise_pci_bus_id(raw_pci)
        except ValueError as exc:
            self.stats.reject(line_no, str(exc))
            return None
        self.stats.xid_records += 1
        uuid = self._uuids.get((host, pci))
        return XidRecord(ts, host, pci, OFF_BUS_XID, None, None, OFF_BUS_MESSAGE, uuid, line_no, fmt)


def _aware(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


def resolve_tz(tz: str | tzinfo | None) -> tzinfo:
    """A zoneinfo name, a tzinfo, or None (UTC) -> tzinfo; an unknown name is a ValueError."""
    if tz is None:
        return UTC
    if isinstance(tz, tzinfo):
        return tz
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"time zone {tz!r}: unknown; expected an IANA name such as 'Europe/Warsaw' or 'UTC'") from None


# -- public parsing API --------------------------------------------------------------------


def parse_lines(
    lines: Iterable[str],
    *,
    boot_time: datetime | None = None,
    reference_time: datetime | None = None,
    tz: str | tzinfo | None = None,
    stats: ParseStats | None = None,
    first_line_no: int = 1,
    capture_time: datetime | None = None,
) -> Iterator[XidRecord]:
    """XID records from a stream of log lines, in log order.

    - `capture_time`: when lines with no stamp at all were captured (plain `dmesg` payloads,
      `journalctl -o cat`); without it those records have `ts=None`.
    - `boot_time`: wall-clock time of boot, to place `/dev/kmsg` and `[uptime]` stamps; without
      it those records have `ts=None`.
    - `reference_time`: a time at or after the log's last line (e.g. the file's mtime), to give
      year-less journal stamps a year; without it those records have `ts=None`.
    - `tz`: time zone of naive stamps (ctime, journal); UTC by default.
    - `stats`: filled in as the stream is consumed (lines, records, rejected lines, messages
      cut to `MAX_MESSAGE_CHARS`).
    """
    parser = KernelLogParser(boot_time=boot_time, reference_time=reference_time, tz=tz, capture_time=capture_time)
    if stats is not None:
        parser.stats = stats
    return ParsedLines(parser, lines, first_line_no)


class ParsedLines(Iterator[XidRecord]):
    """What `parse_lines` returns: an iterator of records which `deduplicate` can also drive
    itself, folding flood lines into their incident without making a record of each."""

    def __init__(self, parser: KernelLogParser, lines: Iterable[str], first_line_no: int) -> None:
        self._parser = parser
        self._lines = lines
        self._first_line_no = first_line_no
        self._records: Iterator[XidRecord] | None = None

    def __iter__(self) -> Iterator[XidRecord]:
        # The generator itself, so that a `for` loop runs at generator speed.
        if self._records is None:
            self._records = self._parser.scan(self._lines, self._first_line_no, None)
        return self._records

    def __next__(self) -> XidRecord:
        return next(iter(self))

    def fold(self, folder: _Folder) -> Iterator[XidIncident] | None:
        """The incidents of the whole stream folded by `folder`; None once iteration began."""
        if self._records is not None:
            return None
        self._records = iter(())
        return self._parser.scan(self._lines, self._first_line_no, folder)


def parse_line(
    line: str,
    *,
    boot_time: datetime | None = None,
    reference_time: datetime | None = None,
    tz: str | tzinfo | None = None,
) -> XidRecord | None:
    """The XID record of one line, or None when the line is not an XID line.

    Raises ValueError, with the reason, for a line that looks like an Xid line but is malformed.
    """
    stats = ParseStats()
    records = list(parse_lines((line,), boot_time=boot_time, reference_time=reference_time, tz=tz, stats=stats))
    if stats.rejected_lines:
        raise ValueError(f"{line.strip()!r}: {stats.rejected_lines[0].reason}")
    return records[0] if records else None


# -- deduplication -------------------------------------------------------------------------


@dataclass(slots=True)
class XidIncident:
    """Identical XID lines of one GPU folded together: one row of `xid_events`."""

    ts: datetime | None  # first line
    last_ts: datetime | None  # last line folded in
    node: str | None
    pci_bus_id: str
    xid: int
    pid: int | None
    process: str | None
    message: str
    gpu_uuid: str | None
    repeat_count: int
    first_line_no: int


# Expired incidents are swept out every this many records, so memory holds only incidents
# that started within the last window, whatever the length of the stream.
_SWEEP_EVERY = 1024


def deduplicate(records: Iterable[XidRecord], window: timedelta, *, node: str | None = None) -> Iterator[XidIncident]:
    """Fold records of the same (node, bus id, xid) within `window` of an incident's first line.

    Streams: an incident is yielded once a record of its key falls outside its window, or once
    the stream's latest time has moved past it, or at the end; so incidents come out roughly,
    not strictly, in time order. `node` stands in for records whose line has no host.
    A record with a different GPU UUID (a replaced GPU) starts a new incident.
    Records without a time cannot be windowed: those of one key fold into one incident.
    Incident times are in UTC.
    """
    if window < timedelta(0):
        raise ValueError(f"dedup window {window}: expected a duration >= 0")
    folder = _Folder(window, node)
    folded = records.fold(folder) if isinstance(records, ParsedLines) else None
    if folded is not None:
        yield from folded
    else:
        add, done = folder.add, folder.done
        for rec in records:
            add(rec)
            if done:
                yield from done
                done.clear()
    yield from folder.finish()


# An open incident as `_Folder` keeps it: [incident, earliest, latest, first, last], times in
# microseconds since the epoch (earliest/latest: its window). A list, not an object: a flood
# reads and bumps these once per line, and integers compare several times faster than
# datetimes. `incident.last_ts` is set from `last` when the incident is closed.
_Open = list  # type: ignore[type-arg]


class _Folder:
    """The state of `deduplicate`: open incidents, and those done but not yet yielded."""

    def __init__(self, window: timedelta, node: str | None) -> None:
        self.window_us = window // _ONE_US
        self.node = node
        self.open: dict[_Key, _Open] = {}
        self.untimed: dict[_Key, XidIncident] = {}
        self.done: list[XidIncident] = []
        self.watermark: int | None = None
        self.countdown = _SWEEP_EVERY

    def add(self, rec: XidRecord) -> None:
        key = (rec.host or self.node, rec.pci_bus_id, rec.xid)
        if rec.ts is None:
            if not self.fold_untimed(key, rec.gpu_uuid):
                incident = self.untimed.get(key)
                if incident is not None:
                    self.done.append(incident)
                self.untimed[key] = _new_incident(rec, key[0])
            return
        ts_us = _to_us(rec.ts)
        if self.fold(key, ts_us, rec.gpu_uuid):
            return
        entry = self.open.pop(key, None)
        if entry is not None:
            self.done.append(_close(entry))
        self.open[key] = [_new_incident(rec, key[0]), ts_us - self.window_us, ts_us + self.window_us, ts_us, ts_us]
        if self.watermark is None or ts_us > self.watermark:
            self.watermark = ts_us
        self.countdown -= 1
        if self.countdown <= 0:
            self.countdown = _SWEEP_EVERY
            self.done.extend(_sweep(self.open, self.watermark - self.window_us))

    def fold(self, key: _Key, ts_us: int, uuid: str | None) -> bool:
        """Fold a line at `ts_us` into its key's open incident if it is of the same GPU and
        within the window; False when it starts a new incident (`add` does that)."""
        entry = self.open.get(key)
        if entry is None or not entry[1] <= ts_us <= entry[2]:
            return False
        incident = entry[0]
        if uuid is not None and uuid != incident.gpu_uuid:
            if incident.gpu_uuid is not None:
                return False  # another GPU at this bus id
            incident.gpu_uuid = uuid  # a UUID learnt mid-incident
        incident.repeat_count += 1
        if ts_us > entry[4]:
            entry[4] = ts_us
        elif ts_us < entry[3]:
            # A line earlier than the incident's first (merged syslog streams arrive slightly
            # out of order): it starts there, and so does its window.
            incident.ts = _from_us(ts_us)
            entry[1], entry[2], entry[3] = ts_us - self.window_us, ts_us + self.window_us, ts_us
        return True

    def fold_untimed(self, key: _Key, uuid: str | None) -> bool:
        """Fold an untimed line into its key's incident if it is of the same GPU."""
        incident = self.untimed.get(key)
        if incident is None or not (uuid is None or incident.gpu_uuid is None or uuid == incident.gpu_uuid):
            return False
        incident.repeat_count += 1
        if incident.gpu_uuid is None:
            incident.gpu_uuid = uuid
        return True

    def finish(self) -> Iterator[XidIncident]:
        yield from self.done
        self.done.clear()
        yield from (_close(entry) for entry in sorted(self.open.values(), key=lambda entry: entry[3]))
        yield from self.untimed.values()


def _close(entry: _Open) -> XidIncident:
    incident: XidIncident = entry[0]
    if entry[4] != entry[3]:
        incident.last_ts = _from_us(entry[4])
    return incident


def _new_incident(rec: XidRecord, node: str | None) -> XidIncident:
    return XidIncident(
        rec.ts, rec.ts, node, rec.pci_bus_id, rec.xid, rec.pid, rec.process, rec.message, rec.gpu_uuid, 1, rec.line_no
    )


def _sweep(open_: dict[_Key, _Open], before: int) -> Iterator[XidIncident]:
    expired = [key for key, entry in open_.items() if entry[3] < before]
    for key in expired:
        yield _close(open_.pop(key))
