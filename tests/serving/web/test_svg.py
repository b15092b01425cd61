"""The server-drawn charts: well-formed SVG, lines broken where samples are missing, spikes kept
when a long series is reduced, thresholds drawn only inside the axis, labels escaped."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import date, timedelta

import numpy as np
import pytest

from serving.web.svg import HLine, Series, bar_chart, line_chart, reduce_points


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def test_a_line_per_series_broken_at_missing_samples():
    t = np.arange(10, dtype=float) * 3600
    y = np.array([1, 2, 3, np.nan, 5, 6, 7, 8, np.nan, 10], dtype=float)
    root = parse(line_chart([Series("GPU 0", t, y, "#123456"), Series("GPU 1", t, y * 2, "#654321")]))
    groups = root.findall("g")
    assert [g.get("data-label") for g in groups] == ["GPU 0", "GPU 1"]
    lines = groups[0].findall("polyline")
    assert [len(p.get("points").split()) for p in lines] == [3, 4]
    assert len(groups[0].findall("circle")) == 1  # the lone sample at the end


def test_higher_values_are_drawn_higher():
    t = np.array([0.0, 3600.0])
    root = parse(line_chart([Series("a", t, np.array([1.0, 9.0]), "#000")]))
    (first, second) = [tuple(map(float, p.split(","))) for p in root.find("g/polyline").get("points").split()]
    assert second[0] > first[0] and second[1] < first[1]  # SVG's y grows downwards


def test_reducing_a_long_series_keeps_its_spike_and_its_order():
    t = np.arange(10_000, dtype=float)
    y = np.zeros(10_000)
    y[7_777] = 50.0
    rt, ry = reduce_points(t, y, 200)
    assert len(rt) <= 200 and ry.max() == 50.0 and np.all(np.diff(rt) > 0)
    short_t, _short_y = reduce_points(t[:50], y[:50], 200)
    assert len(short_t) == 50


def test_thresholds_only_inside_the_axis_and_labels_escaped():
    t = np.array([0.0, 3600.0])
    svg = line_chart(
        [Series("<GPU & co>", t, np.array([0.1, 0.2]), "#000")],
        y_range=(0.0, 0.5),
        hlines=[HLine(0.35, "avoid 0.35", "#e8710a"), HLine(0.8, "drain now 0.8", "#8b0000")],
    )
    root = parse(svg)
    assert [line.find("title").text for line in root.findall("line")] == ["avoid 0.35"]
    assert root.find("g").get("data-label") == "<GPU & co>"
    assert "<GPU" not in svg.replace("&lt;GPU", "")


def test_no_data_says_so():
    empty = Series("GPU 0", np.array([]), np.array([]), "#000")
    root = parse(line_chart([empty], title="temp_gpu_c"))
    # The chart keeps its name as its label; what shows in it is that there is nothing to draw.
    assert root.find("text[@class='empty']").text == "no data in this window"
    assert root.get("aria-label") == "temp_gpu_c"
    only_nan = Series("GPU 0", np.array([0.0]), np.array([np.nan]), "#000")
    assert "no data" in line_chart([only_nan])


def test_bar_chart_draws_a_bar_per_nonzero_count_with_its_day():
    days = [date(2026, 3, 1) + timedelta(days=i) for i in range(4)]
    root = parse(bar_chart(days, [("alarms", [0, 2, 1, 0], "#f00"), ("failures", [1, 0, 0, 3], "#000")]))
    alarms, failures = root.findall("g")
    assert [r.find("title").text for r in alarms.findall("rect")] == ["2026-03-02: 2 alarms", "2026-03-03: 1 alarms"]
    heights = [float(r.get("height")) for r in failures.findall("rect")]
    assert heights[1] == pytest.approx(3 * heights[0], abs=0.2)  # rounded to 0.1 px
