"""`benchmarks.negative_caps`: the cap comparison behind `[model] max_negatives_per_positive`."""

from __future__ import annotations

import pytest

from benchmarks.negative_caps import compare_caps, main
from tests.models import demo_features_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return demo_features_store(str(tmp_path_factory.mktemp("sample-bench") / "data"))


def test_a_tighter_cap_draws_fewer_rows_and_every_fit_is_scored_on_unseen_days(store):
    results = compare_caps(
        store, as_of="2026-01-08T00:00Z", test_days=2, caps=[3.0, None], train_window="4d", horizon="12h"
    )
    capped, uncapped = results
    assert capped["positives"] == uncapped["positives"] > 0
    # The draw is by key, so the count is the cap's up to sampling noise.
    assert 0.7 * 3 * capped["positives"] < capped["rows"] - capped["positives"] < 1.3 * 3 * capped["positives"]
    assert capped["negative_fraction"] < uncapped["negative_fraction"] == 0.1
    for row in results:
        assert 0.0 < row["average_precision"] <= 1.0 and 0.0 <= row["hourly_precision_top30"] <= 1.0
        assert row["test_positives"] > 0


def test_a_test_period_without_failures_is_refused(store):
    with pytest.raises(SystemExit, match="no labelled failing rows"):
        main(["--data", store.root, "--as-of", "2030-01-01T00:00Z", "--caps", "none"])
