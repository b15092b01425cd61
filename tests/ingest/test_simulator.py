"""The simulator's realism, as measured properties of what it writes.

A small fleet with a high acceleration factor gives enough failures of every mode to test in
seconds; the plan-only tests use a larger fleet because planning costs milliseconds.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from ingest.errors import InputError
from ingest.simulator import run as sim_run
from ingest.simulator.fleet import plan_fleet
from ingest.simulator.presets import get_preset
from ingest.simulator.run import simulate
from ingest.store import Store

SMALL = {"nodes": 16, "days": 30, "sample_interval_s": 600, "acceleration": 60.0}
XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-f:]+)\): (\d+),")


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "fleet"
    summary = simulate(out, "demo", seed=11, progress=False, **SMALL)
    store = Store.open(str(out))
    telemetry = pl.from_arrow(store.read("telemetry"))
    failures = pl.from_arrow(store.read("failures"))
    return out, summary, telemetry, failures


def window_before(telemetry: pl.DataFrame, uuid: str, end, hours: float) -> pl.DataFrame:
    start = end - np.timedelta64(int(hours * 3600), "s")
    return telemetry.filter((pl.col("gpu_uuid") == uuid) & (pl.col("ts") > start) & (pl.col("ts") <= end))


def increase(frame: pl.DataFrame, column: str) -> int:
    return 0 if frame.height < 2 else int(frame[column].max() - frame[column].min())


# -- counts and calibration (plan only) -----------------------------------------------------


def test_failure_count_and_mode_shares_follow_the_configured_rates():
    # Drift and frailty off, so the expected count is exactly Llama 3's rate times the
    # acceleration. (With frailty on, frail boards fail early and are replaced by average ones,
    # so a fleet realises fewer failures than the nominal rate: see the next test.)
    preset = get_preset(
        "demo",
        nodes=300,
        days=30,
        acceleration=40.0,
        new_nodes_fraction=0.0,
        bad_batch_multiplier=1.0,
        new_driver_gsp_multiplier=1.0,
        gpu_frailty_sigma=0.0,
        node_frailty_sigma=0.0,
    )
    counts, modes = [], Counter()
    for seed in range(3):
        plan = plan_fleet(preset, seed)
        failed = plan.fail_mode[plan.fail_mode >= 0]
        counts.append(len(failed))
        modes.update(preset.failure_modes[m].name for m in failed)
    expected = preset.expected_failures
    # Failed slots sit empty for 12-72 h while the board is replaced, so slightly fewer.
    assert 0.85 * expected < np.mean(counts) < 1.05 * expected, (counts, expected)
    total = sum(modes.values())
    for mode in preset.failure_modes:
        assert abs(modes[mode.name] / total - mode.share) < 0.04, (mode.name, modes[mode.name] / total)


def test_latent_health_concentrates_failures_on_lemon_nodes():
    preset = get_preset("demo", nodes=300, days=60, acceleration=30.0, bad_batch_multiplier=1.0)
    plan = plan_fleet(preset, 4)
    per_node = np.sort(np.bincount(plan.gpu_node[plan.fail_mode >= 0], minlength=len(plan.node_names)))[::-1]
    top_tenth = per_node[: len(per_node) // 10].sum() / per_node.sum()
    assert top_tenth > 0.25, top_tenth  # with equal health the top tenth would hold ~0.15-0.18
    flat = plan_fleet(
        get_preset(
            "demo",
            nodes=300,
            days=60,
            acceleration=30.0,
            bad_batch_multiplier=1.0,
            gpu_frailty_sigma=0.0,
            node_frailty_sigma=0.0,
        ),
        4,
    )
    flat_nodes = np.sort(np.bincount(flat.gpu_node[flat.fail_mode >= 0], minlength=len(flat.node_names)))[::-1]
    assert top_tenth > flat_nodes[: len(flat_nodes) // 10].sum() / flat_nodes.sum() + 0.05


def test_drift_a_bad_batch_fails_more_later_and_the_driver_upgrade_brings_gsp_failures():
    preset = get_preset("demo", nodes=300, days=60, acceleration=30.0)
    plan = plan_fleet(preset, 3)
    third = plan.hours / 3
    bad = plan.gpu_bad_batch
    early = ((plan.gpu_end_h < third) & bad).sum()
    late = ((plan.gpu_end_h >= 2 * third) & (plan.gpu_end_h < plan.hours) & bad).sum()
    assert late > 2 * max(early, 1), (early, late)
    gsp = [m.name for m in preset.failure_modes].index("gsp")
    failed = np.flatnonzero(plan.fail_mode >= 0)
    upgraded = plan.gpu_end_h[failed] >= plan.node_upgrade_h[plan.gpu_node[failed]]
    share_after = (plan.fail_mode[failed][upgraded] == gsp).mean()
    share_before = (plan.fail_mode[failed][~upgraded] == gsp).mean()
    assert share_after > 1.5 * share_before, (share_before, share_after)


@pytest.mark.parametrize("name", ["demo", "paper"])
@pytest.mark.parametrize("days", [30, None])
def test_the_driver_rollout_falls_inside_the_walk_forward_test_period(name, days):
    # The test period is the last 14 days of settled labels (a 24 h horizon before the end):
    # retraining can only show its worth on a change that happens there.
    preset = get_preset(name, **({"days": days} if days else {}))
    test_start_h = (preset.days - 1 - 14) * 24
    assert test_start_h < preset.driver_upgrade_start_h
    assert preset.driver_upgrade_start_h + preset.driver_rollout_days * 24 < (preset.days - 1) * 24
    plan = plan_fleet(get_preset("demo", nodes=20), 0)
    assert plan.node_upgrade_h.min() >= (plan.hours / 24 - 10) * 24


# -- what the rendered data shows ------------------------------------------------------------


def test_summary_matches_what_was_written(sim):
    _, summary, telemetry, failures = sim
    assert summary.telemetry_rows == telemetry.height
    assert summary.failures == failures.height
    assert set(summary.failures_by_mode) == {"hbm_ecc", "nvlink", "off_bus", "thermal_power", "gsp"}
    assert all(v > 0 for v in summary.failures_by_mode.values()), summary.failures_by_mode


def test_a_failed_gpu_reports_nothing_after_its_failure(sim):
    _, _, telemetry, failures = sim
    last = telemetry.group_by("gpu_uuid").agg(pl.col("ts").max().alias("last"))
    joined = failures.join(last, on="gpu_uuid")
    assert (joined["last"] <= joined["ts"]).all()


@pytest.mark.parametrize(
    ("mode", "column", "hours", "min_increase"),
    [("hbm_ecc", "ecc_sbe_aggregate_total", 12, 20), ("nvlink", "nvlink_crc_flit_errors_total", 6, 20)],
)
def test_counter_precursors_rise_before_the_modes_that_have_them(sim, mode, column, hours, min_increase):
    _, _, telemetry, failures = sim
    strong = failures.filter((pl.col("mode") == mode) & (pl.col("precursor_strength") > 0.3))
    assert strong.height >= 2
    rising = [
        increase(window_before(telemetry, r["gpu_uuid"], r["ts"], hours), column) >= min_increase
        for r in strong.iter_rows(named=True)
    ]
    assert np.mean(rising) >= 0.8, rising
    # Healthy GPUs (never failing, no benign noise) see almost none over the same span.
    healthy = telemetry.filter(~pl.col("gpu_uuid").is_in(failures["gpu_uuid"].to_list()))
    per_gpu = healthy.group_by("gpu_uuid").agg((pl.col(column).max() - pl.col(column).min()).alias("inc"))
    assert per_gpu["inc"].median() < min_increase


def test_overheating_gpus_run_hotter_than_their_node_peers_before_failing(sim):
    _, _, telemetry, failures = sim
    peer = telemetry.with_columns(
        (pl.col("temp_gpu_c") - pl.col("temp_gpu_c").median().over(["node", "ts"])).alias("dev")
    )
    strong = failures.filter((pl.col("mode") == "thermal_power") & (pl.col("precursor_strength") > 0.3))
    assert strong.height >= 1
    for r in strong.iter_rows(named=True):
        assert window_before(peer, r["gpu_uuid"], r["ts"], 6)["dev"].mean() > 3


def test_sudden_modes_show_no_numeric_precursor(sim):
    _, _, telemetry, failures = sim
    gsp = failures.filter(pl.col("mode") == "gsp")
    assert gsp.height >= 2
    peer = telemetry.with_columns(
        (pl.col("temp_gpu_c") - pl.col("temp_gpu_c").median().over(["node", "ts"])).alias("dev")
    )
    for r in gsp.iter_rows(named=True):
        # Compare the last 12 hours with the same GPU's 12 hours a day earlier: some boards
        # carry benign counter noise, which is a baseline, not a precursor.
        last = window_before(peer, r["gpu_uuid"], r["ts"], 12)
        earlier = window_before(peer, r["gpu_uuid"], r["ts"] - np.timedelta64(24, "h"), 12)
        for column in ("nvlink_crc_flit_errors_total", "ecc_sbe_aggregate_total"):
            assert increase(last, column) <= 2 * increase(earlier, column) + 10, (column, r["gpu_uuid"])
        assert abs(last["dev"].mean()) < 3
        assert r["precursor_start"] is None


def test_gpus_about_to_fall_off_the_bus_go_quiet(sim):
    _, _summary, telemetry, failures = sim
    per_hour = 3600 / SMALL["sample_interval_s"]
    warned = failures.filter((pl.col("mode") == "off_bus") & (pl.col("precursor_strength") > 0.5))
    assert warned.height >= 1, "the test fleet must hold an off-bus failure with a strong precursor"
    for r in warned.iter_rows(named=True):
        lead_h = (r["ts"] - r["precursor_start"]).total_seconds() / 3600
        seen = window_before(telemetry, r["gpu_uuid"], r["ts"], lead_h).height
        assert seen < 0.85 * lead_h * per_hour


def test_noise_maintenance_gaps_counter_resets_and_sensor_blanks(sim):
    _, _, telemetry, _ = sim
    assert telemetry["temp_gpu_c"].null_count() > 0  # sensor blanks
    # Volatile counters fall back after a driver reload; aggregate ones never do.
    diffs = telemetry.sort(["gpu_uuid", "ts"]).with_columns(
        pl.col("nvlink_crc_flit_errors_total").diff().over("gpu_uuid").alias("vol"),
        pl.col("ecc_sbe_aggregate_total").diff().over("gpu_uuid").alias("agg"),
    )
    assert (diffs["vol"] < 0).sum() > 0
    assert (diffs["agg"] < 0).sum() == 0
    # Maintenance: every GPU of a node silent for hours at once.
    per_node = (
        telemetry.group_by(["node", "ts"]).len().group_by("node").agg(pl.col("ts").sort().diff().max().alias("gap"))
    )
    assert per_node["gap"].max().total_seconds() >= 2 * 3600


def test_drift_driver_upgrade_and_new_nodes_are_visible_between_first_week_and_last_days(sim):
    # The demo rolls the driver out from 10 days before the end over 5 days: the last 4 days
    # are all on the new one.
    _, _summary, telemetry, _ = sim
    start = telemetry["ts"].min()
    first = telemetry.filter(pl.col("ts") < start + np.timedelta64(7, "D"))
    last = telemetry.filter(pl.col("ts") >= telemetry["ts"].max() - np.timedelta64(4, "D"))
    assert set(first["driver"].unique()) == {"535.183.01"}
    assert set(last["driver"].unique()) == {"550.127.05"}
    assert last["node"].n_unique() > first["node"].n_unique()  # a rack joined
    # The new driver reads power 3% higher at the same load.
    busy = pl.col("util_gpu_pct") > 90
    ratio = lambda f: f.filter(busy).select((pl.col("power_w") / pl.col("power_limit_w")).mean()).item()  # noqa: E731
    assert ratio(last) > ratio(first) * 1.01


# -- kernel logs -----------------------------------------------------------------------------


def read_logs(out: Path) -> dict[str, list[str]]:
    return {p.stem: p.read_text().splitlines() for p in sorted((out / "raw" / "kernel-log").glob("*.log"))}


def test_every_failure_leaves_its_terminal_xid_in_its_nodes_log(sim):
    out, _, _, failures = sim
    logs = read_logs(out)
    slot_bus = {
        0: "0000:18:00",
        1: "0000:2a:00",
        2: "0000:3a:00",
        3: "0000:5d:00",
        4: "0000:9a:00",
        5: "0000:ab:00",
        6: "0000:ba:00",
        7: "0000:db:00",
    }
    for r in failures.iter_rows(named=True):
        text = logs[r["node"]]
        bus = slot_bus[r["gpu_index"]]
        if r["xid"] is None:
            assert any(f"NVRM: The NVIDIA GPU {bus}.0" in line for line in text)
            assert any("fallen off the bus and is not responding" in line for line in text)
        else:
            assert any(
                (m := XID_LINE.search(line)) and m.group(1) == bus and int(m.group(2)) == r["xid"] for line in text
            ), r


def test_logs_use_several_real_formats_and_contain_floods_and_a_fleet_wide_crash(sim):
    out, _, _, _ = sim
    logs = read_logs(out)
    shapes = {
        "rfc3339_syslog": re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00 gpu-node-\d+ kernel: "),
        "journal": re.compile(r"^[A-Z][a-z]{2} \d\d \d\d:\d\d:\d\d gpu-node-\d+ kernel: "),
        "dmesg_ctime": re.compile(r"^\[[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}\] "),
        "dmesg_iso": re.compile(r"^kern  :warn  : \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{6}\+00:00 "),
    }
    seen = {name for lines in logs.values() for name, shape in shapes.items() if shape.match(lines[0])}
    assert len(seen) >= 3, seen

    # A flood: hundreds of identical Xid messages on one GPU.
    def longest_repeat(lines: list[str]) -> int:
        # Identical message on one GPU, ignoring the timestamp prefix.
        messages = Counter(line[line.index("NVRM: Xid") :] for line in lines if XID_LINE.search(line))
        return messages.most_common(1)[0][1] if messages else 0

    longest = max(longest_repeat(lines) for lines in logs.values())
    assert longest >= 200
    # A fleet-wide crash: XID 43 from the same process id on at least a tenth of the nodes.
    pids = Counter()
    for lines in logs.values():
        pids.update({m.group(1) for line in lines if (m := re.search(r": 43, pid=(\d+)", line))})
    assert pids.most_common(1)[0][1] >= len(logs) // 10


# -- reproducibility and safety --------------------------------------------------------------


def test_the_same_seed_gives_the_same_fleet(tmp_path):
    tiny = {"nodes": 2, "days": 2, "sample_interval_s": 3600}
    a = simulate(tmp_path / "a", "demo", seed=5, progress=False, **tiny)
    b = simulate(tmp_path / "b", "demo", seed=5, progress=False, **tiny)
    ta = Store.open(str(tmp_path / "a")).read("telemetry").sort_by([("gpu_uuid", "ascending"), ("ts", "ascending")])
    tb = Store.open(str(tmp_path / "b")).read("telemetry").sort_by([("gpu_uuid", "ascending"), ("ts", "ascending")])
    assert ta.equals(tb)
    assert read_logs(tmp_path / "a") == read_logs(tmp_path / "b")
    assert a.telemetry_rows == b.telemetry_rows


def test_a_run_that_fails_midway_leaves_nothing_behind(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = sim_run.render_day

    def fail_on_second_day(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(sim_run, "render_day", fail_on_second_day)
    with pytest.raises(RuntimeError, match="disk full"):
        simulate(tmp_path / "out", "demo", seed=1, progress=False, nodes=2, days=3, sample_interval_s=3600)
    assert list(tmp_path.iterdir()) == []


def test_refuses_a_non_empty_folder_and_unknown_presets(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("precious")
    with pytest.raises(InputError, match="exists and is not an empty folder"):
        simulate(tmp_path / "busy", "demo", progress=False, nodes=1, days=1)
    assert (tmp_path / "busy" / "keep.txt").read_text() == "precious"
    with pytest.raises(InputError, match="preset 'tiny' does not exist"):
        simulate(tmp_path / "new", "tiny", progress=False)


def test_the_real_parser_recovers_every_simulated_failure_from_the_kernel_logs(sim, tmp_path):
    """simulate -> ingest kernel-log: each ground-truth failure appears as an XID incident on
    the right GPU (UUID), with its terminal XID (79 for the off-the-bus text), and floods fold
    into far fewer incidents than lines."""
    import shutil
    from datetime import timedelta

    from ingest.kernel_log_import import ingest_kernel_logs

    out, summary, _, failures = sim
    copy = tmp_path / "fleet"
    shutil.copytree(out, copy)
    store = Store.open(str(copy))
    result = ingest_kernel_logs(
        store, sorted((copy / "raw" / "kernel-log").glob("*.log")), cluster="default", dedup_window=timedelta(minutes=5)
    )
    events = pl.from_arrow(store.read("xid_events"))
    assert events["gpu_uuid"].null_count() == 0
    assert events.height < summary.kernel_log_lines / 10
    expected = failures.with_columns(pl.col("xid").fill_null(79))
    found = expected.join(
        events.select("gpu_uuid", pl.col("xid").alias("seen"), pl.col("ts").alias("seen_ts")), on="gpu_uuid"
    )
    found = found.filter(
        (pl.col("seen") == pl.col("xid")) & ((pl.col("seen_ts") - pl.col("ts")).abs() < np.timedelta64(1, "s"))
    )
    assert found["gpu_uuid"].n_unique() == failures.height
    assert result.rejected == 0 and result.unmapped == 0 and result.untimed == 0
