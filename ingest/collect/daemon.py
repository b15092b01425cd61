"""`gpufail collect`: run the live collectors on an interval and flush what they return.

The registry maps each source name to a factory, so the CLI and the config speak names
("nvml", "kernel-log", "dcgm-exporter", "prometheus") and the NVML collector, with its vendor library, is
imported only when asked for.

One tick calls every collector once. A collector that raises is recorded as a failed run
(collectors fail independently and say why) and the others go on; every call, good or bad, becomes a `collector_runs`
row with its duration. A collector with a backlog (the kernel log after a flood or downtime)
is read in pieces within the tick, the buffer flushed between them. Rows go to a
`WriteBuffer`, flushed on its size/time policy through the store's journal `collect-<node>`
(`ingest.journal`), which commits the cursors of resumable collectors together with the rows
they cover: a restart after a kill at any point neither loses nor repeats a row. A flush is
two commits: telemetry first (no source is read twice for telemetry, and this flush's XID
events are mapped to GPUs from it), then every other dataset with the collectors' states. The
journal is opened at the first flush and held until the daemon stops, so a second daemon for
the same node is refused; the committed states are read before it, at the start.

Nothing read is ever dropped. While the store cannot be written the rows stay buffered and
every tick retries the flush; once the buffer holds `HOLD_FACTOR` x `flush_rows` rows the
daemon stops reading its sources until a flush succeeds (a source not read loses nothing: the
kernel log waits behind its cursor, and a sample not taken is a gap, not a lost row). If the
store still refuses when the daemon stops, it says what it holds and exits non-zero.

Stopping: SIGTERM or SIGINT set a flag that the loop checks between collectors and while it
waits (in slices of at most `STOP_CHECK_S`); the daemon then drains open incidents, flushes
and returns, and the CLI exits 0. All time comes from a `Clock`. Metrics and the health
probes: `ingest.collect.observe`.
"""

from __future__ import annotations

import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import pyarrow as pa

from ingest.collect.base import (
    Clock,
    Collector,
    CollectorError,
    CollectorRun,
    Draining,
    Resumable,
    SystemClock,
)
from ingest.collect.buffer import FLUSH_ORDER, WriteBuffer
from ingest.collect.observe import DaemonMetrics, Health, ObservabilityServer, parse_listen
from ingest.errors import GpufailError, InputError, StoreError
from ingest.journal import Journal
from ingest.schema import schema_for
from ingest.store import Store, guarded
from ingest.xid_gpus import map_to_gpus

# The longest the daemon waits before noticing a stop request.
STOP_CHECK_S = 1.0
# While the store cannot be written, reading stops once the buffer holds this many times
# `flush_rows` (it may pass that by one collection).
HOLD_FACTOR = 10
# The version of the journal's state: {"version", "collectors": {collector name: its state}}.
STATE_VERSION = 1


@dataclass(frozen=True)
class CollectOptions:
    """Plain values for one daemon, from `[collect]` and the command line."""

    cluster: str
    node: str
    sources: tuple[str, ...]
    interval: timedelta
    flush_rows: int
    flush_interval: timedelta
    dcgm_exporter_url: str
    kernel_log_source: str  # "kmsg" | "journal" | "files"
    kernel_log_paths: tuple[str, ...]
    kmsg_path: str = "/dev/kmsg"
    journalctl: str = "journalctl"
    dedup_window: timedelta = timedelta(minutes=5)
    max_lines: int = 200_000
    tz: str | None = None
    dcgm_timeout_s: float = 5.0
    listen: str = ""
    """Address of /metrics, /healthz and /readyz, host:port; "" serves nothing."""
    prometheus: PrometheusSource | None = None


# -- the registry --------------------------------------------------------------------------

CollectorFactory = Callable[[Store, CollectOptions, Clock], Collector]


def _nvml(store: Store, options: CollectOptions, clock: Clock) -> Collector:
    # Imported here: the module loads the vendor library, which a node without NVIDIA
    # drivers (or a CI runner) does not have.
    from ingest.collect.nvml_collector import NvmlCollector

    return NvmlCollector(options.cluster, options.node, clock=clock)  # type: ignore[no-any-return]


def _kernel_log(store: Store, options: CollectOptions, clock: Clock) -> Collector:
    from ingest.collect.kernel_log_collector import KernelLogCollector

    return KernelLogCollector(
        store,
        make_log_source(options),
        cluster=options.cluster,
        node=options.node,
        dedup_window=options.dedup_window,
        clock=clock,
        tz=options.tz,
        max_lines=options.max_lines,
        # A read returns at most one row per line: pieces of `flush_rows` lines keep a backlog's
        # rows flushed as they come instead of piling up in the buffer.
        read_lines=min(options.max_lines, options.flush_rows),
    )


def _dcgm_exporter(store: Store, options: CollectOptions, clock: Clock) -> Collector:
    from ingest.collect.dcgm_exporter_collector import DcgmExporterCollector

    if not options.dcgm_exporter_url:
        raise InputError(
            "[collect] dcgm_exporter_url is empty; expected the exporter's URL, e.g. http://localhost:9400/metrics"
        )
    return DcgmExporterCollector(
        options.dcgm_exporter_url,
        cluster=options.cluster,
        node=options.node,
        clock=clock,
        timeout_s=options.dcgm_timeout_s,
    )


def _prometheus(store: Store, options: CollectOptions, clock: Clock) -> Collector:
    from ingest.collect.prometheus_collector import PrometheusCollector
    from ingest.prometheus_api import PrometheusClient
    from ingest.prometheus_labels import LabelMap

    if options.prometheus is None or not options.prometheus.url:
        raise InputError("[ingest.prometheus] url is empty; expected the server's URL, e.g. http://prometheus:9090")
    cfg = options.prometheus
    client = PrometheusClient(cfg.url, timeout_s=cfg.timeout_s, retries=cfg.retries, ca_file=cfg.ca_file)
    return PrometheusCollector(
        client,
        labels=LabelMap.of(dict(cfg.labels), options.cluster),
        interval=options.interval,
        match=cfg.match,
        clock=clock,
        store=store,
    )


@dataclass(frozen=True)
class PrometheusSource:
    """Where `--source prometheus` reads (`[ingest.prometheus]`)."""

    url: str
    match: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 60.0
    retries: int = 3
    ca_file: str | None = None


REGISTRY: dict[str, CollectorFactory] = {
    "nvml": _nvml,
    "kernel-log": _kernel_log,
    "dcgm-exporter": _dcgm_exporter,
    "prometheus": _prometheus,
}


def make_log_source(options: CollectOptions) -> Any:
    from ingest.collect.log_sources import FileSource, JournalSource, KmsgSource

    kind = options.kernel_log_source
    if kind == "kmsg":
        return KmsgSource(options.kmsg_path)
    if kind == "journal":
        return JournalSource(executable=options.journalctl)
    if kind == "files":
        if not options.kernel_log_paths:
            raise InputError(
                "[collect] kernel_log_source = 'files' but kernel_log_paths is empty; "
                "expected files such as ['/var/log/kern.log']"
            )
        return FileSource(options.kernel_log_paths)
    raise InputError(f"[collect] kernel_log_source = {kind!r}; expected 'kmsg', 'journal' or 'files'")


def parse_sources(text: str | Sequence[str]) -> tuple[str, ...]:
    """`"nvml,kernel-log"` or a list -> names, each checked against the registry."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown or not names:
        raise InputError(
            f"collector sources {', '.join(unknown) or '(none)'}: unknown; expected a comma-separated "
            f"list of {', '.join(REGISTRY)}"
        )
    return tuple(dict.fromkeys(names))


def build_collectors(
    store: Store, options: CollectOptions, clock: Clock, registry: Mapping[str, CollectorFactory] | None = None
) -> list[Collector]:
    """One collector per source name. A collector that cannot even be built (its library is
    not installed) is a configuration problem, reported before the daemon starts."""
    registry = REGISTRY if registry is None else registry
    collectors = []
    for name in options.sources:
        if name not in registry:
            raise InputError(f"collector {name!r}: unknown; expected one of {', '.join(registry)}")
        try:
            collectors.append(registry[name](store, options, clock))
        except ImportError as exc:
            raise InputError(f"collector {name!r}: cannot be loaded ({exc})") from None
    return collectors


# -- the loop ------------------------------------------------------------------------------


class StopFlag:
    """Set by a signal handler (or a test); read by the loop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None

    def set(self, reason: str = "stop requested") -> None:
        self.reason = reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Wait up to `seconds` for the flag; whether it is set."""
        return self._event.wait(seconds)


@contextmanager
def stop_on_signals(flag: StopFlag) -> Iterator[StopFlag]:
    """SIGTERM and SIGINT set `flag` instead of killing the process, for the block's duration."""

    def handler(signum: int, frame: Any) -> None:
        flag.set(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@dataclass
class _Tally:
    ok: int = 0
    failed: int = 0
    rows: int = 0
    last_error: str | None = None


@dataclass
class CollectSummary:
    """What a daemon run did, for the one-line reports."""

    ticks: int = 0
    flushes: int = 0
    files: int = 0
    rows_written: Counter[str] = field(default_factory=Counter)
    by_collector: dict[str, _Tally] = field(default_factory=dict)
    flush_errors: int = 0
    stop_reason: str = ""

    def line(self) -> str:
        runs = "; ".join(
            f"{name} {t.ok} ok"
            + (f", {t.failed} failed (last: {t.last_error})" if t.failed else "")
            + f", {t.rows} rows"
            for name, t in self.by_collector.items()
        )
        written = ", ".join(f"{d} {n:,}" for d, n in sorted(self.rows_written.items())) or "nothing"
        text = f"{self.ticks} ticks, {self.flushes} flushes ({written} rows in {self.files} files); {runs}"
        if self.flush_errors:
            text += f"; {self.flush_errors} failed flushes"
        return text

    def every_source_failed(self) -> list[tuple[str, str]]:
        """(source, its last error) for each source, when none ever succeeded and each failed
        at least once; empty otherwise."""
        tallies = self.by_collector.items()
        if not tallies or any(t.ok or not t.failed for _, t in tallies):
            return []
        return [(name, t.last_error or "unknown error") for name, t in tallies]


class Daemon:
    """Runs collectors on an interval and flushes their rows; see the module docstring."""

    def __init__(
        self,
        store: Store,
        collectors: Sequence[Collector],
        *,
        cluster: str,
        node: str,
        interval: timedelta,
        flush_rows: int,
        flush_interval: timedelta,
        clock: Clock | None = None,
        stop: StopFlag | None = None,
        report: Callable[[str], None] = lambda line: None,
        listen: str = "",
    ) -> None:
        if interval <= timedelta(0):
            raise InputError(f"collect interval {interval}: expected a positive duration")
        if flush_rows < 1:
            raise InputError(f"[collect] flush_rows = {flush_rows}: expected at least 1")
        parse_listen(listen)  # a bad address is refused before anything runs
        self.store = store
        self.collectors = list(collectors)
        self.cluster = cluster
        self.node = node
        self.interval = interval.total_seconds()
        self.flush_rows = flush_rows
        self.hold_rows = flush_rows * HOLD_FACTOR
        self.flush_interval = flush_interval.total_seconds()
        self.clock = clock or SystemClock()
        self.stop = stop or StopFlag()
        self.report = report
        self.listen = listen
        # Protocol checks are slow (they walk the class's attributes): made once, not per call.
        self.resumable: list[Resumable] = [c for c in self.collectors if isinstance(c, Resumable)]
        self.buffer = WriteBuffer()
        self.journal_name = f"collect-{node}"
        self._committed: dict[str, dict[str, Any]] = {}
        self._held = ExitStack()
        self._journal: Journal | None = None
        self.metrics = DaemonMetrics(self.collectors)
        self.health = Health(self.clock, self.interval, [c.name for c in self.collectors])
        self.summary = CollectSummary(by_collector={c.name: _Tally() for c in self.collectors})
        self.server: ObservabilityServer | None = None
        self._last_flush = self.clock.monotonic()
        self._last_flush_error: str | None = None
        self._paused = False

    def run(self, *, max_ticks: int | None = None) -> CollectSummary:
        """Resume from the last commit, then tick until stopped or `max_ticks` ticks have run
        (1 for `--once`); then drain, flush, close. Returns the summary."""
        self._committed = self._committed_states()
        for resumable in self.resumable:
            resumable.restore(self._committed.get(resumable.name))
        if self.listen:
            self.server = ObservabilityServer(self.listen, self.metrics, self.health)
            self.report(f"collect: serving /metrics, /healthz and /readyz on {self.server.url}")
        next_tick = self.clock.monotonic()
        try:
            while not self.stop.is_set():
                self.tick()
                if max_ticks is not None and self.summary.ticks >= max_ticks:
                    break
                if self._flush_due():
                    self.flush()
                next_tick += self.interval
                self._wait_until(next_tick)
                # A tick that overran the interval does not cause a burst of catch-up ticks.
                next_tick = max(next_tick, self.clock.monotonic() - self.interval)
        finally:
            try:
                self._stop()
            finally:
                self._held.close()
                self._journal = None
        return self.summary

    def tick(self) -> None:
        if self.buffer.rows >= self.hold_rows:
            if not self._paused:
                self._paused = True
                self.report(
                    f"collect: the store cannot be written; holding {self.buffer.describe()} "
                    f"({self.buffer.rows:,} rows, {HOLD_FACTOR} x flush_rows): reading paused until a flush succeeds"
                )
        else:
            for collector in self.collectors:
                if self.stop.is_set():
                    break
                self._run_one(collector)
        self.summary.ticks += 1
        self.metrics.rows_buffered.set(self.buffer.rows)
        self.health.ticked(self.buffer.rows)

    def _run_one(self, collector: Collector) -> None:
        started = self.clock.monotonic()
        ts = self.clock.now()
        tally = self.summary.by_collector.setdefault(collector.name, _Tally())
        rows = 0
        error = None
        while True:
            try:
                collected = collector.collect()
            except CollectorError as exc:
                error = str(exc)
                break
            except Exception as exc:  # a bug in one collector must not stop the others
                error = f"{collector.name}: unexpected {type(exc).__name__}: {exc}"
                break
            for dataset, table in collected.items():
                self.buffer.add(dataset, table)
                rows += table.num_rows
            if not (collector in self.resumable and cast(Resumable, collector).backlog) or self.stop.is_set():
                break
            # More is waiting: flush what this piece added first. If the store refuses, or the
            # buffer is full, the rest stays behind the cursor for a later tick.
            if self._flush_due() and not self.flush():
                break
            if self.buffer.rows >= self.hold_rows:
                break
        duration = max(0.0, self.clock.monotonic() - started)
        run = CollectorRun(ts, self.cluster, self.node, collector.name, error is None, duration, rows, error)
        self.buffer.add("collector_runs", _runs_table([run]))
        if error is None:
            tally.ok += 1
        else:
            tally.failed += 1
            tally.last_error = error
        tally.rows += rows
        self.metrics.collected(collector.name, error is None, duration, self.clock.now())
        self.health.collected(collector.name, error)

    def _flush_due(self) -> bool:
        return self.buffer.rows >= self.flush_rows or self.clock.monotonic() - self._last_flush >= self.flush_interval

    def flush(self) -> bool:
        """Write the buffer and commit the collectors' states with it. False (and reported)
        when the store refused: the rows stay buffered and the committed cursors stay where
        they were."""
        self._last_flush = self.clock.monotonic()
        states = {c.name: c.state() for c in self.resumable}
        try:
            result = self._commit(states)
        except (GpufailError, OSError) as exc:
            self._last_flush_error = str(exc)
            self.summary.flush_errors += 1
            self.metrics.flush_failures.inc()
            self.metrics.rows_buffered.set(self.buffer.rows)
            self.health.flushed(self.buffer.rows, self._last_flush_error)
            self.report(
                f"collect: flush failed, holding {self.buffer.describe()} ({self.buffer.rows:,} rows) "
                f"for the next flush; the cursors stay at the last commit: {exc}"
            )
            return False
        self._last_flush_error = None
        self.summary.flushes += 1
        self.summary.files += result.files
        self.summary.rows_written.update(result.rows)
        self.metrics.rows_buffered.set(self.buffer.rows)
        self.metrics.last_flush.set(self.clock.now().timestamp())
        self.health.flushed(self.buffer.rows, None)
        if self._paused:
            self._paused = False
            self.report("collect: the store takes writes again; reading resumed")
        written = ", ".join(f"{d} {n:,}" for d, n in result.rows.items()) or "nothing new"
        self.report(f"collect: flushed {written} ({result.files} files) | {self.summary.line()}")
        return True

    def _commit(self, states: dict[str, dict[str, Any]]) -> _Flushed:
        """Write everything the buffer holds and commit `states` with it (they must cover
        exactly those rows). A dataset leaves the buffer only once it is committed, so an
        error keeps the rest for the next flush; the states commit only with all of it."""
        journal = self._open_journal()
        flushed = _Flushed()
        if "telemetry" in self.buffer.datasets():
            table = self.buffer.table("telemetry")
            flushed.files += len(journal.commit(tables={"telemetry": table}))
            flushed.rows["telemetry"] = table.num_rows
            self.buffer.remove("telemetry")
        # Bus id -> GPU index and UUID, from the telemetry in the store, this flush's included.
        tables = {d: self._prepare(d, self.buffer.table(d)) for d in self.buffer.datasets()}
        committed = {**self._committed, **states}  # a source not run this time keeps its position
        flushed.files += len(journal.commit({"version": STATE_VERSION, "collectors": committed}, tables))
        for dataset, table in tables.items():
            flushed.rows[dataset] = table.num_rows
            self.buffer.remove(dataset)
        self._committed = committed
        return flushed

    def _prepare(self, dataset: str, table: pa.Table) -> pa.Table:
        return map_to_gpus(self.store, table, self.cluster) if dataset == "xid_events" else table

    def _committed_states(self) -> dict[str, dict[str, Any]]:
        """The collectors' states of the last commit, by collector name (read without the
        journal's lock: a committed state is whole whatever a writer does meanwhile)."""
        state = self.store.read_state(self.journal_name)
        if state is None:
            return {}
        if state.get("version") != STATE_VERSION or not isinstance(state.get("collectors"), dict):
            raise StoreError(
                f"{self.store.path('_state', self.journal_name + '.json')}: not a collector state of this gpufail "
                f"(version {state.get('version')!r}); expected version {STATE_VERSION} with 'collectors'"
            )
        return dict(state["collectors"])

    def _open_journal(self) -> Journal:
        """The journal, opened at the first flush that finds the store writable and held until
        the daemon stops."""
        if self._journal is None:
            journal = self._held.enter_context(self.store.journal(self.journal_name, FLUSH_ORDER))
            _finish_legacy_staging(self.store, self.journal_name, journal.state)
            if self._committed_states() != self._committed:
                self._held.close()
                raise StoreError(
                    f"{self.store.path('_state', self.journal_name + '.json')}: another collector of node "
                    f"{self.node} committed since this one started; run one collector per node"
                )
            self._journal = journal
        return self._journal

    def _wait_until(self, deadline: float) -> None:
        while not self.stop.is_set():
            remaining = deadline - self.clock.monotonic()
            if remaining <= 0:
                return
            self.clock.sleep(min(remaining, STOP_CHECK_S))

    def _stop(self) -> None:
        try:
            for collector in self.collectors:
                if isinstance(collector, Draining):
                    self._run_drain(collector)
            # Always flush, even with nothing buffered: collectors that read lines without
            # finding anything still commit how far they read.
            flushed = self.flush()
            for collector in self.collectors:
                try:
                    collector.close()
                except Exception as exc:  # closing must not hide the flush result
                    self.report(f"collect: closing {collector.name} failed: {exc}")
            self.summary.stop_reason = self.stop.reason or "done"
        finally:
            if self.server is not None:
                self.server.close()
        if not flushed:
            raise StoreError(
                f"collect: the last flush to {self.store.root} failed ({self._last_flush_error}); "
                f"{self.buffer.describe()} ({self.buffer.rows:,} rows) were not written; the committed "
                "cursors stay where they were, so the kernel-log lines among them are read again at the next start"
            )

    def _run_drain(self, collector: Draining) -> None:
        try:
            for dataset, table in collector.drain().items():
                self.buffer.add(dataset, table)
        except CollectorError as exc:
            self.report(f"collect: draining failed: {exc}")


@dataclass
class _Flushed:
    rows: dict[str, int] = field(default_factory=dict)
    files: int = 0


def _finish_legacy_staging(store: Store, name: str, state: dict[str, Any] | None) -> None:
    """gpufail before the store's journal staged a flush's files under `_staging/<name>/` and
    listed them in the state (`staged`) before moving them: move those a kill left there, then
    remove the folder (what no state lists was never committed)."""
    staging = store.path("_staging", name)
    fs = store.fs
    with guarded("finish the files staged by an earlier gpufail in", staging):
        if not fs.exists(staging):
            return
        for relative in (state or {}).get("staged", []):
            if fs.exists(f"{staging}/{relative}") and not fs.exists(store.path(relative)):
                fs.makedirs(store.path(relative).rsplit("/", 1)[0], exist_ok=True)
                fs.mv(f"{staging}/{relative}", store.path(relative))
        fs.rm(staging, recursive=True)


def _runs_table(runs: list[CollectorRun]) -> pa.Table:
    schema = schema_for("collector_runs")
    return pa.table(
        {
            "ts": [r.ts for r in runs],
            "cluster": [r.cluster for r in runs],
            "node": [r.node for r in runs],
            "collector": [r.collector for r in runs],
            "ok": [r.ok for r in runs],
            "duration_s": [r.duration_s for r in runs],
            "rows": [r.rows for r in runs],
            "error": [r.error for r in runs],
        },
        schema=schema,
    )


def run_collect(
    store: Store,
    options: CollectOptions,
    *,
    once: bool = False,
    max_runs: int | None = None,
    clock: Clock | None = None,
    stop: StopFlag | None = None,
    report: Callable[[str], None] = lambda line: None,
    registry: Mapping[str, CollectorFactory] | None = None,
) -> CollectSummary:
    """Build the collectors named in `options`, run them (once, `max_runs` ticks, or until
    stopped), flush and return the summary."""
    clock = clock or SystemClock()
    collectors = build_collectors(store, options, clock, registry)
    daemon = Daemon(
        store,
        collectors,
        cluster=options.cluster,
        node=options.node,
        interval=options.interval,
        flush_rows=options.flush_rows,
        flush_interval=options.flush_interval,
        clock=clock,
        stop=stop,
        report=report,
        listen=options.listen,
    )
    return daemon.run(max_ticks=1 if once else max_runs)
