"""`gpufail ingest prometheus`: the dcgm-exporter history a Prometheus server (or Thanos, Mimir,
VictoriaMetrics) holds -> the `telemetry` and `xid_events` datasets.

The range is imported in windows of at most one UTC day (fewer hours when the fleet is large:
`WINDOW_SAMPLES`), oldest first. For each window: the series the selector matches are listed,
their samples asked for metric by metric (a query's series and time span sized so that no
series has more than `POINTS_PER_SERIES` samples in it, nor the answer more than
`QUERY_SAMPLES`), `concurrency` queries at a time; the samples become rows
(`ingest.prometheus_rows`), the XID changes become events, and both are committed with the
window recorded as imported, in one step of the data root's journal (`ingest.journal`).

Exactly once: the state `_state/prometheus_import.json` records, per cluster and selector, the
time ranges imported. A rerun imports only what they do not cover (a rerun of the same range
asks the server nothing), and a run killed at any point, or stopped by a server that went
away, has committed whole windows and nothing else: the rerun does the rest. The server's URL
is not part of the record, so a range imported from one replica is not imported again from
the other.

XIDs: an XID event from Prometheus (source `prometheus`, no message) that a kernel log of the
data root already holds (same node, bus id and code within the XID dedup window) is not
written, so one failure is not counted twice. Import kernel logs first when both are at hand:
the kernel log has the message and the exact time.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ingest.errors import InputError, StoreError
from ingest.prometheus_labels import GpuKey, LabelMap
from ingest.store import Store

if TYPE_CHECKING:
    from ingest.prometheus_api import PrometheusClient, Series

# The modules that read answers and map readings (numpy, the scrape parser) are imported where
# there is something to import: a rerun of an imported range loads none of them.

STATE_NAME = "prometheus_import"
STATE_VERSION = 1
DAY_MS = 86_400_000
WINDOW_SAMPLES = 6_000_000
"""Samples a window holds at most (its memory: ~60 bytes a sample while it is mapped)."""
QUERY_SAMPLES = 1_000_000
"""Samples one answer holds at most (~25 MB of JSON)."""
UNKNOWN_STEP_MS = 1_000
"""The scrape interval assumed until the first answer shows it: the shortest a DCGM exporter
is scraped at, so that no query asks for more than the points-per-series limit."""
SETTLE = timedelta(minutes=2)
"""The newest samples may still be on their way (a scrape in flight, remote write): a range
ending later than this before now is imported up to then."""
XID_LOOKBACK = "30d"
"""How far back the value of each GPU's XID series before the range is looked up, so that a
value already held before the range is not taken for a new XID."""

_SELECTOR = re.compile(r"^\s*(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)?\s*(?:\{(?P<body>.*)\})?\s*$", re.S)


@dataclass
class ImportSummary:
    """What one `import_prometheus` call did."""

    start: str
    end: str
    windows: int = 0
    series: int = 0
    rows: int = 0
    xid_events: int = 0
    xid_merged: int = 0
    """XID events a kernel log of the root already held (not written again)."""
    already_imported: bool = False
    nothing_in_range: bool = False
    ignored_series: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    blank_values: int = 0
    out_of_range: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    unlabelled: dict[str, int] = field(default_factory=dict)
    queries: int = 0
    retries: int = 0
    warnings: int = 0
    first_warning: str | None = None

    def line(self) -> str:
        if self.already_imported:
            return f"{self.start} to {self.end} was imported before; nothing written"
        if self.nothing_in_range:
            return (
                f"no samples between {self.start} and {self.end} (the selector's series lie outside it: "
                "before the data, or past the server's retention); nothing written"
            )
        text = (
            f"{self.rows:,} rows ({self.samples:,} samples of {self.series:,} series) from {self.start} to "
            f"{self.end} in {self.windows} windows; {self.xid_events:,} XID events"
        )
        if self.xid_merged:
            text += f" ({self.xid_merged:,} more already in a kernel log)"
        extras = []
        if self.blank_values:
            extras.append(f"{self.blank_values:,} readings NaN or blank left missing")
        if self.out_of_range:
            per = ", ".join(f"{k} {v:,}" for k, v in sorted(self.out_of_range.items()))
            extras.append(
                f"{sum(self.out_of_range.values()):,} readings outside their valid range left missing ({per})"
            )
        if self.duplicates:
            extras.append(f"{self.duplicates:,} duplicate readings (replicas) dropped")
        if self.unlabelled:
            per = ", ".join(f"{k}: {v:,}" for k, v in sorted(self.unlabelled.items()))
            extras.append(f"{sum(self.unlabelled.values()):,} series left out ({per})")
        if self.ignored_series:
            extras.append(f"{sum(self.ignored_series.values()):,} series of metrics gpufail does not store")
        if self.warnings:
            extras.append(f"{self.warnings:,} answers with warnings (partial data; first: {self.first_warning})")
        if self.retries:
            extras.append(f"{self.retries:,} queries retried")
        return "; ".join([text, *extras])


@dataclass(frozen=True)
class ImportOptions:
    start: datetime
    end: datetime
    match: str = ""
    """A series selector narrowing the import (`{cluster="a"}`, `DCGM_FI_DEV_GPU_TEMP{...}`)."""
    labels: LabelMap = field(default_factory=lambda: LabelMap.of(None, "default"))
    dedup_window: timedelta = timedelta(minutes=5)
    concurrency: int = 4
    step: timedelta | None = None
    """The scrape interval; None: detected from the samples."""


def import_prometheus(
    store: Store, client: PrometheusClient, options: ImportOptions, *, now: datetime | None = None
) -> ImportSummary:
    """Import the DCGM series of [start, end) into `store` (module notes)."""
    name, body = parse_selector(options.match)
    start_ms = _ms(options.start)
    end_ms = min(_ms(options.end), _ms((now or datetime.now(UTC)) - SETTLE))
    if end_ms <= start_ms:
        raise InputError(
            f"--start {options.start.isoformat()} --end {options.end.isoformat()}: expected a range that starts "
            f"before it ends and before {SETTLE} ago"
        )
    summary = ImportSummary(start=_iso(start_ms), end=_iso(end_ms))
    key = f"{options.labels.cluster} {options.match.strip()}"
    with store.journal(STATE_NAME, ["telemetry", "xid_events"]) as journal:
        state = _load_state(store, journal.state)
        done = [tuple(r) for r in state["imported"].get(key, [])]
        todo = _uncovered((start_ms, end_ms), done)
        if not todo:
            summary.already_imported = True
            return summary
        discovery = _selector(name, body, '__name__=~"DCGM_FI_.+"')
        listed = client.series(discovery, todo[0][0], todo[-1][1] - 1)
        if not listed:
            if not client.series(discovery, 0, _ms(now or datetime.now(UTC))):
                raise InputError(
                    f"--match {options.match or '(none)'}: no DCGM series on {client.shown} match {discovery}; "
                    "expected a selector of dcgm-exporter series (check its labels with the server's /graph)"
                )
            summary.nothing_in_range = True
            return summary
        run = _Run(client, options, name, body, summary, listed)
        for first, last in todo:
            run.xid_last = run.xid_baseline(first)
            for window in run.windows(first, last):
                telemetry, events = run.window(*window)
                merged = merge_with_kernel_log(store, events, options.dedup_window)
                summary.xid_merged += events.num_rows - merged.num_rows
                done = _add(done, window)
                state["imported"][key] = [list(r) for r in done]
                tables = {"telemetry": telemetry, "xid_events": merged}
                journal.commit(state, {k: t for k, t in tables.items() if t.num_rows})
                summary.windows += 1
                summary.rows += telemetry.num_rows
                summary.xid_events += merged.num_rows
        run.finish()
    return summary


class _Run:
    """The queries of one import: windows, their series and samples."""

    def __init__(
        self,
        client: PrometheusClient,
        options: ImportOptions,
        name: str | None,
        body: str,
        summary: ImportSummary,
        listed: list[dict[str, str]],
    ) -> None:
        from ingest.dcgm_scrape import metric_by_name
        from ingest.prometheus_rows import XID_METRICS, SeriesCounts

        self.client = client
        self.options = options
        self.name = name
        self.body = body
        self.summary = summary
        self.counts = SeriesCounts()
        self.step_ms = _ms_of(options.step) if options.step else None
        self.ignored: dict[str, int] = {}
        self.xid_last: dict[GpuKey, float] = {}
        self.listed = listed
        """The series with samples in the run's range (a window's queries name the metrics and
        nodes of these; a series without samples in a window answers nothing)."""
        mapped = set(metric_by_name()) | XID_METRICS
        self.xid_metrics = XID_METRICS
        self.mapped = mapped if name is None else mapped & {name}
        self.by_name: dict[str, list[dict[str, str]]] = {}
        for labels in listed:
            metric = labels.get("__name__", "")
            if metric in self.mapped:
                self.by_name.setdefault(metric, []).append(labels)
            else:
                self.ignored[metric] = self.ignored.get(metric, 0) + 1

    def windows(self, first: int, last: int) -> Iterator[tuple[int, int]]:
        """[first, last) in windows of at most a UTC day and `WINDOW_SAMPLES` samples (the
        span follows the scrape interval once the first answer shows it)."""
        day_start = first
        while day_start < last:
            day_end = min(last, (day_start // DAY_MS + 1) * DAY_MS)
            if self.step_ms is None and self.listed:
                self._probe_step(self.listed[0], day_start, day_end)
            count = max(1, len(self.listed))
            cut = day_start
            while cut < day_end:
                step = self.step_ms or UNKNOWN_STEP_MS
                end = min(day_end, cut + max(step, WINDOW_SAMPLES // count * step))
                yield cut, end
                cut = end
            day_start = day_end

    def window(self, first: int, last: int) -> tuple[pa.Table, pa.Table]:
        from ingest.prometheus_rows import map_series, xid_changes

        tasks = list(self._queries(self.by_name, first, last))
        with ThreadPoolExecutor(max_workers=max(1, self.options.concurrency)) as pool:
            answers = list(pool.map(lambda t: self.client.samples(t[0], t[1], t[2]), tasks))
        series = [s for answer in answers for s in answer]
        self._learn_step(series)
        mapped = map_series(series, self.options.labels, self.counts)
        events = xid_changes(mapped.xids, self.xid_last, self.counts)
        return mapped.telemetry, events

    def _queries(
        self, by_name: dict[str, list[dict[str, str]]], first: int, last: int
    ) -> Iterator[tuple[str, int, int]]:
        """(selector, start, end) of each query of a window: per metric, series in batches of
        nodes, time in spans of at most `POINTS_PER_SERIES` samples a series."""
        from ingest.prometheus_api import POINTS_PER_SERIES

        step = self.step_ms or UNKNOWN_STEP_MS
        span = max(step, int(POINTS_PER_SERIES * 0.9) * step)
        node_label = self.options.labels.labels["node"]
        for metric, listed in sorted(by_name.items()):
            per_series = min(last - first, span) // step + 1
            batch = max(1, QUERY_SAMPLES // per_series)
            nodes = sorted({labels.get(node_label, "") for labels in listed})
            batches: list[list[str]] = [[]]
            counted = 0
            per_node = Counter(labels.get(node_label, "") for labels in listed)
            for node in nodes:
                if batches[-1] and counted + per_node[node] > batch:
                    batches.append([])
                    counted = 0
                batches[-1].append(node)
                counted += per_node[node]
            for group in batches:
                extra = f'__name__="{metric}"'
                if len(batches) > 1:
                    extra += f',{node_label}=~"{_alternatives(group)}"'
                selector = _selector(None, self.body, extra)
                cut = first
                while cut < last:
                    yield selector, cut, min(last, cut + span)
                    cut = min(last, cut + span)

    def _probe_step(self, labels: dict[str, str], first: int, last: int) -> None:
        """The scrape interval from one series' samples, before the first window is planned."""
        exact = "{" + ",".join(f"{k}={_quote(v)}" for k, v in sorted(labels.items())) + "}"
        from ingest.prometheus_api import POINTS_PER_SERIES

        span = min(last, first + POINTS_PER_SERIES * UNKNOWN_STEP_MS * 9 // 10)
        self._learn_step(self.client.samples(exact, first, span))

    def _learn_step(self, series: list[Series]) -> None:
        """The scrape interval: the shortest median spacing of the series' samples."""
        if self.step_ms is not None:
            return
        spacings = [int(_median_spacing(s)) for s in series if len(s.times_ms) >= 3]
        if spacings:
            self.step_ms = max(UNKNOWN_STEP_MS, min(spacings))

    def xid_baseline(self, first: int) -> dict[GpuKey, float]:
        """Each GPU's XID value just before `first` (module notes of `ingest.prometheus_rows`)."""
        names = sorted(self.xid_metrics & self.mapped)
        if not names:
            return {}
        xid_series = _selector(None, self.body, f'__name__=~"{"|".join(names)}"')
        query = f"last_over_time({xid_series}[{XID_LOOKBACK}])"
        found: dict[GpuKey, float] = {}
        for labels, value in self.client.newest(query, first - 1):
            who = self.options.labels.identity(labels)
            if not isinstance(who, str) and value == value:  # not NaN
                found.setdefault(who[0], value)
        return found

    def finish(self) -> None:
        summary, counts = self.summary, self.counts
        summary.series = sum(len(v) for v in self.by_name.values())
        summary.ignored_series = dict(sorted(self.ignored.items()))
        summary.samples = counts.samples
        summary.blank_values = counts.blank_values
        summary.out_of_range = dict(counts.out_of_range)
        summary.duplicates = counts.duplicates
        summary.unlabelled = dict(counts.unlabelled)
        answers = self.client.answers
        summary.queries = answers.queries
        summary.retries = answers.retries
        summary.warnings = answers.warnings.total()
        summary.first_warning = next(iter(answers.warnings), None)


def merge_with_kernel_log(store: Store, events: pa.Table, window: timedelta) -> pa.Table:
    """`events` without those a kernel-log XID of the root already holds: same node, bus id and
    code within `window`."""
    import pyarrow.compute as pc

    from ingest.prometheus_rows import SOURCE

    if events.num_rows == 0 or not store.exists("xid_events"):
        return events
    ts = events["ts"]
    start, end = pc.min(ts).as_py() - window, pc.max(ts).as_py() + window + timedelta(microseconds=1)
    held = store.read(
        "xid_events",
        start=start,
        end=end,
        columns=["ts", "node", "pci_bus_id", "xid"],
        filter=pc.field("source") != SOURCE,
    )
    if held.num_rows == 0:
        return events
    logged: dict[tuple[str, str, int], list[datetime]] = {}
    for row in held.to_pylist():
        logged.setdefault((row["node"], row["pci_bus_id"], row["xid"]), []).append(row["ts"])
    keep = []
    for row in events.select(["ts", "node", "pci_bus_id", "xid"]).to_pylist():
        times = logged.get((row["node"], row["pci_bus_id"], row["xid"]), [])
        keep.append(not any(abs(row["ts"] - t) <= window for t in times))
    return events.filter(pa.array(keep))


def parse_selector(match: str) -> tuple[str | None, str]:
    """`NAME{matchers}` -> (NAME or None, matchers)."""
    found = _SELECTOR.match(match or "")
    if found is None:
        raise InputError(
            f'--match {match!r}: expected a series selector such as {{Hostname=~"gpu-0.*"}} or '
            'DCGM_FI_DEV_GPU_TEMP{cluster="a"}'
        )
    return found["name"], (found["body"] or "").strip().rstrip(",")


def _selector(name: str | None, body: str, extra: str) -> str:
    parts = [f"__name__={_quote(name)}" if name else "", extra, body]
    return "{" + ",".join(p for p in parts if p) + "}"


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _alternatives(values: list[str]) -> str:
    """A PromQL regex string body matching exactly `values`."""
    escaped = [re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", v) for v in values]
    return _quote("|".join(escaped))[1:-1]


def _median_spacing(series: Series) -> float:
    import numpy as np

    return float(np.median(np.diff(series.times_ms)))


def _uncovered(wanted: tuple[int, int], done: list[tuple[int, ...]]) -> list[tuple[int, int]]:
    out = []
    cursor, end = wanted
    for a, b in sorted(done):
        if b <= cursor or a >= end:
            continue
        if a > cursor:
            out.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < end:
        out.append((cursor, end))
    return out


def _add(done: list[tuple[int, ...]], window: tuple[int, int]) -> list[tuple[int, ...]]:
    merged: list[list[int]] = []
    for a, b in sorted([*done, window]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [tuple(r) for r in merged]


def _load_state(store: Store, state: dict[str, Any] | None) -> dict[str, Any]:
    if state is None:
        return {"version": STATE_VERSION, "imported": {}}
    if state.get("version") != STATE_VERSION or not isinstance(state.get("imported"), dict):
        raise StoreError(
            f"{store.path('_state', STATE_NAME + '.json')}: Prometheus import state of version "
            f"{state.get('version')!r} is not understood; expected version {STATE_VERSION} with an 'imported' object"
        )
    return state


def _ms(moment: datetime) -> int:
    if moment.tzinfo is None:
        raise ValueError(f"{moment!r} is naive; expected a timezone-aware datetime")
    return int(moment.timestamp() * 1000)


def _ms_of(duration: timedelta) -> int:
    return max(1, int(duration.total_seconds() * 1000))


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat().replace("+00:00", "Z")
