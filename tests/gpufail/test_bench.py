"""`gpufail bench`'s stage runner reports each stage's own peak memory."""

from __future__ import annotations

import numpy as np

from gpufail.bench import run_stage


def test_a_stage_reports_its_own_peak_memory_not_the_bench_process_size():
    # Linux carries ru_maxrss across fork + exec: a child of a 400 MB parent would say 400 MB.
    ballast = np.ones(400 * 2**20 // 8)
    ballast[::512] = 2.0  # touch every page so it is resident
    stage = run_stage("help", ["--help"])
    assert "Usage" in stage.output
    assert 5 < stage.peak_rss_mb < 200
    assert ballast.sum() > 0
