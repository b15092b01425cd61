"""Small inline SVG charts, drawn on the server: a time-series line chart (one line per GPU,
optional threshold lines) and a grouped daily bar chart. The browser gets finished markup, so
no charting library ships with the page; each line and bar carries a `<title>` that the
browser shows on hover.

Coordinates are rounded to 0.1 px and long series are reduced to at most `max_points` per
line by keeping each bucket's lowest and highest sample (a spike survives the reduction).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from html import escape

import numpy as np

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f")
"""Line colours, one per GPU slot of a node (index modulo the palette)."""

MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 46, 8, 8, 18


@dataclass(frozen=True)
class Series:
    label: str
    t: np.ndarray
    """Epoch seconds, ascending."""
    y: np.ndarray
    """Values (NaN: no sample; the line breaks there)."""
    color: str


@dataclass(frozen=True)
class HLine:
    y: float
    label: str
    color: str


def color_for(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def reduce_points(t: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most `max_points` samples: the series cut into max_points / 2 buckets by position,
    each kept as its lowest and highest sample in time order."""
    n = len(t)
    if n <= max_points:
        return t, y
    buckets = max(1, max_points // 2)
    edges = np.linspace(0, n, buckets + 1).astype(int)
    keep: list[int] = []
    for lo, hi in itertools.pairwise(edges):
        if hi <= lo:
            continue
        part = y[lo:hi]
        if np.all(np.isnan(part)):
            keep.append(lo)
            continue
        a, b = lo + int(np.nanargmin(part)), lo + int(np.nanargmax(part))
        keep.extend(sorted({a, b}))
    idx = np.asarray(keep, dtype=int)
    return t[idx], y[idx]


def _nice_number(value: float) -> str:
    if value == 0 or not math.isfinite(value):
        return "0"
    magnitude = abs(value)
    if magnitude >= 10_000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.3g}"
    return f"{value:.2g}"


def _time_label(t: float, span_s: float) -> str:
    moment = datetime.fromtimestamp(t, UTC)
    return f"{moment:%m-%d}" if span_s > 3 * 86_400 else f"{moment:%m-%d %H:%M}"


def line_chart(
    series: Sequence[Series],
    *,
    width: int = 460,
    height: int = 130,
    t_range: tuple[float, float] | None = None,
    y_range: tuple[float, float] | None = None,
    hlines: Sequence[HLine] = (),
    value_format: Callable[[float], str] = _nice_number,
    title: str = "",
    max_points: int = 300,
) -> str:
    """An SVG line chart of `series` over time (the x axis spans `t_range`, default the data's).
    The y axis spans `y_range`, default the data's range padded a little (and always 0 for data
    that does not go below 0); `hlines` inside it are drawn dashed and labelled."""
    reduced = [(s, *reduce_points(s.t, s.y, max_points)) for s in series]
    ts = [t for _, t, _ in reduced if len(t)]
    ys = [y[~np.isnan(y)] for _, _, y in reduced]
    ys = [y for y in ys if len(y)]
    if not ts or not ys:
        return _empty(width, height, title, "no data in this window")
    t0, t1 = t_range if t_range is not None else (min(float(t[0]) for t in ts), max(float(t[-1]) for t in ts))
    if t1 <= t0:
        t0, t1 = t0 - 1800, t0 + 1800
    if y_range is not None:
        y0, y1 = y_range
    else:
        lo, hi = min(float(y.min()) for y in ys), max(float(y.max()) for y in ys)
        pad = (hi - lo) * 0.08 or abs(hi) * 0.1 or 1.0
        # A non-negative quantity starts at 0 unless its values sit far from it.
        y0, y1 = (0.0 if 0 <= lo < 2 * (hi - lo) + pad else lo - pad), hi + pad
    if y1 <= y0:
        y1 = y0 + 1.0
    pw, ph = width - MARGIN_LEFT - MARGIN_RIGHT, height - MARGIN_TOP - MARGIN_BOTTOM

    def x_of(t: np.ndarray | float) -> np.ndarray | float:
        return MARGIN_LEFT + (np.asarray(t) - t0) / (t1 - t0) * pw

    def y_of(v: np.ndarray | float) -> np.ndarray | float:
        return MARGIN_TOP + ph - (np.clip(np.asarray(v), y0, y1) - y0) / (y1 - y0) * ph

    parts = [_open(width, height, title), _frame(pw, ph)]
    for v, label in ((y1, value_format(y1)), ((y0 + y1) / 2, value_format((y0 + y1) / 2)), (y0, value_format(y0))):
        yy = float(y_of(v))
        parts.append(
            f'<text class="ax" x="{MARGIN_LEFT - 4}" y="{yy + 3:.1f}" text-anchor="end">{escape(label)}</text>'
        )
    span = t1 - t0
    for frac, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
        tt = t0 + frac * span
        parts.append(
            f'<text class="ax" x="{float(x_of(tt)):.1f}" y="{height - 5}" text-anchor="{anchor}">'
            f"{escape(_time_label(tt, span))}</text>"
        )
    for h in hlines:
        if y0 <= h.y <= y1:
            yy = float(y_of(h.y))
            parts.append(
                f'<line class="hl" x1="{MARGIN_LEFT}" x2="{MARGIN_LEFT + pw}" y1="{yy:.1f}" y2="{yy:.1f}" '
                f'stroke="{h.color}"><title>{escape(h.label)}</title></line>'
                f'<text class="hlt" x="{MARGIN_LEFT + pw - 2}" y="{yy - 2:.1f}" text-anchor="end" fill="{h.color}">'
                f"{escape(h.label)}</text>"
            )
    for s, t, y in reduced:
        parts.append(_polyline(s, np.asarray(x_of(t)), np.asarray(y_of(y)), y))
    parts.append("</svg>")
    return "".join(parts)


def _polyline(s: Series, x: np.ndarray, y: np.ndarray, raw: np.ndarray) -> str:
    present = ~np.isnan(raw)
    runs: list[str] = []
    start = None
    for i, ok in enumerate([*present.tolist(), False]):
        if ok and start is None:
            start = i
        elif not ok and start is not None:
            pts = " ".join(f"{x[j]:.1f},{y[j]:.1f}" for j in range(start, i))
            runs.append(pts)
            start = None
    label = escape(s.label)
    body = []
    for pts in runs:
        if " " in pts:
            body.append(f'<polyline points="{pts}"/>')
        else:
            cx, cy = pts.split(",")
            body.append(f'<circle cx="{cx}" cy="{cy}" r="2"/>')
    return (
        f'<g class="series" data-label="{label}" stroke="{s.color}" fill="{s.color}"><title>{label}</title>'
        + "".join(body)
        + "</g>"
    )


def bar_chart(
    days: Sequence[date],
    groups: Sequence[tuple[str, Sequence[int], str]],
    *,
    width: int = 640,
    height: int = 150,
    title: str = "",
) -> str:
    """Per day, one bar per group side by side; `groups` are (label, counts per day, colour)."""
    if not days:
        return _empty(width, height, title, "no days")
    top = max([1, *(max(counts, default=0) for _, counts, _ in groups)])
    pw, ph = width - MARGIN_LEFT - MARGIN_RIGHT, height - MARGIN_TOP - MARGIN_BOTTOM
    slot = pw / len(days)
    bar = max(1.0, (slot - 2) / max(1, len(groups)))
    parts = [_open(width, height, title), _frame(pw, ph)]
    for v in (top, top / 2, 0):
        yy = MARGIN_TOP + ph - v / top * ph
        parts.append(f'<text class="ax" x="{MARGIN_LEFT - 4}" y="{yy + 3:.1f}" text-anchor="end">{v:g}</text>')
    step = max(1, math.ceil(len(days) / 8))
    for i, day in enumerate(days):
        if i % step == 0 or i == len(days) - 1:
            x = MARGIN_LEFT + (i + 0.5) * slot
            parts.append(f'<text class="ax" x="{x:.1f}" y="{height - 5}" text-anchor="middle">{day:%m-%d}</text>')
    for g, (label, counts, color) in enumerate(groups):
        bars = []
        for i, (day, count) in enumerate(zip(days, counts, strict=True)):
            if count <= 0:
                continue
            h = count / top * ph
            x = MARGIN_LEFT + i * slot + 1 + g * bar
            bars.append(
                f'<rect x="{x:.1f}" y="{MARGIN_TOP + ph - h:.1f}" width="{bar:.1f}" height="{h:.1f}">'
                f"<title>{day:%Y-%m-%d}: {count} {escape(label)}</title></rect>"
            )
        parts.append(f'<g class="bars" data-label="{escape(label)}" fill="{color}">{"".join(bars)}</g>')
    parts.append("</svg>")
    return "".join(parts)


def _open(width: int, height: int, title: str) -> str:
    label = f' aria-label="{escape(title)}"' if title else ""
    return f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img"{label}>'


def _frame(pw: float, ph: float) -> str:
    return f'<rect class="frame" x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{pw}" height="{ph}"/>'


def _empty(width: int, height: int, title: str, message: str) -> str:
    """A chart's frame with `message` in its middle (the chart's `title` stays its label)."""
    return (
        f"{_open(width, height, title or message)}"
        f"{_frame(width - MARGIN_LEFT - MARGIN_RIGHT, height - MARGIN_TOP - MARGIN_BOTTOM)}"
        f'<text class="empty" x="{width / 2:.0f}" y="{height / 2:.0f}" text-anchor="middle">{escape(message)}</text></svg>'
    )
