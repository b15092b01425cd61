"""`FeatureSpec`: every setting that changes the value of a feature or a label, in one frozen object.

The spec is the one home of these settings and of their defaults. The configuration makes one
(`gpufail.config.Settings.feature_spec`), the feature build takes one, the features dataset
records the one it was built with (`features.manifest`), and a trained model carries the one its
training features were built with, so that everything that builds or reads features for that
model (scoring, the REST endpoint, the nightly job) uses the model's spec and refuses features
built with another (`FeatureSpecMismatch`).

What only changes how fast or in how much memory features are built (threads, block sizes,
read-ahead) is not part of the spec (`features.runner.BuildOptions`): it never changes a value.

A spec is written as a JSON object in the configuration's units (`to_json`, `from_json`) and
named by a fingerprint of that object (`fingerprint`), stable across processes and versions as
long as the settings are the same.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from features.durations import format_duration, format_durations, parse_duration
from ingest.errors import InputError
from ingest.xid_catalog import default_failure_xids

DEFAULT_GRID = timedelta(hours=1)
DEFAULT_FAIL_SLOW_WINDOW = timedelta(hours=24)
DEFAULT_WINDOWS: tuple[timedelta, ...] = (
    timedelta(hours=1),
    timedelta(hours=6),
    timedelta(hours=24),
    timedelta(days=7),
)
DEFAULT_MAX_SILENCE = timedelta(hours=24)
DEFAULT_XID_SINCE_CAP = timedelta(hours=720)
DEFAULT_HORIZON = timedelta(hours=24)
DEFAULT_MERGE_WINDOW = timedelta(hours=6)
DEFAULT_LOST_AFTER = timedelta(hours=6)
_DAY = timedelta(days=1)


class FeatureSpecError(InputError, ValueError):
    """A feature spec whose settings are invalid or do not fit together."""


@dataclass(frozen=True)
class Inconsistency:
    """One way the grid, the windows and the horizon do not fit together."""

    field: str
    """The spec field at fault: "grid", "windows" or "horizon"."""
    message: str
    """What was expected and what was received (without the field's name)."""


def inconsistencies(
    grid: timedelta, windows: Sequence[timedelta], horizon: timedelta, *, grid_name: str | None = None
) -> list[Inconsistency]:
    """How `grid`, `windows` and `horizon` fail to fit together (empty when they fit): the build
    and the labels step in whole grid intervals, and a day holds a whole number of them (feature
    files are daily). `grid_name` is how the messages name the grid (default "the grid '1h'")."""
    if _DAY % grid:
        return [
            Inconsistency(
                "grid",
                f"expected a grid that divides a day, such as '15m', '1h' or '1d', got '{format_duration(grid)}'",
            )
        ]
    grid_text = grid_name or f"the grid '{format_duration(grid)}'"
    problems = []
    off_grid = [w for w in windows if w % grid]
    if off_grid:
        fitted = sorted({-(-w // grid) * grid for w in windows})
        problems.append(
            Inconsistency(
                "windows",
                f"each window must be a multiple of {grid_text}, got {format_durations(off_grid)}; "
                f"e.g. windows = {format_durations(fitted)}",
            )
        )
    elif len(set(windows)) != len(windows):
        problems.append(Inconsistency("windows", f"expected distinct windows, got {format_durations(windows)}"))
    if horizon % grid:
        problems.append(
            Inconsistency(
                "horizon",
                f"expected a multiple of {grid_text}, got '{format_duration(horizon)}'; "
                f'e.g. horizon = "{format_duration(-(-horizon // grid) * grid)}"',
            )
        )
    return problems


@dataclass(frozen=True, kw_only=True)
class FeatureSpec:
    """The settings that shape features and labels (see the module notes)."""

    grid: timedelta = DEFAULT_GRID
    """Rows are at grid times t (multiples of the grid); bucket (t - grid, t] is labelled t."""
    windows: Sequence[timedelta] = DEFAULT_WINDOWS
    """Sliding windows of the window features, each a multiple of the grid (kept as a tuple)."""
    max_silence: timedelta = DEFAULT_MAX_SILENCE
    """A GPU keeps getting rows this long after its last sample (silence is a signal)."""
    xid_since_cap: timedelta = DEFAULT_XID_SINCE_CAP
    """`hours_since_*` XID features are capped here (and when there was none)."""
    horizon: timedelta = DEFAULT_HORIZON
    """Label at grid time t: does the GPU fail in (t, t + horizon]?"""
    failure_xids: Iterable[int] = field(default_factory=default_failure_xids)
    """XID codes that count as a failure (kept sorted, as a tuple)."""
    merge_window: timedelta = DEFAULT_MERGE_WINDOW
    """Failure events on one GPU closer than this are one failure episode."""
    lost_after: timedelta | None = DEFAULT_LOST_AFTER
    """A GPU silent this long while its node keeps reporting is lost (a failure); None: never."""
    fail_slow_window: timedelta | None = DEFAULT_FAIL_SLOW_WINDOW
    """The window of the fail-slow features (`features.fail_slow`: a GPU's sustained deficit
    against its node and model peers), which the feature build computes when it is one of
    `windows`; None: none."""

    def __post_init__(self) -> None:
        # Sequences given as lists (or any iterable) are kept as tuples: the spec is hashable,
        # and two specs of the same settings are equal.
        for name in ("windows", "failure_xids"):
            value = getattr(self, name)
            if isinstance(value, Iterable) and not isinstance(value, str | bytes):
                object.__setattr__(self, name, tuple(value))
        problems = _field_problems(self)
        if not problems:
            object.__setattr__(self, "failure_xids", tuple(sorted(set(self.failure_xids))))
            problems = [f"{p.field}: {p.message}" for p in inconsistencies(self.grid, self.windows, self.horizon)]
        if problems:
            raise FeatureSpecError("feature spec: " + "; ".join(problems))

    # -- the stored form ---------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON-ready object, durations in the configuration's units ("6h")."""
        return {
            "grid": format_duration(self.grid),
            "windows": [format_duration(w) for w in self.windows],
            "max_silence": format_duration(self.max_silence),
            "xid_since_cap": format_duration(self.xid_since_cap),
            "horizon": format_duration(self.horizon),
            "failure_xids": list(self.failure_xids),
            "merge_window": format_duration(self.merge_window),
            "lost_after": None if self.lost_after is None else format_duration(self.lost_after),
        } | self._fail_slow_json()

    def _fail_slow_json(self) -> dict[str, Any]:
        # Written only when not the default: specs written before the setting existed computed
        # the same 24 h fail-slow features, and keep their fingerprints.
        if self.fail_slow_window == DEFAULT_FAIL_SLOW_WINDOW:
            return {}
        window = self.fail_slow_window
        return {"fail_slow_window": None if window is None else format_duration(window)}

    @property
    def fail_slow_label(self) -> str | None:
        """The suffix of the fail-slow features' names (`24h`), None when they are not computed."""
        from features.schema import window_label

        window = self.fail_slow_window
        return window_label(window) if window is not None and window in self.windows else None

    @classmethod
    def from_json(cls, data: Any, where: str = "feature spec") -> FeatureSpec:
        """The spec `to_json` wrote; a `FeatureSpecError` naming `where` and the key otherwise."""
        if not isinstance(data, Mapping):
            raise FeatureSpecError(f"{where}: expected an object of feature settings, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names))
        missing = [n for n in names if n not in data and n not in _OPTIONAL_KEYS]
        if unknown or missing:
            raise FeatureSpecError(
                f"{where}: expected the keys {names}, got "
                + ", ".join(
                    ([f"unknown {unknown} (written by a newer gpufail?)"] if unknown else [])
                    + ([f"no {missing}"] if missing else [])
                )
            )
        values: dict[str, Any] = {}
        for name in names:
            if name not in data:
                continue
            raw = data[name]
            try:
                if name == "windows":
                    if not isinstance(raw, list):
                        raise ValueError(f"expected a list of durations, got {raw!r}")
                    values[name] = tuple(parse_duration(w) for w in raw)
                elif name == "failure_xids":
                    if not isinstance(raw, list) or not all(
                        isinstance(x, int) and not isinstance(x, bool) for x in raw
                    ):
                        raise ValueError(f"expected a list of XID codes, got {raw!r}")
                    values[name] = tuple(raw)
                elif name in ("lost_after", "fail_slow_window") and raw is None:
                    values[name] = None
                else:
                    values[name] = parse_duration(raw)
            except ValueError as exc:
                raise FeatureSpecError(f"{where}: {name}: {exc}") from None
        try:
            return cls(**values)
        except FeatureSpecError as exc:
            raise FeatureSpecError(f"{where}: {str(exc).removeprefix('feature spec: ')}") from None

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming the settings: equal specs, equal fingerprints."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def differences(self, other: FeatureSpec) -> list[tuple[str, Any, Any]]:
        """(field, this spec's value, the other's) for each setting the two specs differ in, as
        `to_json` writes them."""
        mine, theirs = self._every_setting(), other._every_setting()
        return [(name, mine[name], theirs[name]) for name in mine if mine[name] != theirs[name]]

    def _every_setting(self) -> dict[str, Any]:
        window = self.fail_slow_window
        return self.to_json() | {"fail_slow_window": None if window is None else format_duration(window)}


def _field_problems(spec: FeatureSpec) -> list[str]:
    """Each field of the wrong type or out of range, as "name: expected ..., got ..."."""
    problems = []
    positive = {"grid": spec.grid, "horizon": spec.horizon, "xid_since_cap": spec.xid_since_cap}
    if spec.lost_after is not None:
        positive["lost_after"] = spec.lost_after
    if spec.fail_slow_window is not None:
        positive["fail_slow_window"] = spec.fail_slow_window
    for name, value in positive.items():
        if not isinstance(value, timedelta) or value <= timedelta(0):
            problems.append(f"{name}: expected a duration above zero, got {value!r}")
    for name, value in (("max_silence", spec.max_silence), ("merge_window", spec.merge_window)):
        if not isinstance(value, timedelta) or value < timedelta(0):
            problems.append(f"{name}: expected a duration of zero or more, got {value!r}")
    if not isinstance(spec.windows, tuple):
        problems.append(f"windows: expected a list of durations, got {spec.windows!r}")
    elif not spec.windows:
        problems.append("windows: expected at least one window, got none")
    else:
        bad = [w for w in spec.windows if not isinstance(w, timedelta) or w <= timedelta(0)]
        if bad:
            problems.append(f"windows: expected durations above zero, got {bad!r}")
    xids = spec.failure_xids
    if not isinstance(xids, tuple) or any(isinstance(x, bool) or not isinstance(x, int) for x in xids):
        problems.append(f"failure_xids: expected a list of whole XID codes, got {xids!r}")
    return problems


_OPTIONAL_KEYS = frozenset({"fail_slow_window"})
"""Keys `to_json` leaves out at their default (`FeatureSpec._fail_slow_json`)."""


class FeatureSpecMismatch(InputError):
    """Features built with one spec, needed by a model (or asked for by a build) of another."""


def spec_mismatch(
    *, built: FeatureSpec, wanted: FeatureSpec, features: str, user: str, remedy: str
) -> FeatureSpecMismatch:
    """The one-line refusal: `features` (e.g. "data/: the features") "were built with feature
    spec <fingerprint>, but" `user` (e.g. "model lightgbm-... needs") "feature spec
    <fingerprint>; they differ in" each differing setting, then `remedy`."""
    differ = ", ".join(
        f"{name} ({json.dumps(have)} against {json.dumps(want)})" for name, have, want in built.differences(wanted)
    )
    return FeatureSpecMismatch(
        f"{features} were built with feature spec {built.fingerprint}, but {user} feature spec "
        f"{wanted.fingerprint}; they differ in {differ}; {remedy}"
    )


def require_spec(built: FeatureSpec | None, wanted: FeatureSpec, *, features: str, user: str, remedy: str) -> None:
    """`spec_mismatch` unless features built with `built` are what `wanted` asks for. Features
    whose spec was not recorded (`built` None: built before specs were recorded) pass: there is
    nothing to check them against."""
    if built is not None and built != wanted:
        raise spec_mismatch(built=built, wanted=wanted, features=features, user=user, remedy=remedy)
