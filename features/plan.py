"""The plan of a feature build over a store, one for both runners: the local block/shard runner
(`features.runner`) and the Dask runner (`features.distributed`) differ only in how they read
and compute; what they build, from which facts, and how they finish is decided here.

- **Fleet facts** (`fleet_facts`): from GPU presence over the whole store (each runner finds it
  its own way), the data end, the XID events resolved to GPUs, the repair records and the
  failure episodes. Labels and lost-GPU detection look past the emitted range as far as the data
  goes, so these are fleet-wide and whole-history.
- **Emit range** (`emit_range`): [start, end) widened to whole UTC days, within the data.
- **Lookback** (`lookback`): how far before a grid time its features read buckets.
- **The exists/overwrite check** (`plan_build`): complete, up-to-date days stay
  (`features.manifest`); a build with nothing to do is a `FeaturesExistError`.
- **Finish** (`finish_days`): the days built are recorded with their files, and the files they
  replace removed, in one commit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any, Self

import polars as pl

from features.build import failure_episodes
from features.inputs import read_failure_events, read_repairs, read_xid_events, utc
from features.labels import (
    EVENT_SOURCES,
    GPU,
    fleet_data_end,
    positives_by_source,
    resolve_xid_gpus,
    with_returns,
    within_data,
)
from features.manifest import BuildPlan, FeatureManifest, settle_time
from features.spec import FeatureSpec
from ingest.errors import StoreError
from ingest.store import Store

ONE_DAY = timedelta(days=1)


SOURCE_WORDS = {
    "xid": "failure XIDs",
    "lost": "lost GPUs",
    "repair": "repair records",
    "record": "failure records",
    "slurm": "the scheduler (Slurm)",
    "kubernetes": "the scheduler (Kubernetes)",
}
"""How the features summary names each label source (`features.labels` episode sources)."""


class FeaturesExistError(StoreError, FileExistsError):
    """The features dataset already has files for the dates a build would write: every day
    asked for (`start` .. `last`, whole UTC days) is built and up to date (`files` files)."""

    def __init__(self, message: str, *, files: int = 0, start: date | None = None, last: date | None = None) -> None:
        super().__init__(message)
        self.files, self.start, self.last = files, start, last


@dataclass
class FeatureBuildSummary:
    rows: int = 0
    gpus: int = 0
    positives: int = 0
    censored: int = 0
    telemetry_rows_read: int = 0
    blocks: int = 0  # time blocks of days, each built shard by shard
    shards: int = 0  # shards of whole nodes the fleet was built in
    files_written: list[str] = field(default_factory=list)
    files_replaced: int = 0
    days_kept: int = 0  # complete and up to date already: not rebuilt
    leftovers_removed: int = 0  # files of days an interrupted build left partial
    start: datetime | None = None
    end: datetime | None = None
    data_end: datetime | None = None
    seconds: float = 0.0
    positives_by_source: dict[str, int] = field(default_factory=dict)
    """Positive rows per episode source (`labels.positives_by_source`)."""
    warnings: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        rate = self.telemetry_rows_read / self.seconds if self.seconds else 0.0
        return (
            self._headline(rate)
            + "".join(f"\n  {line}" for line in self.source_lines())
            + "".join(f"\nwarning: {w}" for w in self.warnings)
        )

    def source_lines(self) -> list[str]:
        """One line per label source that gave positive rows (none when no row is positive)."""
        if not self.positives:
            return []
        return [
            f"{self.positives_by_source[s]:,} positive from {SOURCE_WORDS[s]}"
            for s in SOURCE_WORDS
            if self.positives_by_source.get(s)
        ]

    def _headline(self, rate: float) -> str:
        return (
            f"features: {self.rows:,} rows for {self.gpus:,} GPUs ({self.positives:,} positive, {self.censored:,} censored) "
            f"from {self.telemetry_rows_read:,} telemetry rows in {self.seconds:.1f} s ({rate:,.0f} rows/s); "
            f"{len(self.files_written)} files written, {self.files_replaced} replaced"
            + (f"; {self.days_kept} days already built kept" if self.days_kept else "")
            + (f"; {self.leftovers_removed} files of an interrupted build removed" if self.leftovers_removed else "")
        )

    def timed(self, began: float, gpus: set[str] | None = None) -> Self:
        """This summary with the seconds since `began` (`time.perf_counter`) and the GPUs built."""
        if gpus is not None:
            self.gpus = len(gpus)
        self.seconds = time.perf_counter() - began
        return self


@dataclass
class Written:
    """What one piece of a build (a shard of a block, a Dask partition) wrote."""

    rows: int = 0
    positives: int = 0
    censored: int = 0
    gpus: set[str] = field(default_factory=set)
    files: list[str] = field(default_factory=list)
    by_source: dict[str, int] = field(default_factory=dict)

    def add(self, frame: pl.DataFrame, episodes: pl.DataFrame) -> None:
        self.rows += frame.height
        self.positives += int((frame["label"] == 1).sum())
        self.censored += frame["label"].null_count()
        self.gpus.update(frame[GPU].unique().to_list())
        for source, n in positives_by_source(frame, episodes).items():
            self.by_source[source] = self.by_source.get(source, 0) + n

    def add_to(self, summary: FeatureBuildSummary, gpus: set[str]) -> None:
        summary.rows += self.rows
        summary.positives += self.positives
        summary.censored += self.censored
        for source, n in self.by_source.items():
            summary.positives_by_source[source] = summary.positives_by_source.get(source, 0) + n
        gpus.update(self.gpus)


def silent_sources(facts: FleetFacts, summary: FeatureBuildSummary) -> list[str]:
    """A warning for each failure-event source the store holds that gave no positive row:
    its events name GPUs or nodes without telemetry, fall outside the built range, or are all
    the same failures as XIDs (then the XIDs' rows are the positives)."""
    warnings = []
    for source in EVENT_SOURCES:
        n = facts.events_by_source.get(source, 0)
        if n and not summary.positives_by_source.get(source):
            kept = int((facts.episodes["source"] == source).sum())
            why = (
                f"{kept} failure episodes from them, but no built row lies within the horizon before one"
                if kept
                else "none became a failure episode: each names a node or GPU with no telemetry at its time, "
                "or is the same failure as a failure XID or repair of its GPU (whose rows are the positives)"
            )
            warnings.append(f"failure_events: {n} events from source {source!r} gave no positive label; {why}")
    return warnings


def lookback(spec: FeatureSpec) -> timedelta:
    """Buckets a row at t needs: the longest window, and the GPU's last bucket while it is silent."""
    return max(max(spec.windows), spec.max_silence + spec.grid)


def day_start(moment: datetime) -> datetime:
    """Midnight UTC of the day `moment` is in (a naive moment is taken as UTC)."""
    m = utc(moment)
    return datetime(m.year, m.month, m.day, tzinfo=UTC)


def days_in(start: datetime, end: datetime) -> list[datetime]:
    """The midnights of the whole UTC days in [start, end)."""
    return [start + i * ONE_DAY for i in range((end - start) // ONE_DAY)]


@dataclass(frozen=True)
class FleetFacts:
    """What every piece of a build needs about the whole fleet and its whole history."""

    presence: pl.DataFrame
    """`labels.gpu_presence` over all telemetry."""
    xid: pl.DataFrame
    """The XID events, resolved to GPUs."""
    repairs: pl.DataFrame | None
    """Repair records, and the returns to service of failure events that know when the node
    was back (`labels.with_returns`)."""
    episodes: pl.DataFrame
    """Failure episodes (`labels.episodes_for`)."""
    data_end: datetime
    """The last telemetry sample in the store."""
    first_data: datetime
    """The first telemetry sample in the store."""
    events_by_source: dict[str, int] = field(default_factory=dict)
    """Failure events in the store per source (`failure_events`), before deduplication."""

    def build_inputs(self) -> dict[str, Any]:
        """The facts as `features.build.iter_features_from_buckets` takes them, for a piece of
        the fleet or of the history."""
        return {
            "data_end": self.data_end,
            "repairs": self.repairs,
            "presence": self.presence,
            "episodes": self.episodes,
        }


def fleet_facts(store: Store, spec: FeatureSpec, presence: pl.DataFrame) -> FleetFacts:
    """The fleet facts of the store, given its GPU presence (not empty)."""
    data_end = utc(fleet_data_end(presence))
    # XIDs dated past the fleet's data end (a node's clock ahead, a garbled stamp within the
    # importer's bounds) would label the hours before a failure that has not happened.
    xid = resolve_xid_gpus(within_data(read_xid_events(store), data_end), presence)
    repairs = read_repairs(store)
    events = read_failure_events(store)
    episodes = failure_episodes(xid, presence, spec, data_end=data_end, repairs=repairs, failure_events=events)
    first_data = utc(presence["first_ts"].min())  # type: ignore[arg-type]
    by_source = {} if events is None else {str(s): int(n) for s, n in events.group_by("source").len().iter_rows()}
    return FleetFacts(presence, xid, with_returns(repairs, episodes), episodes, data_end, first_data, by_source)


def emit_range(facts: FleetFacts, start: datetime | None, end: datetime | None) -> tuple[datetime, datetime] | None:
    """[start, end) (default: all the data) in whole UTC days, within the data; None when empty."""
    emit_start = day_start(max(utc(start), facts.first_data) if start is not None else facts.first_data)
    last = min(utc(end) - timedelta(microseconds=1), facts.data_end) if end is not None else facts.data_end
    emit_end = day_start(last) + ONE_DAY
    return (emit_start, emit_end) if emit_start < emit_end else None


@dataclass(frozen=True)
class StoreBuild:
    """A build a runner carries out: the fleet facts and which days to build."""

    facts: FleetFacts
    plan: BuildPlan


def plan_store_build(
    store: Store,
    manifest: FeatureManifest,
    spec: FeatureSpec,
    presence: pl.DataFrame,
    summary: FeatureBuildSummary,
    *,
    start: datetime | None,
    end: datetime | None,
    overwrite: bool,
) -> StoreBuild | None:
    """What a build of [start, end) with `spec` does, given the store's GPU presence (the data
    end and the emitted range are noted in `summary`); None when there is nothing in the range
    (no telemetry, or none there). A `FeaturesExistError` when every day is built already."""
    if presence.height == 0:
        return None
    facts = fleet_facts(store, spec, presence)
    summary.data_end = facts.data_end
    emitted = emit_range(facts, start, end)
    if emitted is None:
        return None
    summary.start, summary.end = emitted
    plan = plan_build(manifest, spec, summary, *emitted, data_end=facts.data_end, overwrite=overwrite)
    return StoreBuild(facts, plan)


def plan_build(
    manifest: FeatureManifest,
    spec: FeatureSpec,
    summary: FeatureBuildSummary,
    start: datetime,
    end: datetime,
    *,
    data_end: datetime,
    overwrite: bool,
    settle: timedelta | None = None,
) -> BuildPlan:
    """The plan of a build of the whole days in [start, end) with `spec` (`FeatureManifest.use_spec`
    and `plan`), after removing the files no build completed (counted in `summary`); a
    `FeaturesExistError` when every day is built and up to date. `settle`: how long after a
    grid time what is built for it can still change (default: the labels', `settle_time`)."""
    manifest.use_spec(spec, start, end, overwrite=overwrite)
    settle = settle_time(spec) if settle is None else settle
    plan = manifest.plan(start, end, data_end=data_end, settle=settle, overwrite=overwrite)
    manifest.remove(plan.partial)
    summary.leftovers_removed, summary.days_kept = len(plan.partial), len(plan.kept)
    if not plan.runs:
        raise FeaturesExistError(
            nothing_to_build(manifest, plan, start, end),
            files=manifest.kept_files(plan.kept),
            start=start.date(),
            last=(end - ONE_DAY).date(),
        )
    return plan


def nothing_to_build(manifest: FeatureManifest, plan: BuildPlan, start: datetime, end: datetime) -> str:
    """Every day asked for is built and up to date: say so, with the range the files cover."""
    files = manifest.kept_files(plan.kept)
    removed = f"; removed {len(plan.partial)} files an interrupted build left" if plan.partial else ""
    return (
        f"features: {files} files already cover {start.date()}..{(end - timedelta(days=1)).date()}, every day "
        f"asked for, built from the data as it is now{removed}; pass overwrite=True (gpufail features "
        "--overwrite) to rebuild them"
    )


def finish_days(
    manifest: FeatureManifest,
    plan: BuildPlan,
    days: list[date],
    written: list[str],
    data_end: datetime,
    summary: FeatureBuildSummary,
) -> None:
    """Every piece wrote its files for `days` (staged, `FeatureManifest.staging`): the days are
    complete, and the files they replace go, in one commit; `summary` counts the files."""
    replaced = [name for day in days for name in plan.replaced.get(day, [])]
    # The names the files take at the commit, from the staging that wrote them (the next
    # commit's staging hides its files under another name).
    visible = [manifest.staging().visible(path) for path in written]
    manifest.complete(days, written, data_end, replaced=replaced)
    summary.files_written += visible
    summary.files_replaced += len(replaced)
