"""Which optional dependency group ("extra", pyproject.toml) a command needs, so that a command
run in an install without it says which to add in one line instead of ending in a traceback.

The extras' contents are read from the installed package's metadata (`Requires-Dist`), the one
home of that knowledge; a command's own role decides when the missing module is not listed in
any extra (a dependency of a dependency).
"""

from __future__ import annotations

import re
from functools import cache

PACKAGE = "gpufail"
OWN_PACKAGES = frozenset({"gpufail", "ingest", "features", "models", "serving"})
"""Modules of gpufail itself: one of these missing is a broken install, not a missing extra."""
COMMAND_EXTRAS = {"collect": "collect", "serve": "serve", "at-risk": "serve"}
"""The extra each command belongs to; every other command needs `train`."""
DEFAULT_EXTRA = "train"
MODULE_DISTRIBUTIONS = {
    "sklearn": "scikit-learn",
    "pynvml": "nvidia-ml-py",
    "xgboost": "xgboost-cpu",
    "yaml": "pyyaml",
    "prometheus_client": "prometheus-client",
}
"""Modules whose distribution has another name."""

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?[^;]*;\s*extra\s*==\s*['\"]([^'\"]+)['\"]")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def extras_of_distributions() -> dict[str, tuple[str, ...]]:
    """Distribution name (normalized) -> the extras that list it, in pyproject order; empty when
    gpufail's metadata cannot be read (a checkout run without installing)."""
    from importlib import metadata

    try:
        requirements = metadata.requires(PACKAGE) or []
    except metadata.PackageNotFoundError:
        return {}
    found: dict[str, list[str]] = {}
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement)
        if match:
            found.setdefault(_normalized(match.group(1)), []).append(match.group(2))
    return {name: tuple(extras) for name, extras in found.items()}


def extra_for(module: str, command: str | None) -> str:
    """The extra to install for `command` when `module` (the name of a module that failed to
    import) is missing: the command's own extra when that lists it, else the first that does,
    else the command's own."""
    own = COMMAND_EXTRAS.get(command or "", DEFAULT_EXTRA)
    top = module.split(".", 1)[0]
    listing = extras_of_distributions().get(_normalized(MODULE_DISTRIBUTIONS.get(top, top)), ())
    if not listing or own in listing:
        return own
    return listing[0]


def missing_extra_line(module: str | None, command: str | None) -> str | None:
    """The one line telling what to install when `module` is missing for `command` (None when
    the module is gpufail's own or unnamed: that is a broken install, which the traceback
    explains better)."""
    if not module:
        return None
    top = module.split(".", 1)[0]
    if top in OWN_PACKAGES:
        return None
    extra = extra_for(module, command)
    what = f"gpufail {command}" if command else "this command"
    return (
        f"{what} needs the Python module {top!r}, which is not installed: "
        f"pip install '{PACKAGE}[{extra}]' (the {extra!r} extra)"
    )
