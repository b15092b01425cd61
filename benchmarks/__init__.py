"""gpufail's benchmarks: measurements, not tests, and not part of the installed package.

Each module times one stage or hot loop and can run on its own (`python -m benchmarks.<module>
--help`); `python -m benchmarks` (`make bench`, `make bench-paper`) runs the whole set and
writes the report to bench-results/. The figures, with the command behind each, are in
docs/performance.md.

The benchmarks sit above every layer: they may import gpufail, serving, models, features,
ingest and the test fixtures they share with the tests (`tests.synthetic`, `tests.fake_nvml`),
and none of those may import them (tests/test_layers.py). They run from a checkout (the
repository root on the path), which is also why the wheel leaves them out.
"""

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
"""The repository root: child processes run `python -m benchmarks.<module>` from it."""
