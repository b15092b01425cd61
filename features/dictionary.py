"""The feature dictionary: every column of the feature frame with its meaning, unit and window.

Generated from the code, not written by hand: the column list is the one a build over every
catalogue metric produces (`features.build.empty_features`), metric meanings and units come from
the metric catalogue (`ingest/metrics.csv`) and XID classes from `ingest/xid_classes.csv`, so a
new metric or window shows up here without anyone editing a document.
`gpufail features --dictionary docs/features.md` writes it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from features.fail_slow import fail_slow_columns
from features.peers import PEER_METRICS
from features.schema import ID_COLUMNS, LABEL_COLUMNS, feature_columns, window_label
from features.spec import DEFAULT_GRID, DEFAULT_WINDOWS, FeatureSpec
from features.windows import bitmask_groups
from features.xids import BURST_MIN
from ingest.schema import TELEMETRY_ID_FIELDS, metric_catalogue
from ingest.xid_catalog import XID_CLASSES


@dataclass(frozen=True)
class FeatureDoc:
    name: str
    family: str  # the module that computes it
    meaning: str
    unit: str
    window: str


_IDENTITY = {
    "ts": ("the grid time t the row describes (features use data <= t)", "UTC"),
    "cluster": ("cluster name", "-"),
    "node": ("node (host) name; position", "-"),
    "gpu_index": ("slot of the GPU in its node (NVML index); position", "-"),
    "gpu_uuid": ("the GPU board's UUID; a replacement board has a new one", "-"),
    "gpu_model": ("GPU model (static attribute; a categorical feature)", "-"),
    "driver": ("driver version (static attribute; a categorical feature)", "-"),
}
_LABELS = {
    "label": ("1: the GPU fails in (t, t + horizon]; 0: it does not; empty: censored (data ends first)", "0/1"),
    "time_to_failure_h": ("hours from t to the failure when label is 1", "h"),
}
_GAUGE_STATS = {
    "mean": "mean of the samples of {what}",
    "max": "maximum sample of {what}",
    "min": "minimum sample of {what}",
    "std": "standard deviation of the samples of {what}",
    "slope": "least-squares slope of the hourly means of {what} on time",
}

_FAIL_SLOW = dict(
    zip(
        (name.removesuffix("_w") for name in fail_slow_columns("w")),
        (
            "1 - its mean SM clock / the median of its node's other loaded GPUs' (positive: slower)",
            "1 - its power per utilisation point / the median of its node's other loaded GPUs'",
            "1 - its highest SM clock / the median of the loaded GPUs of its model (fleet)",
            "the smaller of the node and model clock deficits (the one there is when the other has no peers)",
        ),
        strict=True,
    )
)


def _what(description: str) -> str:
    return description[0].lower() + description[1:]


def describe(name: str, grid: timedelta = DEFAULT_GRID, windows: Sequence[timedelta] = DEFAULT_WINDOWS) -> FeatureDoc:
    """The dictionary entry of one column name; `ValueError` for a name no feature family makes."""
    labels = [window_label(w) for w in windows]
    g = window_label(grid)
    win = "|".join(re.escape(w) for w in sorted(set(labels), key=len, reverse=True))
    longest = f"latest at or before t, at most {window_label(max(windows))} old"
    if name in _IDENTITY:
        meaning, unit = _IDENTITY[name]
        return FeatureDoc(name, "identity", meaning, unit, "-")
    if name in _LABELS:
        meaning, unit = _LABELS[name]
        return FeatureDoc(name, "features.labels", meaning, unit, "(t, t + horizon]")
    fixed = {
        "gpu_age_h": ("hours since the GPU (uuid) was first seen: age in service", "h", "all history"),
        "telemetry_since_last_h": ("hours since the GPU's last telemetry sample", "h", "all history"),
    }
    if name in fixed:
        meaning, unit, window = fixed[name]
        return FeatureDoc(name, "features.windows", meaning, unit, window)
    if m := re.fullmatch(rf"telemetry_missing_frac_({win})", name):
        meaning = "fraction of the expected samples that are missing (GPUs younger than the window: of their life)"
        return FeatureDoc(name, "features.windows", meaning, "fraction", m[1])
    slow = "|".join(_FAIL_SLOW)
    if (m := re.fullmatch(rf"({slow})_({win})", name)) is not None:
        return FeatureDoc(name, "features.fail_slow", _FAIL_SLOW[m[1]], "fraction", m[2])
    for metric in metric_catalogue():
        c, what = metric.column, _what(metric.description)
        if not name.startswith(c + "_"):
            continue
        rest = name[len(c) + 1 :]
        if metric.kind == "gauge":
            if rest == "last":
                return FeatureDoc(name, "features.windows", f"latest reading of {what}", metric.unit, longest)
            if (m := re.fullmatch(rf"(mean|max|min|std|slope)_({win})", rest)) is not None:
                unit = f"{metric.unit}/h" if m[1] == "slope" else metric.unit
                meaning = _GAUGE_STATS[m[1]].format(what=what)
                return FeatureDoc(name, "features.windows", meaning, unit, m[2])
            if c in PEER_METRICS and (m := re.fullmatch(rf"(node|model)_delta_{re.escape(g)}", rest)) is not None:
                peers = "the other GPUs of its node" if m[1] == "node" else "all GPUs of its model (fleet)"
                meaning = f"hourly mean of {what} minus the median hourly mean of {peers} at the same time"
                return FeatureDoc(name, "features.peers", meaning, metric.unit, g)
        if metric.kind == "counter":
            if rest == "last":
                return FeatureDoc(
                    name, "features.windows", f"latest value of the counter: {what}", metric.unit, longest
                )
            if (m := re.fullmatch(rf"increase_({win})", rest)) is not None:
                meaning = f"increase of the counter (robust to resets): {what}"
                return FeatureDoc(name, "features.windows", meaning, metric.unit, m[1])
            if (m := re.fullmatch(rf"rate_({win})", rest)) is not None:
                meaning = f"increase per hour in service within the window: {what}"
                return FeatureDoc(name, "features.windows", meaning, f"{metric.unit}/h", m[1])
        if metric.kind == "flag" and (m := re.fullmatch(rf"max_({win})", rest)) is not None:
            return FeatureDoc(name, "features.windows", f"1 if raised at any sample: {what}", "0/1", m[1])
        if metric.kind == "bitmask":
            for group, mask in bitmask_groups(c).items():
                if (m := re.fullmatch(rf"{group}_frac_({win})", rest)) is not None:
                    bits = "any bit" if mask == -1 else f"any bit of {mask:#x} ({group})"
                    meaning = f"fraction of samples with {bits} set in: {what}"
                    return FeatureDoc(name, "features.windows", meaning, "fraction", m[1])
    classes = "|".join(XID_CLASSES)
    if (m := re.fullmatch(rf"xid_({classes})_count_({win})", name)) is not None:
        meaning = f"XID incidents of class {m[1]} (ingest/xid_classes.csv), by their first line"
        return FeatureDoc(name, "features.xids", meaning, "count", m[2])
    if (m := re.fullmatch(rf"xid_(\d+)_count_({win})", name)) is not None:
        return FeatureDoc(name, "features.xids", f"incidents of XID {m[1]}", "count", m[2])
    if (m := re.fullmatch(rf"xid_application_repeats_({win})", name)) is not None:
        meaning = "kernel-log lines of application-class XID incidents (repeats included), by their last line"
        return FeatureDoc(name, "features.xids", meaning, "lines", m[1])
    if (m := re.fullmatch(rf"xid_application_burst_h_({win})", name)) is not None:
        meaning = f"hours in the window with at least {BURST_MIN} application-class XID incidents (repeat bursts)"
        return FeatureDoc(name, "features.xids", meaning, "h", m[1])
    if (m := re.fullmatch(rf"xid_({classes})_since_last_h", name)) is not None:
        meaning = f"hours since the last XID incident of class {m[1]} (capped; the cap when none)"
        return FeatureDoc(name, "features.xids", meaning, "h", "all history")
    raise ValueError(f"{name!r}: no feature family makes this column; add it to features.dictionary")


def feature_dictionary(spec: FeatureSpec | None = None) -> list[FeatureDoc]:
    """One entry per column of the feature frame a store build with `spec` (default: the
    default spec) writes (every catalogue metric present), in frame order: identity, features,
    labels."""
    from features.build import empty_features

    spec = spec or FeatureSpec()
    columns = [f.name for f in TELEMETRY_ID_FIELDS] + [m.column for m in metric_catalogue()]
    frame = empty_features(columns, spec)
    names = ID_COLUMNS + feature_columns(frame) + LABEL_COLUMNS
    return [describe(n, spec.grid, spec.windows) for n in names]


def dictionary_markdown(spec: FeatureSpec | None = None) -> str:
    """The dictionary as a Markdown document."""
    spec = spec or FeatureSpec()
    grid, windows = spec.grid, spec.windows
    entries = feature_dictionary(spec)
    n_features = sum(e.family not in ("identity", "features.labels") for e in entries)
    lines = [
        "# Feature dictionary",
        "",
        "Generated by `gpufail features --dictionary docs/features.md` from the code (do not edit by hand).",
        f"Grid {window_label(grid)}, windows {', '.join(window_label(w) for w in windows)}: {n_features} features,",
        "one row per GPU per grid time t. A window w at t covers the data in (t - w, t]; no feature",
        "reads data after t. Features are Float32; empty means unknown (no reading in the window).",
        "Definitions in detail: the docstrings of the modules named in the family column.",
        "Which failures make a label (failure XIDs, lost GPUs, repair records, imported failure",
        "records, failures the scheduler saw) is in docs/feature-spec.md, *Label sources*.",
        "",
        "| name | family | meaning | unit | window |",
        "| --- | --- | --- | --- | --- |",
    ]
    for e in entries:
        lines.append(f"| `{e.name}` | {e.family} | {e.meaning} | {e.unit} | {e.window} |")
    return "\n".join(lines) + "\n"
