"""Historical `nvidia-smi` output into `telemetry` rows.

Two shapes of output are read, told apart by their first characters:

- `nvidia-smi --query-gpu=timestamp,uuid,index,temperature.gpu,... --format=csv[,nounits]`,
  possibly looped (`-l 60`) and possibly several runs appended to one file. The header line is
  required: it is the only place that says which column is which.
- `nvidia-smi -q -x`, one or many `<nvidia_smi_log>` documents one after the other.

Which nvidia-smi field or XML element feeds which of our columns is data
(`nvidia_smi_fields.csv`): one row per source field, with the unit nvidia-smi prints it in
(used when `nounits` dropped it) and a `group`. For each column, the lowest group with a
reading wins and the readings of that group are summed: so a newer field name is preferred to
an older one, and newer drivers' split ECC counts (DRAM + SRAM) add up to our totals.

A cell nvidia-smi could not fill (`[N/A]`, `[Not Supported]`, `N/A`, `[GPU is lost]`, ...)
is a missing reading. A row that cannot be used (wrong number of cells, binary junk, a time
that does not parse, goes backwards for its GPU or is implausible) is skipped and counted
with its reason; so are fields with no column of ours, so that the output of a driver newer
than this file is still imported for what is known.

Pure functions of text here; `import_nvidia_smi` reads the files and writes the store.
"""

from __future__ import annotations

import csv
import logging
import re
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo
from functools import cache
from importlib import resources
from pathlib import Path

import pyarrow as pa

from ingest.errors import InputError
from ingest.kernel_log_parser import resolve_tz
from ingest.metric_ranges import describe_range, in_range
from ingest.schema import Metric, metric_catalogue, normalise_pci_bus_id, telemetry_schema
from ingest.store import Store
from ingest.time_bounds import EARLIEST_PLAUSIBLE, FUTURE_SLACK, IMPLAUSIBLE

log = logging.getLogger(__name__)

# Times outside these bounds are a clock that was wrong (an unset RTC says 1970 or 2000).

# How many examples of each skip reason a summary keeps, for the log.
EXAMPLES_KEPT = 5


# -- the field mapping ----------------------------------------------------------------------


@dataclass(frozen=True)
class FieldMapping:
    """One row of `nvidia_smi_fields.csv`."""

    format: str  # "query" or "xml"
    field: str  # query field name, or XML path below <gpu>
    metric: Metric
    unit: str  # nvidia-smi's unit for the field; "" for counts, flags and bitmasks
    group: int


@cache
def field_mappings() -> tuple[FieldMapping, ...]:
    """The packaged mapping from nvidia-smi fields to telemetry columns."""
    text = resources.files("ingest").joinpath("nvidia_smi_fields.csv").read_text()
    metrics = {m.column: m for m in metric_catalogue()}
    rows = []
    for line_no, row in enumerate(csv.DictReader(text.splitlines()), start=2):
        where = f"nvidia_smi_fields.csv line {line_no}"
        if row["format"] not in ("query", "xml"):
            raise ValueError(f"{where}: format {row['format']!r}; expected 'query' or 'xml'")
        if row["column"] not in metrics:
            raise ValueError(f"{where}: column {row['column']!r} is not in metrics.csv")
        unit = row["unit"]
        if unit and (unit, metrics[row["column"]].unit) not in UNIT_SCALE:
            raise ValueError(f"{where}: no conversion from {unit!r} to {metrics[row['column']].unit!r}")
        rows.append(FieldMapping(row["format"], row["field"], metrics[row["column"]], unit, int(row["group"])))
    return tuple(rows)


def _mappings(fmt: str) -> dict[str, FieldMapping]:
    return {m.field: m for m in field_mappings() if m.format == fmt}


# (nvidia-smi's unit, our column's unit) -> factor. nvidia-smi prints each field in one unit, but
# a header or a value may name another (`[KiB]`), and some of ours differ from its own.
UNIT_SCALE: dict[tuple[str, str], float] = {
    ("C", "degC"): 1.0,
    ("%", "percent"): 1.0,
    ("W", "W"): 1.0,
    ("mW", "W"): 1e-3,
    ("kW", "W"): 1e3,
    ("MHz", "MHz"): 1.0,
    ("kHz", "MHz"): 1e-3,
    ("GHz", "MHz"): 1e3,
    ("MiB", "MiB"): 1.0,
    ("KiB", "MiB"): 1 / 1024,
    ("GiB", "MiB"): 1024.0,
    ("B", "MiB"): 1 / 2**20,
    ("us", "us"): 1.0,
    ("ns", "us"): 1e-3,
    ("ms", "us"): 1e3,
    ("s", "us"): 1e6,
}

_FLAG_WORDS = {"yes": 1, "no": 0, "active": 1, "not active": 0, "enabled": 1, "disabled": 0, "true": 1, "false": 0}
_VALUE_WITH_UNIT = re.compile(r"^(?P<number>[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*(?P<unit>[A-Za-z%/]+)?$")


# -- what a run saw -------------------------------------------------------------------------


@dataclass
class NvidiaSmiSummary:
    """Counts of one import: what was read, what became rows, what was skipped and why."""

    files: int = 0
    samples: int = 0
    blank_values: int = 0  # cells nvidia-smi could not fill, now missing readings
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> rows or files skipped
    unmapped_fields: Counter[str] = field(default_factory=Counter)  # field -> values not imported
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> "file:line" places

    def skip(self, reason: str, where: str, count: int = 1) -> None:
        self.skipped[reason] += count
        places = self.examples.setdefault(reason, [])
        if len(places) < EXAMPLES_KEPT:
            places.append(where)

    def line(self) -> str:
        text = f"{self.samples:,} GPU samples from {self.files} file(s), {self.blank_values:,} unavailable readings"
        if self.skipped:
            text += "; skipped " + ", ".join(f"{n:,} {reason}" for reason, n in self.skipped.most_common())
        if self.unmapped_fields:
            names = ", ".join(name for name, _ in self.unmapped_fields.most_common(3))
            text += f"; {len(self.unmapped_fields)} field(s) without a column of ours ignored (e.g. {names})"
        return text

    def log(self) -> None:
        for reason, n in self.skipped.most_common():
            log.warning("nvidia-smi import skipped %d: %s (e.g. %s)", n, reason, "; ".join(self.examples[reason]))
        if self.unmapped_fields:
            log.info("nvidia-smi fields without a telemetry column: %s", ", ".join(sorted(self.unmapped_fields)))


@dataclass(frozen=True)
class _Context:
    source: str
    cluster: str
    node: str
    time: datetime | None  # used when the output carries no time of its own
    tz: tzinfo  # of nvidia-smi's local-time stamps
    now: datetime  # bound for implausible future times


# -- parsing ----------------------------------------------------------------------------------


def parse_nvidia_smi(
    text: str,
    *,
    source: str,
    cluster: str,
    node: str,
    time: datetime | None = None,
    tz: str | tzinfo | None = None,
    now: datetime | None = None,
    summary: NvidiaSmiSummary | None = None,
) -> pa.Table:
    """`telemetry` rows from the text of one nvidia-smi output file (query CSV or `-q -x` XML).

    `time` stamps output that carries no time (no `timestamp` field, no XML `<timestamp>`);
    `tz` is the zone of nvidia-smi's stamps, which are the host's local time (UTC by default).
    Rows and fields that cannot be used are counted in `summary`; a file that cannot be used at
    all (no header, no GPU identity, no time anywhere) raises `InputError` naming `source`.
    """
    if time is not None and time.tzinfo is None:
        raise ValueError(f"time={time!r} is naive; expected a timezone-aware datetime")
    ctx = _Context(source, cluster, node, time, resolve_tz(tz), now or datetime.now(UTC))
    summary = summary if summary is not None else NvidiaSmiSummary()
    head = text.lstrip("\ufeff \t\r\n")[:200]
    is_xml = head.startswith("<")  # a CSV header starts with a field name
    numbered = _xml_rows(text, ctx, summary) if is_xml else _csv_rows(text, ctx, summary)
    rows = list(_in_time_order(numbered, ctx, summary))
    summary.samples += len(rows)
    schema = telemetry_schema()
    return pa.Table.from_pydict({f.name: [row.get(f.name) for row in rows] for f in schema}, schema=schema)


def _in_time_order(
    rows: Iterable[tuple[int, dict[str, object]]], ctx: _Context, summary: NvidiaSmiSummary
) -> Iterator[dict[str, object]]:
    """Drop rows whose time is implausible or does not move forward for their GPU: a clock
    that jumped back would otherwise give one GPU two different readings for one moment."""
    latest: dict[str, datetime] = {}
    future = ctx.now + FUTURE_SLACK
    for line_no, row in rows:
        ts = row["ts"]
        assert isinstance(ts, datetime)
        where = f"{ctx.source}:{line_no}"
        if not EARLIEST_PLAUSIBLE <= ts <= future:
            summary.skip(IMPLAUSIBLE, where)
            continue
        uuid = str(row["gpu_uuid"])
        previous = latest.get(uuid)
        if previous is not None and ts <= previous:
            summary.skip("rows whose time does not move forward for their GPU (clock jump or repeat)", where)
            continue
        latest[uuid] = ts
        yield row


# ---- query CSV

_HEADER_FIELD = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_.]*)(?: \[(?P<unit>[^\]]*)\])?$")
_QUERY_TIME_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S")


@dataclass(frozen=True)
class _Column:
    name: str
    unit: str | None  # from the header; None when `nounits` left it out
    mapping: FieldMapping | None


def _header(cells: list[str]) -> list[_Column] | None:
    """The columns named by a header line, or None when the line is not a header."""
    columns = []
    mappings = _mappings("query")
    for cell in cells:
        m = _HEADER_FIELD.match(cell.strip())
        if m is None:
            return None
        columns.append(_Column(m["name"], m["unit"], mappings.get(m["name"])))
    return columns


def _csv_rows(text: str, ctx: _Context, summary: NvidiaSmiSummary) -> Iterator[tuple[int, dict[str, object]]]:
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        raise InputError(f"nvidia-smi file {ctx.source}: empty; expected --query-gpu CSV or -q -x XML")
    columns: list[_Column] | None = _header(_split(lines[first]))
    if columns is None:
        raise InputError(
            f"nvidia-smi file {ctx.source}, line {first + 1}: not a header line ({lines[first][:80]!r}); expected "
            "the output of `nvidia-smi --query-gpu=timestamp,uuid,... --format=csv` with its header "
            "(not `noheader`): the header says which column is which"
        )
    _check_identity(columns, ctx, first + 1)
    for name in {c.name for c in columns if c.mapping is None and c.name not in _IDENTITY_FIELDS}:
        summary.unmapped_fields[name] += 0  # listed even when every file has it only in the header
    order: dict[str, int] = {}
    for line_no in range(first + 2, len(lines) + 1):
        line = lines[line_no - 1]
        if not line.strip():
            continue
        where = f"{ctx.source}:{line_no}"
        if "\x00" in line or "\ufffd" in line:
            summary.skip("lines that are not text (NUL or undecodable bytes)", where)
            continue
        cells = _split(line)
        header = _header(cells)
        if header is not None and any(c.name == "uuid" for c in header):
            # Another run appended to the same file: its own header, possibly other fields. One
            # that cannot be used costs its own run's lines, not the runs before it.
            try:
                _check_identity(header, ctx, line_no)
                usable: list[_Column] | None = header
            except InputError as exc:
                summary.skip("runs whose header cannot be used", str(exc))
                usable = None
            columns = usable
            continue
        if columns is None:
            summary.skip("lines under a header that cannot be used", where)
            continue
        if len(cells) != len(columns):
            summary.skip("lines with the wrong number of cells (truncated or garbled)", where)
            continue
        row = _query_row(dict(zip((c.name for c in columns), cells, strict=True)), columns, ctx, summary, where)
        if row is not None and row["gpu_index"] is None:
            # Without an index field, GPUs are numbered in the order the file first lists them,
            # which is nvidia-smi's own order.
            row["gpu_index"] = order.setdefault(str(row["gpu_uuid"]), len(order))
        if row is not None:
            yield line_no, row


_IDENTITY_FIELDS = frozenset({"timestamp", "uuid", "index", "pci.bus_id", "name", "driver_version"})


def _check_identity(columns: list[_Column], ctx: _Context, line_no: int) -> None:
    names = {c.name for c in columns}
    if "uuid" not in names:
        raise InputError(
            f"nvidia-smi file {ctx.source}, line {line_no}: no uuid column; expected --query-gpu to include uuid "
            "(it identifies the GPU)"
        )
    if "timestamp" not in names and ctx.time is None:
        raise InputError(
            f"nvidia-smi file {ctx.source}, line {line_no}: no timestamp column and no --time given; expected "
            "--query-gpu to include timestamp, or the time of the capture as --time"
        )
    if not any(c.mapping is not None for c in columns):
        raise InputError(
            f"nvidia-smi file {ctx.source}, line {line_no}: none of its fields is one gpufail knows "
            "(see ingest/nvidia_smi_fields.csv); expected fields such as temperature.gpu or power.draw"
        )


def _split(line: str) -> list[str]:
    return next(csv.reader([line], skipinitialspace=True), [])


def _query_row(
    cells: dict[str, str], columns: list[_Column], ctx: _Context, summary: NvidiaSmiSummary, where: str
) -> dict[str, object] | None:
    if "timestamp" in cells:
        ts = _parse_local(cells["timestamp"], _QUERY_TIME_FORMATS, ctx.tz)
        if ts is None:
            summary.skip("rows whose timestamp does not parse (expected YYYY/MM/DD HH:MM:SS.mmm)", where)
            return None
    else:
        assert ctx.time is not None
        ts = ctx.time.astimezone(UTC)
    uuid = cells["uuid"].strip()
    if not uuid.startswith(("GPU-", "MIG-")):
        summary.skip("rows without a GPU UUID", where)
        return None
    index = _index(cells.get("index"))
    row = _identity_row(ts, ctx, index, uuid, cells.get("pci.bus_id"), cells.get("name"), cells.get("driver_version"))
    readings: list[tuple[FieldMapping, str, str | None]] = []
    seen: set[str] = set()
    for column in columns:
        # nvidia-smi prints a field asked for twice, or under two of its names (clocks.sm and
        # clocks.current.sm), as two columns of one name: one reading, not two to add up.
        if column.name in seen:
            continue
        seen.add(column.name)
        if column.mapping is None:
            if column.name not in _IDENTITY_FIELDS:
                summary.unmapped_fields[column.name] += 1
            continue
        readings.append((column.mapping, cells[column.name], column.unit))
    _fill_metrics(row, readings, summary, where)
    return row


def _index(raw: str | None) -> int | None:
    if raw is None:
        return None
    text = raw.strip()
    return int(text) if text.isdigit() and int(text) < 2**15 else None


# ---- -q -x XML

# A document ends at its closing tag or, when it was cut short, where the next one starts.
_DOCUMENT = re.compile(r"<nvidia_smi_log\b.*?(?:</nvidia_smi_log>|(?=<\?xml|<nvidia_smi_log\b)|\Z)", re.DOTALL)
_XML_TIME_FORMATS = ("%a %b %d %H:%M:%S %Y",)


def _xml_rows(text: str, ctx: _Context, summary: NvidiaSmiSummary) -> Iterator[tuple[int, dict[str, object]]]:
    documents = list(_DOCUMENT.finditer(text))
    if not documents:
        raise InputError(
            f"nvidia-smi file {ctx.source}: XML without <nvidia_smi_log>; expected `nvidia-smi -q -x` output"
        )
    mappings = _mappings("xml")
    for match in documents:
        line_no = text.count("\n", 0, match.start()) + 1
        where = f"{ctx.source}:{line_no}"
        try:
            root = ET.fromstring(match.group())
        except ET.ParseError as exc:
            summary.skip("XML documents that do not parse (truncated or garbled)", f"{where} ({exc})")
            continue
        stamp = root.findtext("timestamp")
        if stamp is not None:
            ts = _parse_local(stamp, _XML_TIME_FORMATS, ctx.tz)
            if ts is None:
                summary.skip("XML documents whose <timestamp> does not parse", where)
                continue
        elif ctx.time is not None:
            ts = ctx.time.astimezone(UTC)
        else:
            raise InputError(
                f"nvidia-smi file {ctx.source}, line {line_no}: XML without <timestamp> and no --time given; "
                "expected the time of the capture as --time"
            )
        driver = root.findtext("driver_version")
        for position, gpu in enumerate(root.iter("gpu")):
            uuid = (gpu.findtext("uuid") or "").strip()
            if not uuid.startswith(("GPU-", "MIG-")):
                summary.skip("XML <gpu> elements without a GPU UUID", where)
                continue
            # -q -x lists GPUs in index order and has no index element of its own.
            row = _identity_row(ts, ctx, position, uuid, gpu.get("id"), gpu.findtext("product_name"), driver)
            readings: list[tuple[FieldMapping, str, str | None]] = []
            for path, value in _leaves(gpu):
                mapping = mappings.get(path)
                if mapping is not None:
                    readings.append((mapping, value, None))
                elif path not in _XML_IDENTITY:
                    summary.unmapped_fields[path] += 1
            _fill_metrics(row, readings, summary, where)
            yield line_no, row


_XML_IDENTITY = frozenset({"uuid", "product_name"})


def _leaves(element: ET.Element, prefix: str = "") -> Iterator[tuple[str, str]]:
    for child in element:
        path = f"{prefix}{child.tag}"
        if len(child):
            yield from _leaves(child, f"{path}/")
        else:
            yield path, (child.text or "").strip()


# ---- shared


def _parse_local(text: str, formats: tuple[str, ...], tz: tzinfo) -> datetime | None:
    for fmt in formats:
        try:
            return datetime.strptime(text.strip(), fmt).replace(tzinfo=tz).astimezone(UTC)
        except ValueError:
            continue
    return None


def _identity_row(
    ts: datetime,
    ctx: _Context,
    index: int | None,
    uuid: str,
    bus: str | None,
    model: str | None,
    driver: str | None,
) -> dict[str, object]:
    try:
        pci = normalise_pci_bus_id(bus) if bus and bus.strip() else None
    except ValueError:
        pci = None  # the bus id only helps to join XIDs; the readings are still good
    return {
        "ts": ts,
        "cluster": ctx.cluster,
        "node": ctx.node,
        "gpu_index": index,
        "gpu_uuid": uuid,
        "pci_bus_id": pci,
        "gpu_model": _text(model),
        "driver": _text(driver),
    }


def _text(raw: str | None) -> str | None:
    text = (raw or "").strip()
    return None if _unavailable(text) else text


def _unavailable(text: str) -> bool:
    # nvidia-smi brackets what it could not read (`[N/A]`, `[Not Supported]`, `[GPU is lost]`,
    # `[Unknown Error]`); -q -x and older CSV print `N/A` or `Not Supported` bare.
    return not text or (text.startswith("[") and text.endswith("]")) or text.lower() in ("n/a", "not supported", "err!")


def _fill_metrics(
    row: dict[str, object], readings: list[tuple[FieldMapping, str, str | None]], summary: NvidiaSmiSummary, where: str
) -> None:
    """Put each column's winning reading (lowest group with a value, summed) into `row`."""
    best: dict[str, tuple[int, float, Metric]] = {}
    for mapping, raw, header_unit in readings:
        value = _reading(raw, mapping, header_unit, summary, where)
        if value is None:
            continue
        metric = mapping.metric
        current = best.get(metric.column)
        if current is None or mapping.group < current[0]:
            best[metric.column] = (mapping.group, value, metric)
        elif mapping.group == current[0]:
            best[metric.column] = (current[0], current[1] + value, metric)
    for column, (_, value, metric) in best.items():
        if not in_range(value, metric):
            # `1e308` or `1e400` (read as infinity): stored, it would be infinity in float32.
            summary.skip(f"readings of {column} outside its valid range {describe_range(metric)} or not finite", where)
            continue
        row[column] = round(value) if pa.types.is_integer(metric.arrow_type) else value


def _reading(
    raw: str, mapping: FieldMapping, header_unit: str | None, summary: NvidiaSmiSummary, where: str
) -> float | None:
    text = raw.strip()
    if _unavailable(text):
        summary.blank_values += 1
        return None
    metric = mapping.metric
    if metric.kind == "flag":
        flag = _FLAG_WORDS.get(text.lower())
        if flag is None:
            summary.skip(f"values of {mapping.field} that are not yes/no", where)
        return flag
    if metric.kind == "bitmask":
        try:
            return float(int(text, 0))
        except ValueError:
            summary.skip(f"values of {mapping.field} that are not a bitmask", where)
            return None
    m = _VALUE_WITH_UNIT.match(text)
    if m is None:
        summary.skip(f"values of {mapping.field} that are not numbers", where)
        return None
    unit = m["unit"] or header_unit or mapping.unit
    if not unit:
        return float(m["number"])
    scale = UNIT_SCALE.get((unit, metric.unit))
    if scale is None:
        summary.skip(f"values of {mapping.field} in {unit!r}, which does not convert to {metric.unit}", where)
        return None
    return float(m["number"]) * scale


# -- files -> store ---------------------------------------------------------------------------

_NAME_SUFFIXES = (".gz", ".csv", ".xml", ".txt", ".log", ".out", ".nvsmi", ".nvidia-smi")


def node_from_filename(name: str) -> str:
    """`gpu-node-007.csv`, `gpu-node-007.nvidia-smi.xml` -> `gpu-node-007`."""
    stem = name
    while stem.lower().endswith(_NAME_SUFFIXES):
        stem = stem[: stem.rfind(".")]
    return stem or name


def import_nvidia_smi(
    store: Store,
    paths: list[Path],
    *,
    cluster: str,
    node: str | None = None,
    time: datetime | None = None,
    tz: str | tzinfo | None = None,
    progress: bool = False,
) -> NvidiaSmiSummary:
    """Parse each nvidia-smi file and append its rows to `telemetry`, one file at a time
    (`progress`: a bar over the files).

    A file that cannot be used at all is skipped and counted (its reason logged); the others are
    still imported. If no file gave a row, `InputError` says why the first one failed.
    """
    summary = NvidiaSmiSummary()
    first_error: InputError | None = None
    from tqdm.auto import tqdm

    for path in tqdm(paths, desc="nvidia-smi", unit="file", disable=not progress):
        try:
            text = _read(path)
            table = parse_nvidia_smi(
                text,
                source=str(path),
                cluster=cluster,
                node=node or node_from_filename(path.name),
                time=time,
                tz=tz,
                summary=summary,
            )
        except InputError as exc:
            first_error = first_error or exc
            summary.skip("files that could not be used", f"{exc}")
            continue
        summary.files += 1
        if table.num_rows:
            store.write("telemetry", table)
    if summary.samples == 0 and first_error is not None:
        raise first_error  # one error, not a log of it as well
    summary.log()
    return summary


def _read(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"nvidia-smi file {path}: cannot read ({exc.strerror}); expected a readable file") from None
    if data[:2] == b"\x1f\x8b":
        import gzip

        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise InputError(f"nvidia-smi file {path}: broken gzip ({exc})") from None
    # Undecodable bytes become U+FFFD, which the row checks count and skip line by line.
    return data.decode("utf-8", errors="replace")
