"""Which days of the `features` dataset are complete: the build's manifest, the state of the
store's journal `features` (`ingest.journal`).

A day's features are written as many files (a file per shard, flush and day). A build holds the
journal from its plan to its end (`holding_manifest`; a second build of the data root is
refused). The files a block writes stay hidden (`Staging`) until the block is complete; then
one commit lists the block's days in the manifest with their files and the data end their
labels were computed at, makes those files visible and removes the files they replace. So,
whatever point a build is killed at, readers (training, scoring, evaluation) see each day as
some build completed it, never part of a day, and the next build:

- deletes the hidden files no commit named (the journal does, on entry);
- rebuilds a day the manifest does not list;
- removes visible files of a listed day that the entry does not name (left by builds before
  the journal), and rebuilds a listed day missing one of its files;
- rebuilds a listed day whose labels were not yet settled when it was built (its grid times
  lie within `settle` of the data end then) once the data reaches further, so that an
  incremental build gives the rows a full build would.

Names are relative to the dataset folder, so a moved or copied data root keeps its manifest.
A store written before the manifest existed (feature files, no manifest) is taken as it is:
each day with files counts as complete.

The manifest also records the `FeatureSpec` the days were built with (`spec`), so that a model
can refuse features built with another spec (`recorded_spec`), and a build with another spec
cannot leave the dataset holding days of two specs (`FeatureManifest.use_spec`). A manifest
written before specs were recorded holds none: its days are taken as built with the spec of
the next build, and readers cannot check them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar

from features.spec import FeatureSpec, spec_mismatch
from ingest.errors import StoreError
from ingest.journal import READER_GRACE_S, Journal, Staging
from ingest.store import Store

MANIFEST = "features"
"""The manifest's journal and state name: `_state/features.json`."""
AGGREGATES_MANIFEST = "buckets"
"""The stored aggregates' manifest (`features.aggregates`): `_state/buckets.json`."""
DATASET = "features"
VERSION = 1
_DAY = timedelta(days=1)
_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(frozen=True)
class DayRecord:
    files: tuple[str, ...]
    """File names relative to the dataset folder (`date=2026-01-05/part-....parquet`)."""
    data_end: datetime | None
    """The data end the day's labels were computed at (None: adopted from an older store)."""


@dataclass
class BuildPlan:
    """What a build over some whole days does with what is there."""

    runs: list[tuple[datetime, datetime]] = field(default_factory=list)
    """[start, end) of the consecutive days to build."""
    kept: list[date] = field(default_factory=list)
    """Complete, up-to-date days left as they are."""
    replaced: dict[date, list[str]] = field(default_factory=dict)
    """Files of complete days being rebuilt: removed once their block is complete."""
    partial: list[str] = field(default_factory=list)
    """Files of days no build completed, and of listed days that the entry does not name."""


class FeatureManifest:
    """The complete days of a store's `features` dataset (see the module notes), over the
    journal that commits them."""

    def __init__(self, journal: Journal, days: dict[date, DayRecord], spec: FeatureSpec | None = None) -> None:
        self.journal = journal
        self.store = journal.store
        self.days = days
        self.spec = spec
        """The spec the listed days were built with (None: not recorded, see the module notes)."""
        # A journal of one dataset names its files relative to the dataset's folder (what the
        # features manifest always did); of several, relative to the data root.
        datasets = journal.datasets
        self._base = (self.store.path(datasets[0]) if len(datasets) == 1 else self.store.path()) + "/"

    @classmethod
    def load(cls, journal: Journal) -> FeatureManifest:
        store = journal.store
        where = store.path("_state", f"{journal.name}.json")
        state = journal.state
        if state is None:
            # Written before the manifest existed: every day with files is taken as complete.
            manifest = cls(journal, {})
            manifest.days = {d: DayRecord(tuple(names), None) for d, names in manifest.present().items()}
            manifest._save()
            return manifest
        try:
            if state.get("version") != VERSION:
                raise ValueError(f"version {state.get('version')!r}, expected {VERSION}")
            days = {
                date.fromisoformat(day): DayRecord(
                    tuple(str(name) for name in entry["files"]),
                    None if entry.get("data_end") is None else datetime.fromisoformat(entry["data_end"]),
                )
                for day, entry in state["days"].items()
            }
            spec = None if state.get("spec") is None else FeatureSpec.from_json(state["spec"], "spec")
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise StoreError(
                f"{where}: not a gpufail feature manifest ({type(exc).__name__}: {exc}); remove it to take the "
                "feature files as they are, or rebuild with gpufail features --overwrite"
            ) from None
        return cls(journal, days, spec)

    def staging(self) -> Staging:
        """Where the files of the next `complete` are written (hidden until then)."""
        return self.journal.staging()

    def use_spec(self, spec: FeatureSpec, start: datetime, end: datetime, *, overwrite: bool) -> None:
        """Build the whole days in [start, end) with `spec`. The same spec as recorded, none
        recorded, or no day listed: it is recorded with the first day completed. Another spec:
        allowed only when the build rebuilds every listed day (`overwrite` over a range that holds them all), and
        then the listed days are forgotten first (their files are then removed as leftovers),
        so that the dataset never holds days of two specs; else a `FeatureSpecMismatch`."""
        if self.spec is None or self.spec == spec or not self.days:
            self.spec = spec
            return
        outside = sorted(d for d in self.days if not start.date() <= d < end.date())
        if not overwrite or outside:
            reach = f"; {len(outside)} built days lie outside {start.date()}..{(end - _DAY).date()}" if outside else ""
            raise spec_mismatch(
                built=self.spec,
                wanted=spec,
                features=f"{self.store.root}: the features",
                user="this build asks for",
                remedy=f"rebuild every day with the new settings (gpufail features --overwrite, without --start "
                f"and --end){reach}, or build into another data root",
            )
        self.days, self.spec = {}, spec
        self._save()

    def present(self, first: date | None = None, last: date | None = None) -> dict[date, list[str]]:
        """The visible feature files of each day in [first, last], by relative name."""
        found: dict[date, list[str]] = {}
        for dataset in self.journal.datasets:
            for path in self.store.files(dataset, first, last):
                name = self.relative(path)
                found.setdefault(_day_of(name), []).append(name)
        return found

    def relative(self, path: str) -> str:
        return path.removeprefix(self._base)

    def plan(
        self, start: datetime, end: datetime, *, data_end: datetime, settle: timedelta, overwrite: bool
    ) -> BuildPlan:
        """What to build of the whole days in [start, end), and what to remove, given the files
        present and the data end now. `settle`: how long after a grid time its label can still
        change (horizon, then the merge window or the loss delay)."""
        plan = BuildPlan()
        present = self.present(start.date(), (end - _DAY).date())
        build: list[datetime] = []
        day = start
        while day < end:
            files = present.get(day.date(), [])
            record = self.days.get(day.date())
            if record is None:
                plan.partial += files
                build.append(day)
            elif overwrite or not set(record.files) <= set(files) or self._stale(day, record, data_end, settle):
                plan.replaced[day.date()] = [f for f in files if f in record.files]
                plan.partial += [f for f in files if f not in record.files]
                build.append(day)
            else:
                plan.kept.append(day.date())
                plan.partial += [f for f in files if f not in record.files]
            day += _DAY
        for day in build:
            if plan.runs and plan.runs[-1][1] == day:
                plan.runs[-1] = (plan.runs[-1][0], day + _DAY)
            else:
                plan.runs.append((day, day + _DAY))
        return plan

    @staticmethod
    def _stale(day: datetime, record: DayRecord, data_end: datetime, settle: timedelta) -> bool:
        if record.data_end is None or record.data_end == data_end:
            return False
        return day + _DAY + settle > record.data_end

    def kept_files(self, days: Iterable[date]) -> int:
        return sum(len(self.days[d].files) for d in days)

    def remove(self, names: Sequence[str]) -> None:
        """Remove feature files (relative names) in one commit."""
        if names:
            self.journal.commit(replaces=[self._base + name for name in names])

    def complete(
        self, days: Iterable[date], written: Iterable[str], data_end: datetime, *, replaced: Sequence[str] = ()
    ) -> None:
        """Record `days` as complete with the files `written` for them (staged by `staging()`),
        removing the files `replaced` (relative names), in one commit."""
        by_day: dict[date, list[str]] = {d: [] for d in days}
        written = list(written)
        staging = self.staging()
        for path in written:
            name = self.relative(staging.visible(path))
            day = _day_of(name)
            if day in by_day:
                by_day[day].append(name)
        for day, names in by_day.items():
            self.days[day] = DayRecord(tuple(sorted(names)), data_end)
        self.journal.commit(self._state(), staged=written, replaces=[self._base + name for name in replaced])

    def record_spec(self, spec: FeatureSpec) -> None:
        """Record `spec` as the one the listed days were built with, keeping them: for a caller
        that knows the files are what `spec` builds (`features.aggregates`)."""
        self.spec = spec
        self._save()

    def _save(self) -> None:
        self.journal.commit(self._state())

    def _state(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "spec": None if self.spec is None else self.spec.to_json(),
            "spec_fingerprint": None if self.spec is None else self.spec.fingerprint,
            "days": {
                day.isoformat(): {
                    "files": list(record.files),
                    "data_end": None if record.data_end is None else record.data_end.astimezone(UTC).isoformat(),
                }
                for day, record in sorted(self.days.items())
            },
        }


def _day_of(name: str) -> date:
    """The day of a file named relative to the manifest's base (its `date=` folder)."""
    folder = next(part for part in name.split("/") if part.startswith("date="))
    return date.fromisoformat(folder.removeprefix("date="))


@contextmanager
def open_manifest(
    store: Store, name: str = MANIFEST, datasets: Sequence[str] = (DATASET,)
) -> Iterator[FeatureManifest]:
    """The manifest `name` of the store's `datasets` (default: the features'), holding its
    journal (the lock: a second build of the data root is refused) until the block ends. The
    files are not synced to disk before their commit: a power cut that loses one leaves a file
    its checksum refuses, and a day is rebuilt in minutes. The files a rebuild replaces
    (`--overwrite`, a day rebuilt as data arrives) linger for readers that listed them (a `train`
    or `score` reading meanwhile sees the old files or the new ones, never a vanished file)."""
    with store.journal(
        name, list(datasets), durable=False, holder="`gpufail features`", linger_s=READER_GRACE_S
    ) as journal:
        yield FeatureManifest.load(journal)


def holding_manifest(
    build: Callable[Concatenate[Store, FeatureManifest, _P], _R],
) -> Callable[Concatenate[Store, _P], _R]:
    """`build(store, manifest, ...)` called as `build(store, ...)`, holding the manifest
    (`open_manifest`) from before its plan to its last commit."""

    @functools.wraps(build)
    def holding(store: Store, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with open_manifest(store) as manifest:
            return build(store, manifest, *args, **kwargs)

    return holding


def settle_time(spec: FeatureSpec) -> timedelta:
    """How long after a grid time its label can still change as data arrives: the horizon, then
    the merge window of a failure episode and the silence that makes a GPU lost."""
    return spec.horizon + spec.merge_window + (spec.lost_after or timedelta(0))


def recorded_spec(store: Store, name: str | None = None) -> FeatureSpec | None:
    """The spec the store's features are computed with: the stored aggregates' when the store
    has them (`features.aggregates`; its readers compute from them), else the features table's
    (or the spec of manifest `name`), from the manifest (None: no manifest, or one written
    before specs were recorded). Reads only; `FeatureManifest.load` may write."""
    if name is None:
        name = AGGREGATES_MANIFEST if store.read_state(AGGREGATES_MANIFEST) is not None else MANIFEST
    state = store.read_state(name)
    if not isinstance(state, dict) or state.get("spec") is None:
        return None
    return FeatureSpec.from_json(state["spec"], f"{store.path('_state', f'{name}.json')}: spec")
