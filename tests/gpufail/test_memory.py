"""`gpufail evaluate` refuses, before reading, a features dataset it cannot hold in memory."""

from datetime import UTC, datetime, timedelta

import pytest

from features.build import build_features
from features.dataset import features_shape, write_features
from gpufail.memory import EVALUATE_BYTES_PER_VALUE, available_bytes, check_evaluate_fits
from ingest.errors import InputError
from ingest.store import Store
from tests.cli import gpufail
from tests.synthetic import synthetic_telemetry, synthetic_xids

GB = 10**9


def _proc(tmp_path, meminfo_kb, cgroup_lines, limits):
    """A fake /proc/meminfo, /proc/self/cgroup and cgroup tree under tmp_path."""
    tmp_path.mkdir()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   {meminfo_kb} kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("\n".join(cgroup_lines) + "\n")
    root = tmp_path / "sys"
    for relative, text in limits.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return {"meminfo": meminfo, "cgroup_file": cgroup, "cgroup_root": root}


def test_available_memory_is_meminfo_or_a_lower_cgroup_limit(tmp_path):
    v1 = ["4:memory:/jobs/a", "3:cpuset:/"]
    lower = _proc(tmp_path / "v1", 8_000_000, v1, {"memory/jobs/a/memory.limit_in_bytes": str(2 * GB)})
    assert available_bytes(**lower) == 2 * GB
    higher = _proc(tmp_path / "v1b", 8_000_000, v1, {"memory/jobs/a/memory.limit_in_bytes": str(64 * GB)})
    assert available_bytes(**higher) == 8_000_000 * 1024
    # cgroup v1's "no limit" is a number near 2**63, v2's the word "max".
    unlimited = _proc(tmp_path / "v1c", 8_000_000, v1, {"memory/jobs/a/memory.limit_in_bytes": "9223372036854771712"})
    assert available_bytes(**unlimited) == 8_000_000 * 1024
    v2 = _proc(tmp_path / "v2", 8_000_000, ["0::/user/b"], {"user/b/memory.max": f"{3 * GB}\n"})
    assert available_bytes(**v2) == 3 * GB
    v2_max = _proc(tmp_path / "v2b", 8_000_000, ["0::/user/b"], {"user/b/memory.max": "max\n"})
    assert available_bytes(**v2_max) == 8_000_000 * 1024


def test_available_memory_is_unknown_without_proc(tmp_path):
    missing = tmp_path / "absent"
    assert available_bytes(meminfo=missing, cgroup_file=missing, cgroup_root=missing) is None


def test_the_check_names_the_sizes_and_refuses_only_past_the_budget():
    rows, columns = 87_393_656, 422
    need = rows * columns * EVALUATE_BYTES_PER_VALUE
    check_evaluate_fits("DATA/features", rows, columns, need)  # exactly enough
    check_evaluate_fits("DATA/features", rows, columns, None)  # unknown: no check
    with pytest.raises(InputError) as refused:
        check_evaluate_fits("DATA/features", rows, columns, need - 1)
    message = str(refused.value)
    assert message.startswith("DATA/features: evaluate holds the whole features dataset in memory")
    assert "87,393,656 rows x 422 columns, about 590.1 GB" in message
    assert "max_memory_gb" in message


@pytest.fixture
def features_root(tmp_path):
    start = datetime(2026, 1, 1, tzinfo=UTC)
    tel = synthetic_telemetry(4, 30, interval=timedelta(minutes=15), gpus_per_node=4, start=start, seed=2)
    frame = build_features(tel, synthetic_xids(tel, per_gpu_day=0.5, seed=2))
    store = Store.create(str(tmp_path / "data"))
    write_features(store, frame)
    return store, frame


def test_features_shape_reads_the_footers(features_root, tmp_path):
    store, frame = features_root
    rows, columns = features_shape(store)
    assert rows == frame.height
    assert columns == frame.width + 1  # write_features adds the sample key
    assert features_shape(Store.create(str(tmp_path / "empty"))) == (0, 0)


def test_evaluate_refuses_a_dataset_beyond_its_memory_budget(features_root, tmp_path):
    store, frame = features_root
    config = tmp_path / "gpufail.toml"
    config.write_text("[evaluate]\nmax_memory_gb = 0.0001\n")
    report = tmp_path / "report"
    result = gpufail("--config", str(config), "evaluate", "--data", store.path(), "--report", str(report), "--quiet")
    assert result.returncode == 2, result.stderr
    assert (
        f"{store.path('features')}: evaluate holds the whole features dataset in memory, {frame.height:,} rows"
        in result.stderr
    )
    assert "0.0 GB is available" in result.stderr
    assert "Traceback" not in result.stderr
    assert not report.exists()
