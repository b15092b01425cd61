"""`benchmarks.kernel_log_parse`: the flood it parses folds into a few incidents, and it reports a rate."""

from __future__ import annotations

import pytest

from benchmarks.kernel_log_parse import FORMATS, bench_parse, describe, flood_lines


@pytest.mark.parametrize("log_format", FORMATS)
def test_the_benchmark_parses_its_flood_in_every_format(log_format: str) -> None:
    assert len(flood_lines(100, log_format)) == 100
    assert bench_parse(2_000, log_format, repeat=1) > 0


def test_the_report_line_names_the_worst_format_against_the_target() -> None:
    line = describe({"kmsg": 400_000.0, "journal": 900_000.0})
    assert "worst kmsg 400,000 lines/s, FAIL" in line and "journal 900,000" in line
