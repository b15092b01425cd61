"""Which days of the `features` dataset are complete: the build's manifest.

A day's features are written as many files (a file per shard, flush and day), so a build
killed half-way leaves days with some of their files. A day counts as complete only once the
block that builds it has written all of them: then the manifest (`_state/features.json`,
replaced atomically) lists the day's files and the data end its labels were computed at. The
state is written after the data it describes, so whatever point a build is killed at:

- a day with files but no entry is a partial day: its files are removed and it is rebuilt;
- a listed day with files the entry does not name holds leftovers of an interrupted rebuild
  (`--overwrite`): they are removed, the listed files are the day;
- a listed day missing one of its files is rebuilt;
- a listed day whose labels were not yet settled when it was built (its grid times lie within
  `settle` of the data end then) is rebuilt once the data reaches further, so that an
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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from features.spec import FeatureSpec, spec_mismatch
from ingest.errors import StoreError
from ingest.store import Store

MANIFEST = "features"
"""The manifest's state name: `_state/features.json`."""
DATASET = "features"
VERSION = 1
_DAY = timedelta(days=1)


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
    """The complete days of a store's `features` dataset (see the module notes)."""

    def __init__(self, store: Store, days: dict[date, DayRecord], spec: FeatureSpec | None = None) -> None:
        self.store = store
        self.days = days
        self.spec = spec
        """The spec the listed days were built with (None: not recorded, see the module notes)."""
        self._base = store.path(DATASET) + "/"

    @classmethod
    def load(cls, store: Store) -> FeatureManifest:
        where = store.path("_state", f"{MANIFEST}.json")
        state = store.read_state(MANIFEST)
        if state is None:
            # Written before the manifest existed: every day with files is taken as complete.
            # Saved at once, even when empty, so that the files this build writes are never
            # taken for an old store's after a kill.
            manifest = cls(store, {})
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
        return cls(store, days, spec)

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
        for path in self.store.files(DATASET, first, last):
            name = self.relative(path)
            found.setdefault(date.fromisoformat(name.split("/", 1)[0].removeprefix("date=")), []).append(name)
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
        for name in names:
            path = self._base + name
            if self.store.fs.exists(path):
                self.store.fs.rm(path)

    def complete(self, days: Iterable[date], written: Iterable[str], data_end: datetime) -> None:
        """Record `days` as complete with the files `written` for them (full paths), and save."""
        by_day: dict[date, list[str]] = {d: [] for d in days}
        for path in written:
            name = self.relative(path)
            day = date.fromisoformat(name.split("/", 1)[0].removeprefix("date="))
            if day in by_day:
                by_day[day].append(name)
        for day, names in by_day.items():
            self.days[day] = DayRecord(tuple(sorted(names)), data_end)
        self._save()

    def _save(self) -> None:
        state: dict[str, Any] = {
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
        self.store.write_state(MANIFEST, state)


def settle_time(spec: FeatureSpec) -> timedelta:
    """How long after a grid time its label can still change as data arrives: the horizon, then
    the merge window of a failure episode and the silence that makes a GPU lost."""
    return spec.horizon + spec.merge_window + (spec.lost_after or timedelta(0))


def recorded_spec(store: Store) -> FeatureSpec | None:
    """The spec the store's features were built with, from the manifest (None: no manifest, or
    one written before specs were recorded). Reads only; `FeatureManifest.load` may write."""
    state = store.read_state(MANIFEST)
    if not isinstance(state, dict) or state.get("spec") is None:
        return None
    return FeatureSpec.from_json(state["spec"], f"{store.path('_state', f'{MANIFEST}.json')}: spec")
