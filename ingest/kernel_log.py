"""XID events from kernel-log text, in every format the NVIDIA driver's lines reach us in.

The driver prints one line per XID (DOMAIN.md 3):

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.

but that line arrives wrapped in whatever prefix the collecting tool adds: `/dev/kmsg` records,
`dmesg` with uptime, ctime or ISO stamps, journald's short format (possibly with a localized
month), RFC 3339 syslog, or nothing at all. This module recognises the prefix, turns its stamp
into a UTC time where that is possible, and parses the NVRM payload.

Everything here is a pure function of text and of the times the caller passes in (boot time,
reference time, time zone): no files, no clock. `ingest.kernel_log_ingest` does the I/O.

Two things are not one-line-one-event:
- `NVRM: GPU at PCI:0000:0b:00: GPU-<uuid>` banners say which GPU sits at a bus id; later
  records of that bus id carry the UUID.
- A GPU can fall off the bus with no Xid line at all, only a multi-line "The NVIDIA GPU
  <bus id> ... has fallen off the bus" message; that becomes an XID 79 record, because for
  labelling it is the same event.

Floods (hundreds of thousands of identical lines) are folded by `deduplicate`, which streams
and keeps only the incidents still open.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ingest.schema import normalise_pci_bus_id

OFF_BUS_XID = 79
OFF_BUS_MESSAGE = "GPU has fallen off the bus (from the NVRM off-the-bus text; the driver printed no Xid line)"

# How many later NVRM lines may separate "The NVIDIA GPU <bus id>" from "fallen off the bus":
# the driver prints the message as 2-3 lines, and other GPUs' lines may interleave.
OFF_BUS_LOOKAHEAD = 6

# A huge garbage file must not make the parser hold one entry per bad line.
MAX_REJECTED_KEPT = 1000

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
    """Counts for one parsed stream; `rejected_lines` keeps the first `MAX_REJECTED_KEPT`."""

    lines: int = 0
    xid_records: int = 0
    rejected: int = 0
    rejected_lines: list[RejectedLine] = field(default_factory=list)

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


def _ts_none(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    return None


def _ts_kmsg(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    # /dev/kmsg stamps are microseconds of CLOCK_MONOTONIC since boot.
    if ctx.boot_time is None:
        return None
    return ctx.boot_time + timedelta(0, 0, int(m["usec"]))  # positional: 2x faster than keywords


def _micros(frac: str) -> int:
    """Microseconds of a fraction's digits, truncated past six as `fromisoformat` does."""
    return int(frac) if len(frac) == 6 else int(frac[:6].ljust(6, "0"))


def _ts_uptime(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    if ctx.boot_time is None:
        return None
    sec, frac = m.group("sec", "frac")
    return ctx.boot_time + timedelta(0, int(sec), _micros(frac))


def _ts_ctime(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    month = MONTHS.get(m["mon"].lower().rstrip("."))
    if month is None:
        return None
    hour, minute, second = (int(x) for x in m["hms"].split(":"))
    try:
        local = datetime(int(m["year"]), month, int(m["day"]), hour, minute, second, tzinfo=ctx.tz)
    except ValueError:
        return None
    return local.astimezone(UTC)


def _ts_iso(m: re.Match[str], ctx: _TimeContext) -> datetime | None:
    return _iso_to_utc(m["iso"], ctx.tz)


def _iso_to_utc(stamp: str, tz: tzinfo) -> datetime | None:
    try:
        moment = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=tz)
    return moment.astimezone(UTC)


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
        except ValueError:
            continue
        if moment <= limit:
            return moment
    return None


@dataclass(frozen=True, slots=True)
class _Prefix:
    name: str
    pattern: re.Pattern[str]  # the prefix alone, matched against the text before "NVRM:"
    xid_prefix: re.Pattern[str]  # the prefix when an Xid line follows it: the fast path
    timestamp: Callable[[re.Match[str], _TimeContext], datetime | None]
    has_host: bool
    # Stamps with one-second resolution repeat thousands of times in a flood: cache them.
    cache_ts: bool
    # For the prefix cache (see `_PrefixShape`): the group whose digits change from line to
    # line and move the time (a fraction of a second; kmsg: a count of microseconds), whether
    # they do move it (journal's fraction does not), and a group whose digits change on every
    # line without entering the time (kmsg's sequence number), which must come before it.
    frac_group: str
    frac_in_ts: bool
    frac_is_micros: bool
    counter_group: str | None


# A well-formed Xid payload. Anything that contains "NVRM: Xid" but does not match this goes
# the slow way, which explains what is wrong with it.
_XID_FAST = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): (?P<code>[0-9]+)"
    r"(?:, *(?:pid=(?P<pid>[^,]*), *)?(?:name=(?P<name>[^,]*)(?:, *|$))?(?P<msg>.*))?\s*\Z"
)


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
        xid_prefix=re.compile(rf"(?:{source})(?=NVRM: Xid \()"),
        timestamp=timestamp,
        has_host=has_host,
        cache_ts=cache_ts,
        frac_group=frac_group,
        frac_in_ts=frac_in_ts,
        frac_is_micros=frac_is_micros,
        counter_group=counter_group,
    )


# Tried in this order at first, then the last successful one first: one file almost always
# holds one format, so the first try usually matches.
PREFIXES: tuple[_Prefix, ...] = (
    _prefix("bare", r"\s*(?:<\d+>)?\s*", _ts_none),
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

_XID = re.compile(r"NVRM: Xid *\((?:PCI:)?(?P<pci>[^)]*)\): *(?P<code>[^,]*?) *(?:,(?P<rest>.*))?")
_BANNER = re.compile(r"NVRM: GPU at (?:PCI:)?(?P<pci>[0-9a-fA-F]+:[0-9a-fA-F]+:[0-9a-fA-F.]+): (?P<uuid>GPU-[^\s,;]+)")
_PCI = r"(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)"
_OFF_BUS_START = re.compile(rf"NVRM: The NVIDIA GPU {_PCI}")
_OFF_BUS_ONE_LINE = re.compile(rf"NVRM: GPU {_PCI}:? .*fallen off the bus")
_UNKNOWN = ("<unknown>", "'<unknown>'", "")

# What an Xid line says: time, host, log format and the payload's (bus id, xid, pid, process,
# message).
_Fields = tuple[str, int, int | None, str | None, str]
_Known = tuple[datetime | None, str | None, str, _Fields]

# Bound on the per-parser caches (timestamps, bus ids), so a long log cannot grow them forever.
_CACHE_LIMIT = 4096


@dataclass(frozen=True, slots=True)
class _PrefixShape:
    """What one prefix regex match established, reusable without the regex.

    In a flood, consecutive prefixes differ only in the digits of their sub-second field
    (`[103304.000100]`, `...T04:41:44,000100+00:00`) and, for kmsg, of the sequence number.
    Python's regex engine treats every ASCII digit alike (no prefix pattern names a particular
    digit), so a line equal to an already matched one outside those digit fields, with as many
    ASCII digits inside them, takes the same path through the prefix's regex: same spec, same
    host, same groups. Only the time is recomputed: the time at a zero fraction plus the
    fraction. Stamps count whole seconds and zone offsets are whole seconds too, so the sum is
    exact.

    `micros` is that check done with string methods (no regex, no slicing of the literal
    parts), the first step of the hot path: the line is `head`, counter digits, `mid`,
    fraction digits, then `tail`, which ends with the "NVRM: Xid (" that starts the payload.
    """

    spec: _Prefix
    host: str | None
    log_format: str
    ts: datetime | None  # the time at a zero fraction; None when the format cannot place it
    base_us: int | None  # `ts` in microseconds since the epoch: what `deduplicate` compares
    head: str
    counter_start: int  # kmsg's sequence number; -1 for the other formats
    counter_end: int
    mid: str
    frac_start: int  # == frac_end when the prefix has no fraction
    frac_end: int
    tail: str
    payload_start: int
    # The fraction's microseconds are int(digits) * scale // shrink: 6 digits -> 1 // 1,
    # 3 digits -> 1000 // 1, 9 digits -> 1 // 1000 (truncated, as `fromisoformat` does),
    # kmsg's count of microseconds -> 1 // 1, a fraction the time ignores (journal) -> 0 // 1.
    scale: int
    shrink: int

    def micros(self, line: str) -> int:
        """The microseconds of `line`'s fraction if `line` has this shape, else -1."""
        if not (line.startswith(self.head) and line.startswith(self.tail, self.frac_end)):
            return -1
        if self.counter_start >= 0:
            counter = line[self.counter_start : self.counter_end]
            if not (counter.isascii() and counter.isdigit() and line.startswith(self.mid, self.counter_end)):
                return -1
        if self.frac_start == self.frac_end:
            return 0
        frac = line[self.frac_start : self.frac_end]
        if not (frac.isascii() and frac.isdigit()):
            return -1
        return int(frac) * self.scale // self.shrink


_NO_FRACTION = (-1, -1)
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


@dataclass(slots=True)
class _PendingOffBus:
    pci_bus_id: str
    ts: datetime | None
    line_no: int
    log_format: str
    nvrm_lines_left: int


class KernelLogParser:
    """Stateful line-by-line parser: remembers banner UUIDs and half-seen off-bus messages.

    Feed it lines in log order with `feed`; it returns an `XidRecord` for each XID and counts
    rejected lines in `stats` (`stats.lines` is kept by `parse_lines`). `parse_lines` is the
    usual way to drive it.
    """

    def __init__(
        self,
        *,
        boot_time: datetime | None = None,
        reference_time: datetime | None = None,
        tz: str | tzinfo | None = None,
    ) -> None:
        self._ctx = _TimeContext(
            # In UTC, so that uptime and kmsg records are in UTC like the others.
            boot_time=_aware(boot_time).astimezone(UTC) if boot_time is not None else None,
            reference_time=_aware(reference_time) if reference_time is not None else None,
            tz=resolve_tz(tz),
        )
        self.stats = ParseStats()
        self._prefixes = list(PREFIXES)
        self._uuids: dict[tuple[str | None, str], str] = {}
        self._pending: dict[str | None, _PendingOffBus] = {}
        self._ts_cache: dict[str, datetime | None] = {}
        self._payloads: dict[str, _Fields] = {}
        # Prefixes already matched, keyed by their text outside the digit fields; all of one
        # span (`_span`), and all of the spec in front of `_prefixes`, so that a hit gives
        # what trying the prefixes in order would give.
        self._shapes: dict[str, _PrefixShape] = {}
        self._span = _NO_FRACTION
        self._counter = _NO_FRACTION  # kmsg's sequence number: digits outside the key as well
        # The shape of the last Xid line: in a flood, the next line almost always has it too,
        # and `_PrefixShape.micros` checks that without building the key. Always one of
        # `_shapes` (None when that is empty), so what holds for them holds for it.
        self._hot: _PrefixShape | None = None
        self.uuid_changes = 0  # banners read: what the hot path knows of UUIDs is stale after one

    def feed(self, line: str, line_no: int) -> XidRecord | None:
        # Cheap substring tests first: almost no line of a real log mentions NVRM, and in a
        # flood almost every one is a well-formed Xid line that one regex match fully parses.
        if "NVRM:" not in line:
            if "\x00" in line or "\ufffd" in line:
                self.stats.reject(line_no, "not text (NUL or undecodable bytes)")
            return None
        start = line.find("NVRM: Xid (")
        if start >= 0:
            known = self._xid_known_prefix(line, start) if self._shapes else None
            record = None if known is None else self._record(known, line_no)
            if record is None:
                record = self._xid_fast(line, start, line_no)
            if record is not None:
                return record
        return self._slow(line, line_no)

    def _xid_known_prefix(self, line: str, start: int) -> _Known | None:
        """(time, host, log format, payload fields) of an Xid line whose prefix `_shapes` knows,
        else None (then try the regex). Makes that shape the hot one. Counts nothing."""
        shape = self._hot
        micros = shape.micros(line) if shape is not None else -1
        if shape is None or micros < 0:
            key = self._shape_key(line, start)
            found = self._shapes.get(key) if key is not None else None
            if found is None:
                return None
            micros = found.micros(line)  # the key matched: only the digits can be wrong
            if micros < 0:
                return None
            shape = self._hot = found
        payload = line[shape.payload_start :]
        fields = self._payloads.get(payload)
        if fields is None:
            fields = self._payload_fields(payload)
            if fields is None:
                return None
        ts = shape.ts
        if micros and ts is not None:
            ts += timedelta(0, 0, micros)  # positional: 2x faster than keywords
        return ts, shape.host, shape.log_format, fields

    def _shape_key(self, line: str, start: int) -> str | None:
        """The `_shapes` key of a line whose payload starts at `start`: its text outside the
        digit fields of the shapes now cached (`_span`, `_counter`)."""
        frac_start, frac_end = self._span
        if frac_start < 0:
            return line[:start]
        if frac_end > start:
            return None
        counter_start, counter_end = self._counter
        if counter_start < 0:
            return line[:frac_start] + line[frac_end:start]
        return line[:counter_start] + line[counter_end:frac_start] + line[frac_end:start]

    def _record(self, known: _Known, line_no: int) -> XidRecord:
        ts, host, fmt, (pci, xid, pid, process, message) = known
        self.stats.xid_records += 1
        uuid = self._uuids.get((host, pci)) if self._uuids else None
        return XidRecord(ts, host, pci, xid, pid, process, message, uuid, line_no, fmt)

    def _xid_fast(self, line: str, start: int, line_no: int) -> XidRecord | None:
        prefixes = self._prefixes
        spec = prefixes[0]
        m = spec.xid_prefix.match(line)
        if m is None:
            for i in range(1, len(prefixes)):
                m = prefixes[i].xid_prefix.match(line)
                if m is not None:
                    spec = prefixes.pop(i)
                    prefixes.insert(0, spec)
                    self._shapes.clear()  # they were all of the spec that was in front
                    self._hot = None
                    break
            else:
                return None
        # Flood lines differ only in their stamp: the payload after it is parsed once.
        payload = line[m.end() :]
        fields = self._payloads.get(payload)
        if fields is None:
            fields = self._payload_fields(payload)
            if fields is None:
                return None  # the slow path rejects it with the reason
        ts = self._timestamp(spec, m) if spec.cache_ts else spec.timestamp(m, self._ctx)
        if spec.has_host:
            host = m["host"]
            fmt = spec.name if host is not None else "journal_nohost"
        else:
            host, fmt = None, spec.name
        if m.end() == start:
            self._remember_shape(line, start, m, spec, ts, host, fmt)
        pci, xid, pid, process, message = fields
        self.stats.xid_records += 1
        uuid = self._uuids.get((host, pci)) if self._uuids else None
        return XidRecord(ts, host, pci, xid, pid, process, message, uuid, line_no, fmt)

    def _remember_shape(
        self, line: str, start: int, m: re.Match[str], spec: _Prefix, ts: datetime | None, host: str | None, fmt: str
    ) -> None:
        """Cache the shape of an Xid line just parsed by `spec`'s regex, and make it the hot one."""
        frac_start, frac_end = m.span(spec.frac_group) if spec.frac_group in spec.pattern.groupindex else _NO_FRACTION
        counter = m.span(spec.counter_group) if spec.counter_group is not None else _NO_FRACTION
        scale, shrink = 0, 1
        if frac_start < 0:
            counter = _NO_FRACTION
            head_end = start
        else:
            frac = line[frac_start:frac_end]
            if not frac.isascii() or counter[0] > frac_start or not line[counter[0] : counter[1]].isascii():
                return
            head_end = frac_start if counter[0] < 0 else counter[0]
            if spec.frac_in_ts:
                digits = frac_end - frac_start
                if spec.frac_is_micros:
                    scale = 1
                elif digits <= 6:
                    scale = 10 ** (6 - digits)
                else:
                    scale, shrink = 1, 10 ** (digits - 6)
                if ts is not None:
                    ts -= timedelta(0, 0, int(frac) * scale // shrink)  # the time at a zero fraction
        if (frac_start, frac_end) != self._span or counter != self._counter or len(self._shapes) >= _CACHE_LIMIT:
            self._shapes.clear()
            self._span = (frac_start, frac_end)
            self._counter = counter
        if frac_start < 0:
            frac_start = frac_end = start
        shape = _PrefixShape(
            spec=spec,
            host=host,
            log_format=fmt,
            ts=ts,
            base_us=None if ts is None else _to_us(ts),
            head=line[:head_end],
            counter_start=counter[0],
            counter_end=counter[1],
            mid=line[counter[1] : frac_start] if counter[0] >= 0 else "",
            frac_start=frac_start,
            frac_end=frac_end,
            tail=line[frac_end : start + len("NVRM: Xid (")],
            payload_start=start,
            scale=scale,
            shrink=shrink,
        )
        key = self._shape_key(line, start)
        assert key is not None  # the fraction is in the prefix, before `start`
        self._shapes[key] = shape
        self._hot = shape

    def _payload_fields(self, payload: str) -> _Fields | None:
        """Parse a payload not in `_payloads` (callers look there first) and cache it."""
        fields = _parse_payload(payload)
        if fields is None:
            return None
        if len(self._payloads) >= _CACHE_LIMIT:
            self._payloads.clear()
        self._payloads[payload] = fields
        return fields

    def _timestamp(self, spec: _Prefix, m: re.Match[str]) -> datetime | None:
        key = m.group()
        try:
            return self._ts_cache[key]
        except KeyError:
            pass
        if len(self._ts_cache) >= _CACHE_LIMIT:
            self._ts_cache.clear()
        ts = self._ts_cache[key] = spec.timestamp(m, self._ctx)
        return ts

    def _slow(self, line: str, line_no: int) -> XidRecord | None:
        cut = line.find("NVRM:")
        prefix = self._match_prefix(line[:cut])
        if prefix is None:
            fmt, ts, host = "unknown", None, None
        else:
            spec, m = prefix
            fmt, ts = spec.name, spec.timestamp(m, self._ctx)
            host = m["host"] if spec.has_host else None
            if host is None and fmt == "journal":
                fmt = "journal_nohost"
        body = line[cut:].rstrip("\r\n")
        if body.startswith("NVRM: Xid"):
            return self._xid(body, ts, host, line_no, fmt)
        if "GPU at " in body:
            self._banner(body, host)
            return None
        return self._off_bus(body, ts, host, line_no, fmt)

    def _match_prefix(self, text: str) -> tuple[_Prefix, re.Match[str]] | None:
        for spec in self._prefixes:
            m = spec.pattern.fullmatch(text)
            if m is not None:
                return spec, m
        return None

    def _xid(self, body: str, ts: datetime | None, host: str | None, line_no: int, fmt: str) -> XidRecord | None:
        m = _XID.fullmatch(body)
        if m is None:
            self.stats.reject(line_no, "Xid line not of the form 'NVRM: Xid (PCI:dddd:bb:dd): <code>, ...'")
            return None
        code = m["code"]
        if not (code.isascii() and code.isdigit()):
            self.stats.reject(line_no, f"Xid code {code!r} is not a number")
            return None
        try:
            pci = normalise_pci_bus_id(m["pci"])
        except ValueError as exc:
            self.stats.reject(line_no, str(exc))
            return None
        pid, process, message = _split_rest(m["rest"] or "")
        self.stats.xid_records += 1
        return XidRecord(ts, host, pci, int(code), pid, process, message, self._uuids.get((host, pci)), line_no, fmt)

    def _banner(self, body: str, host: str | None) -> None:
        m = _BANNER.match(body)
        if m is not None:
            # A banner we cannot read costs only the UUID, not the events.
            with contextlib.suppress(ValueError):
                self._uuids[(host, normalise_pci_bus_id(m["pci"]))] = m["uuid"]
                self.uuid_changes += 1

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


def _parse_payload(payload: str) -> _Fields | None:
    """(bus id, xid, pid, process, message) of a well-formed `NVRM: Xid ...` text, else None."""
    m = _XID_FAST.match(payload)
    if m is None:
        return None
    raw_pci, code, raw_pid, name, msg = m.group("pci", "code", "pid", "name", "msg")
    try:
        pci = normalise_pci_bus_id(raw_pci)
    except ValueError:
        return None
    pid = None
    if raw_pid is not None:
        raw_pid = raw_pid.strip()
        if raw_pid.isdigit():
            pid = int(raw_pid)
    if name is not None:
        name = name.strip()
        if name in _UNKNOWN:
            name = None
    return pci, int(code), pid, name, msg.strip() if msg else ""


def _split_rest(rest: str) -> tuple[int | None, str | None, str]:
    """`pid=12, name=python3, Ch 00000008` -> (12, "python3", "Ch 00000008").

    Split by hand rather than by regex: this runs once per line of a flood. Process names may
    hold ':' '[' '.' (`nvc:[driver]`, `ray::WorkerDict`) but not ','.
    """
    text = rest.strip()
    pid: int | None = None
    process: str | None = None
    if text.startswith("pid="):
        raw_pid, _, text = text[4:].partition(",")
        raw_pid = raw_pid.strip()
        # A garbled pid loses the pid only: the XID itself is still worth keeping.
        pid = int(raw_pid) if raw_pid.isascii() and raw_pid.isdigit() else None
        text = text.lstrip()
    if text.startswith("name="):
        raw_name, _, text = text[5:].partition(",")
        raw_name = raw_name.strip()
        process = None if raw_name in _UNKNOWN else raw_name
        text = text.strip()
    return pid, process, text


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
) -> Iterator[XidRecord]:
    """XID records from a stream of log lines, in log order.

    - `boot_time`: wall-clock time of boot, to place `/dev/kmsg` and `[uptime]` stamps; without
      it those records have `ts=None`.
    - `reference_time`: a time at or after the log's last line (e.g. the file's mtime), to give
      year-less journal stamps a year; without it those records have `ts=None`.
    - `tz`: time zone of naive stamps (ctime, journal); UTC by default.
    - `stats`: filled in as the stream is consumed (lines, records, rejected lines).
    """
    parser = KernelLogParser(boot_time=boot_time, reference_time=reference_time, tz=tz)
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
            self._records = self._parse()
        return self._records

    def __next__(self) -> XidRecord:
        return next(iter(self))

    # The two loops below are the hot path of a flood, shaped for CPython's costs: a call, an
    # allocation or a datetime sum each cost as much as several string tests, so
    #  - the first test is `"NVRM:" in line`, which stops almost every line of a real log;
    #  - an Xid line with the hot shape (the previous Xid line's, which in a flood the next
    #    line nearly always has too) is parsed with string tests and dictionary look-ups, no
    #    regex: `_parse` checks it with `_PrefixShape.micros`; `_incidents` goes further;
    #  - anything else goes through `feed`, which handles every line the same way on its own.
    # `tests/ingest/test_kernel_log_prefix_cache.py` and `test_kernel_log_hot_path.py` check
    # that both give what `feed` gives.

    def _parse(self) -> Iterator[XidRecord]:
        parser = self._parser
        feed = parser.feed
        payloads = parser._payloads  # cleared in place, never replaced
        uuids = parser._uuids
        stats = parser.stats
        hot = parser._hot
        first = self._first_line_no
        line_no = first - 1
        try:
            for line_no, line in enumerate(self._lines, start=first):
                if "NVRM:" in line:
                    if hot is not None:
                        micros = hot.micros(line)
                        if micros >= 0:
                            fields = payloads.get(line[hot.payload_start :])
                            if fields is not None:
                                pci, xid, pid, process, message = fields
                                ts = hot.ts
                                if micros and ts is not None:
                                    ts += timedelta(0, 0, micros)
                                host = hot.host
                                uuid = uuids.get((host, pci)) if uuids else None
                                stats.xid_records += 1
                                yield XidRecord(
                                    ts, host, pci, xid, pid, process, message, uuid, line_no, hot.log_format
                                )
                                continue
                    record = feed(line, line_no)
                    hot = parser._hot
                    if record is not None:
                        yield record
                elif "\x00" in line or "\ufffd" in line:
                    feed(line, line_no)  # rejects it, with the reason
        finally:
            stats.lines += line_no - first + 1

    def _incidents(self, folder: _Folder) -> Iterator[XidIncident]:
        """`_parse` and `deduplicate` in one loop: a flood line with the hot prefix which
        falls into an open incident only bumps that incident's count.

        Per flood line this costs one dictionary look-up of the text after the fraction
        (`_HotTails`: it checks the rest of the prefix and the payload at once, and gives the
        incident's key ready made), one `startswith` for the text before it, the digit tests,
        and the fold, all inline: here a call costs more than any of these.
        """
        parser = self._parser
        feed = parser.feed
        stats = parser.stats
        open_get = folder.open.get
        add = folder.add
        done = folder.done
        first = self._first_line_no
        line_no = first - 1
        xid_lines = 0  # Xid lines of the hot path, added to `stats` at the end

        hot = _HotTails(parser, folder.node)
        tails_get, head, frac_start, frac_end, counter_start, counter_end, mid, base_us, scale, shrink = hot.locals()
        rescale = scale != 1 or shrink != 1
        try:
            for line_no, line in enumerate(self._lines, start=first):
                if "NVRM:" not in line:
                    if "\x00" in line or "\ufffd" in line:
                        feed(line, line_no)  # rejects it, with the reason
                    continue
                known = tails_get(line[frac_end:])
                if known is not None and line.startswith(head):
                    # The digits: checked here rather than in the look-up, which they would
                    # make miss on every line. kmsg's sequence number comes first.
                    micros = 0
                    if frac_end > frac_start:
                        frac = line[frac_start:frac_end]
                        if not (frac.isascii() and frac.isdigit()):
                            known = None
                        elif counter_end >= 0:
                            # `isdecimal` is what the regex's `\d` accepts: the counter's
                            # digits never enter the time, so non-ASCII ones change nothing.
                            counter = line[counter_start:counter_end]
                            if not (counter.isdecimal() and line[counter_end:frac_start] == mid):
                                known = None
                        if known is not None:
                            micros = int(frac)
                            if rescale:
                                micros = micros * scale // shrink
                    if known is not None:
                        xid_lines += 1
                        key, uuid, fields = known
                        if base_us is not None:
                            # `_Folder.add`'s common case, inlined: most lines of a flood.
                            ts_us = base_us + micros
                            entry = open_get(key)
                            if (
                                entry is not None
                                and entry[1] <= ts_us <= entry[2]
                                and (uuid is None or uuid == entry[0].gpu_uuid)
                            ):
                                entry[0].repeat_count += 1
                                if ts_us > entry[4]:
                                    entry[4] = ts_us
                                elif ts_us < entry[3]:
                                    folder.move_start(entry, ts_us)
                                continue
                        elif folder.fold_untimed(*key, uuid):
                            continue
                        add(hot.record(fields, micros, uuid, line_no))
                        if done:
                            yield from done
                            done.clear()
                        continue
                record = feed(line, line_no)
                if hot.stale():
                    hot = _HotTails(parser, folder.node)
                    tails_get, head, frac_start, frac_end, counter_start, counter_end, mid, base_us, scale, shrink = (
                        hot.locals()
                    )
                    rescale = scale != 1 or shrink != 1
                if record is not None:
                    hot.learn(line)
                    add(record)
                    if done:
                        yield from done
                        done.clear()
        finally:
            stats.lines += line_no - first + 1
            stats.xid_records += xid_lines


# What `_HotTails` knows of one text after the fraction: the incident key, the GPU's UUID
# from a banner, and the payload fields.
_TailFacts = tuple[tuple[str | None, str, int], str | None, _Fields]


class _HotTails:
    """The hot shape of `_incidents`, seen from the end of the line.

    The text after the fraction (the rest of the prefix, then the payload) repeats across a
    flood with a handful of values, one per GPU and message; a dictionary of those gives, with
    one look-up, that the line has the shape's tail and which incident key, UUID and payload
    fields it has. Learnt from lines that `feed` has just parsed as Xid lines of the shape.
    Stale once the parser's hot shape or its banners change.
    """

    def __init__(self, parser: KernelLogParser, node: str | None) -> None:
        self.parser = parser
        self.shape = parser._hot
        self.uuid_changes = parser.uuid_changes
        self.node = node
        self.tails: dict[str, _TailFacts] = {}

    def locals(
        self,
    ) -> tuple[Callable[[str], _TailFacts | None], str, int, int, int, int, str, int | None, int, int]:
        """What the loop keeps in local variables: tails look-up, head, fraction span, counter
        span (-1: none), text between counter and fraction, base time, scale, shrink."""
        shape = self.shape
        if shape is None:  # every look-up misses
            return self.tails.get, "", 0, 0, -1, -1, "", None, 0, 1
        return (
            self.tails.get,
            shape.head,
            shape.frac_start,
            shape.frac_end,
            shape.counter_start,
            shape.counter_end,
            shape.mid,
            shape.base_us,
            shape.scale,
            shape.shrink,
        )

    def stale(self) -> bool:
        return self.parser._hot is not self.shape or self.parser.uuid_changes != self.uuid_changes

    def learn(self, line: str) -> None:
        """Remember the tail of `line`, an Xid line `feed` has just parsed, if it has the shape."""
        shape = self.shape
        if shape is None or shape.micros(line) < 0:
            return
        fields = self.parser._payloads.get(line[shape.payload_start :])
        if fields is None:
            return
        if len(self.tails) >= _CACHE_LIMIT:
            self.tails.clear()
        host = shape.host
        uuid = self.parser._uuids.get((host, fields[0]))
        self.tails[line[shape.frac_end :]] = ((host or self.node, fields[0], fields[1]), uuid, fields)

    def record(self, fields: _Fields, micros: int, uuid: str | None, line_no: int) -> XidRecord:
        shape = self.shape
        assert shape is not None  # a tail was found: a shape is hot
        ts = shape.ts
        if micros and ts is not None:
            ts += timedelta(0, 0, micros)
        pci, xid, pid, process, message = fields
        return XidRecord(ts, shape.host, pci, xid, pid, process, message, uuid, line_no, shape.log_format)


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
    parser = KernelLogParser(boot_time=boot_time, reference_time=reference_time, tz=tz)
    record = parser.feed(line, 1)
    if parser.stats.rejected_lines:
        raise ValueError(f"{line.strip()!r}: {parser.stats.rejected_lines[0].reason}")
    return record


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
    if isinstance(records, ParsedLines) and records._records is None:
        yield from records._incidents(folder)
    else:
        add, done = folder.add, folder.done
        for rec in records:
            add(rec)
            if done:
                yield from done
                done.clear()
    yield from folder.finish()


_Key = tuple[str | None, str, int]

# An open incident as `_Folder` keeps it: [incident, earliest, latest, first, last], times in
# microseconds since the epoch (earliest/latest: its window). A list, not an object: the hot
# path reads and bumps these once per flood line, and integers compare several times faster
# than datetimes. `incident.last_ts` is set from `last` when the incident is closed.
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

    def move_start(self, entry: _Open, ts_us: int) -> None:
        """An incident's line earlier than its first (merged syslog streams arrive slightly
        out of order): it starts there, and so does its window."""
        entry[0].ts = _from_us(ts_us)
        entry[1], entry[2], entry[3] = ts_us - self.window_us, ts_us + self.window_us, ts_us

    def fold_untimed(self, host: str | None, pci: str, xid: int, uuid: str | None) -> bool:
        """Fold an untimed Xid line into its incident if it is of the same GPU; False when
        `add` has to decide."""
        incident = self.untimed.get((host, pci, xid))
        if incident is None or not (uuid is None or incident.gpu_uuid is None or uuid == incident.gpu_uuid):
            return False
        incident.repeat_count += 1
        if incident.gpu_uuid is None:
            incident.gpu_uuid = uuid
        return True

    def add(self, rec: XidRecord) -> None:
        key = (rec.host or self.node, rec.pci_bus_id, rec.xid)
        if rec.ts is None:
            if self.fold_untimed(*key, rec.gpu_uuid):
                return
            incident = self.untimed.get(key)
            if incident is not None:
                self.done.append(incident)
            self.untimed[key] = _new_incident(rec, key[0])
            return
        ts_us = _to_us(rec.ts)
        entry = self.open.get(key)
        if entry is not None and _same_gpu(entry[0], rec) and entry[1] <= ts_us <= entry[2]:
            incident = entry[0]
            incident.repeat_count += 1
            if incident.gpu_uuid is None:
                incident.gpu_uuid = rec.gpu_uuid  # a UUID learnt mid-incident
            if ts_us > entry[4]:
                entry[4] = ts_us
            elif ts_us < entry[3]:
                self.move_start(entry, ts_us)
            return
        if entry is not None:
            self.done.append(_close(self.open.pop(key)))
        self.open[key] = [_new_incident(rec, key[0]), ts_us - self.window_us, ts_us + self.window_us, ts_us, ts_us]
        if self.watermark is None or ts_us > self.watermark:
            self.watermark = ts_us
        self.countdown -= 1
        if self.countdown <= 0:
            self.countdown = _SWEEP_EVERY
            self.done.extend(_sweep(self.open, self.watermark - self.window_us))

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


def _same_gpu(incident: XidIncident, rec: XidRecord) -> bool:
    return incident.gpu_uuid is None or rec.gpu_uuid is None or incident.gpu_uuid == rec.gpu_uuid


def _sweep(open_: dict[_Key, _Open], before: int) -> Iterator[XidIncident]:
    expired = [key for key, entry in open_.items() if entry[3] < before]
    for key in expired:
        yield _close(open_.pop(key))
