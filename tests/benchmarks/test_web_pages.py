"""`python -m benchmarks.web_pages` runs end to end on a small fleet (its figures are not
asserted: speed is measured by running the benchmark, not by tests)."""

from __future__ import annotations

import json

import pytest

from benchmarks import web_pages

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Using `httpx`")]


def test_the_benchmark_times_every_page_of_a_small_fleet(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert web_pages.main(["--gpus", "96", "--days", "3", "--repeat", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["gpus"] == 96 and result["nodes"] == 12 and result["days"] == 3
    assert set(result["pages"]) == {"fleet", "fleet_filtered", "fleet_sorted_by_node", "node", "actions"}
    for timing in result["pages"].values():
        assert timing["bytes"] > 1000 and 0 < timing["median_ms"] <= timing["max_ms"]
    printed = capsys.readouterr().out
    assert "operator pages, 96 GPUs (12 nodes), 3 days of history" in printed
    assert "fleet page median" in printed


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit) as exit_:
        web_pages.main(["--gpus", "4"])
    assert exit_.value.code == 2
