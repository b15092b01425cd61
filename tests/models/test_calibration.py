"""Calibrated risk: the maps, the figures that judge them, and calibrated models (trained before
their calibration slice, saved and loaded with it; older folders without one still load)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest

from ingest.errors import InputError
from models.calibration import (
    calibration_summary,
    effective_rows,
    expected_calibration_error,
    fit_calibration,
    fit_calibration_on_logits,
    high_risk_check,
    rate_interval,
    reliability,
    wilson_interval,
)
from models.train import (
    FORMAT_VERSION,
    METADATA_FILE,
    TrainOptions,
    UncalibratedModelWarning,
    calibration_bounds,
    calibration_fit_options,
    load_model,
    sample_negatives,
    save_model,
    settled_until,
    train_model,
)
from tests.models import ONE_THREAD, demo_frame

START, END = pd.Timestamp("2026-01-01", tz="UTC"), pd.Timestamp("2026-01-08", tz="UTC")


def rare_event(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """True probabilities skewed towards zero, as GPU failures are, and labels drawn from them."""
    rng = np.random.default_rng(seed)
    p = np.clip(rng.beta(0.3, 30.0, n) * 3.0, 0.0, 1.0)
    return p, (rng.random(n) < p).astype(float)


def logit(p):
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return np.log(p / (1 - p))


def distorted(p):
    """An over-confident model: twice the true log-odds, shifted."""
    return 1.0 / (1.0 + np.exp(-(2.0 * logit(p) + 1.0)))


def test_a_perfectly_calibrated_score_has_an_ece_near_zero_and_a_distorted_one_does_not():
    p, y = rare_event(400_000, seed=1)
    assert expected_calibration_error(y, p) < 0.002
    # (Small in absolute terms even for a bad score: with a rare event most rows are in the
    # first bin, where every error is small; the reliability table shows more.)
    assert expected_calibration_error(y, distorted(p)) > 0.01
    figures = reliability(y, p)
    assert figures["ece"] < 0.002 and figures["n_rows"] == len(y)
    # Every populated bin's observed rate is within its interval of the mean risk there.
    for b in figures["bins"]:
        if b["n_rows"] > 1000:
            low, high = b["observed_ci"]
            assert low - 0.01 <= b["mean_risk"] <= high + 0.01
    assert figures["brier"] < reliability(y, distorted(p))["brier"]


@pytest.mark.parametrize("method", ["platt", "beta", "isotonic"])
def test_a_calibration_fitted_on_one_slice_undoes_the_distortion_on_another(method):
    p, y = rare_event(200_000, seed=2)
    calibration = fit_calibration(distorted(p), y, method, slice_start=START, slice_end=END)
    fresh_p, fresh_y = rare_event(200_000, seed=3)
    calibrated = calibration.apply(distorted(fresh_p))
    assert expected_calibration_error(fresh_y, calibrated) < 0.003
    assert np.all(np.diff(calibrated[np.argsort(distorted(fresh_p))]) >= 0)  # monotone
    if method == "platt":
        assert calibration.params["slope"] == pytest.approx(0.5, abs=0.05)
        assert calibration.params["offset"] == pytest.approx(-0.5, abs=0.15)
    if method == "beta":  # linear in the logit: the bulk's slope is Platt's (few rows set the top's)
        assert calibration.params["a"] == pytest.approx(0.5, abs=0.05)
    provenance = calibration.provenance()
    assert provenance["method"] == method and provenance["n_rows"] == len(y)
    assert provenance["n_positives"] == int(y.sum()) and provenance["slice_start"] == START.isoformat()
    json.dumps(provenance)  # JSON-ready


def test_isotonic_is_interpolated_between_its_blocks_not_a_staircase():
    p, y = rare_event(100_000, seed=4)
    calibration = fit_calibration(p, y, "isotonic", slice_start=START, slice_end=END)
    x = np.linspace(0.02, 0.08, 200)  # inside the range of the blocks
    assert len(np.unique(calibration.apply(x))) > 100


def test_a_slice_with_drawn_healthy_rows_is_weighed_back_to_its_base_rate():
    p, y = rare_event(300_000, seed=5)
    rng = np.random.default_rng(0)
    keep = (y == 1) | (rng.random(len(y)) < 0.1)
    weighed = fit_calibration(p[keep], y[keep], "platt", slice_start=START, slice_end=END, negative_fraction=0.1)
    unweighed = fit_calibration(p[keep], y[keep], "platt", slice_start=START, slice_end=END)
    assert weighed.observed_rate == pytest.approx(y.mean(), rel=0.05)
    assert expected_calibration_error(y, weighed.apply(p)) < 0.003
    assert expected_calibration_error(y, unweighed.apply(p)) > 0.02


def test_platt_is_the_weighted_maximum_likelihood_fit():
    # At the maximum of the weighted likelihood both score equations hold: the calibrated risk's
    # weighted mean is the slice's weighted failure rate, and its residuals are uncorrelated with
    # the score's log-odds. L-BFGS at its default tolerance stopped short of this optimum.
    p, y = rare_event(300_000, seed=6)
    rng = np.random.default_rng(1)
    keep = (y == 1) | (rng.random(len(y)) < 0.1)
    p, y = distorted(p[keep]), y[keep]
    calibration = fit_calibration(p, y, "platt", slice_start=START, slice_end=END, negative_fraction=0.1)
    weight = np.where(y == 1, 1.0, 10.0)
    residual = y - calibration.apply(p)
    assert np.average(residual, weights=weight) == pytest.approx(0.0, abs=1e-6 * y.mean())
    assert np.average(residual * logit(p), weights=weight) == pytest.approx(0.0, abs=1e-5)


def test_calibration_refuses_a_slice_without_failures_and_an_unknown_method():
    with pytest.raises(InputError, match=r"calibration slice .* 0 failures"):
        fit_calibration(np.full(10, 0.1), np.zeros(10), slice_start=START, slice_end=END)
    with pytest.raises(InputError, match="calibration method"):
        fit_calibration(np.full(10, 0.1), np.arange(10) % 2, "spline", slice_start=START, slice_end=END)
    with pytest.raises(InputError, match="one risk per label"):
        fit_calibration(np.full(3, 0.1), np.array([0, 1]), slice_start=START, slice_end=END)


def two_slopes(n: int, seed: int, top_slope: float) -> tuple[np.ndarray, np.ndarray]:
    """Logits of a score whose true log-odds follow it with slope 1 at the bottom and
    `top_slope` at the top (beta calibration's own family: log(p) + top_slope * -log(1 - p)),
    and labels drawn from them; about one row in 300 above a logit of 0."""
    rng = np.random.default_rng(seed)
    z = rng.normal(-5.0, 2.0, n)
    true = -np.logaddexp(0.0, -z) + top_slope * np.logaddexp(0.0, z)
    return z, (rng.random(n) < 1.0 / (1.0 + np.exp(-true))).astype(float)


def test_beta_gives_the_top_its_own_slope_where_platt_is_over_confident_there():
    z, y = two_slopes(600_000, seed=7, top_slope=0.3)
    fresh_z, fresh_y = two_slopes(600_000, seed=8, top_slope=0.3)
    platt = fit_calibration_on_logits(z, y, "platt", slice_start=START, slice_end=END)
    beta = fit_calibration_on_logits(z, y, "beta", slice_start=START, slice_end=END)
    assert beta.params["a"] == pytest.approx(1.0, abs=0.1)
    assert beta.params["b"] == pytest.approx(0.3, abs=0.15)
    # One slope is set by the bulk of healthy rows and is too steep for the few high risks.
    assert high_risk_check(fresh_y, platt.apply_logit(fresh_z))["verdict"] == "outside"
    high = high_risk_check(fresh_y, beta.apply_logit(fresh_z))
    assert high["verdict"] == "within" and high["n_rows"] > 300
    calibrated = beta.apply_logit(np.sort(fresh_z))
    assert np.all(np.diff(calibrated) >= 0) and calibrated[-1] < 1.0


def test_beta_drops_a_tail_whose_slope_comes_out_negative_and_stays_increasing():
    # True log-odds that fall at the top: a decreasing map would fit better; the fit keeps the
    # bottom's slope and refits with none at the top, so the map rises to a ceiling.
    z, y = two_slopes(300_000, seed=9, top_slope=-0.5)
    beta = fit_calibration_on_logits(z, y, "beta", slice_start=START, slice_end=END)
    assert beta.params["b"] == 0.0 and beta.params["a"] > 0.5
    grid = beta.apply_logit(np.linspace(-15.0, 30.0, 1000))
    assert np.all(np.diff(grid) >= 0) and grid[-1] < 1.0


def test_beta_refuses_a_score_that_ranks_failures_below_healthy_rows():
    z, y = two_slopes(50_000, seed=10, top_slope=1.0)
    with pytest.raises(InputError, match=r"calibration slice 2026-01-01 .*beta calibration found the risk falling"):
        fit_calibration_on_logits(-z, y, "beta", slice_start=START, slice_end=END)


def test_wilson_interval_by_hand():
    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-3) and high == pytest.approx(0.7634, abs=1e-3)
    assert wilson_interval(0, 0) == (None, None)


def test_top_risk_ties_counts_the_rows_that_share_the_highest_risk():
    from models.calibration import top_risk_ties

    assert top_risk_ties(np.array([0.1, 0.85, 0.3, 0.85, np.nan, 0.85])) == {"top_risk": 0.85, "n_rows": 3}
    assert top_risk_ties(np.array([0.2, 0.9, 0.5])) == {"top_risk": 0.9, "n_rows": 1}
    assert top_risk_ties(np.array([])) == {"top_risk": None, "n_rows": 0}


def test_a_calibration_from_logits_keeps_the_order_that_probabilities_rounded_away():
    from models.calibration import fit_calibration_on_logits

    rng = np.random.default_rng(3)
    z = rng.normal(0.0, 3.0, 20_000)
    y = (rng.random(20_000) < 1.0 / (1.0 + np.exp(-(0.3 * z - 2.0)))).astype(float)
    start, end = START, END
    on_logits = fit_calibration_on_logits(z, y, "platt", slice_start=start, slice_end=end)
    # Logits of 40, 50 and 60 are all a probability of exactly 1.0 in float64.
    far = np.array([40.0, 50.0, 60.0])
    assert np.all(1.0 / (1.0 + np.exp(-far)) == 1.0)
    via_risk = on_logits.apply(1.0 / (1.0 + np.exp(-far)))
    assert len(np.unique(via_risk)) == 1  # what the map saw before: one value for all three
    risk = on_logits.apply_logit(far)
    assert np.all(np.diff(risk) > 0) and risk.max() < 1.0
    assert on_logits.params["slope"] == pytest.approx(0.3, abs=0.05)


def test_high_risk_check_says_within_outside_or_too_few():
    rng = np.random.default_rng(0)
    p = np.full(2000, 0.7)
    assert high_risk_check((rng.random(2000) < 0.7).astype(float), p)["verdict"] == "within"
    assert high_risk_check((rng.random(2000) < 0.4).astype(float), p)["verdict"] == "outside"
    few = high_risk_check(np.array([1.0, 0.0, 1.0]), np.array([0.6, 0.9, 0.7]))
    assert few["verdict"] == "too few rows" and few["n_rows"] == 3
    # Few rows, but their interval lies wholly below the predicted risk: clearly outside.
    over = high_risk_check(np.r_[np.ones(4), np.zeros(36)], np.full(40, 0.8))
    assert over["observed_ci"][1] - over["observed_rate"] > 0.1  # wider than the tolerance
    assert over["verdict"] == "outside"
    assert few["mean_risk"] == pytest.approx(0.7333, abs=1e-3)
    assert high_risk_check(np.zeros(3), np.full(3, 0.1))["verdict"] == "no rows"


def test_rows_of_one_gpu_count_as_what_they_are_worth():
    # 10 GPUs, 10 hours each, every hour of a GPU sharing its fate: 6 fail, 4 do not.
    gpus = np.repeat(np.arange(10), 10)
    y = np.repeat(np.r_[np.ones(6), np.zeros(4)], 10)
    assert effective_rows(y, gpus) == pytest.approx(9.0)  # the GPUs, less the rate's degree of freedom
    assert type(effective_rows(y, gpus)) is float  # written to metrics.json as it is
    assert rate_interval(y, gpus) == pytest.approx(wilson_interval(0.6 * 9.0, 9.0))
    assert rate_interval(y, None) == pytest.approx(wilson_interval(60, 100))  # no GPUs given: rows
    # Rows each of their own GPU are independent draws; hours that do not share a fate count fully.
    rng = np.random.default_rng(1)
    alone = (rng.random(500) < 0.3).astype(float)
    assert effective_rows(alone, np.arange(500)) == pytest.approx(499, abs=1.0)
    # Every GPU half failing, alternate hours: no correlation within a GPU, and with enough
    # GPUs to see that, every row counts; ten GPUs are too few to lean on it (one draw each).
    assert effective_rows(np.tile([1.0, 0.0], 250), np.repeat(np.arange(50), 10)) == 500
    assert effective_rows(np.tile([1.0, 0.0], 50), np.repeat(np.arange(10), 10)) == 10
    # Every GPU failing: nothing to estimate the correlation from; each GPU counts once, by
    # its share of the rows (n^2 / sum of squared sizes).
    assert effective_rows(np.ones(30), np.repeat(np.arange(3), 10)) == 3
    assert effective_rows(np.ones(30), np.zeros(30, dtype=np.int64)) == 1
    assert effective_rows(np.ones(40), np.repeat(np.arange(2), [30, 10])) == pytest.approx(1600 / 1000)
    # Four GPUs, one healthy hour among 22: their spread looks like independent rows by chance;
    # four GPUs are still about four draws.
    gpus = np.repeat(np.arange(4), [6, 6, 5, 5])
    assert effective_rows(np.r_[np.ones(5), 0.0, np.ones(16)], gpus) == pytest.approx(22**2 / 122)
    assert effective_rows(np.array([]), np.array([], dtype=np.int64)) == 0


def test_a_few_gpus_hours_at_high_risk_cannot_say_outside():
    # 40 hours at risk 0.6 that all failed: as 40 independent rows, clearly above the risk; as
    # the 4 GPUs they come from, too few to tell.
    y, p, gpus = np.ones(40), np.full(40, 0.6), np.repeat(np.arange(4), 10)
    assert high_risk_check(y, p)["verdict"] == "outside"
    by_gpu = high_risk_check(y, p, groups=gpus)
    assert by_gpu["verdict"] == "too few rows"
    assert (by_gpu["n_rows"], by_gpu["n_groups"], by_gpu["effective_rows"]) == (40, 4, 4.0)
    assert by_gpu["observed_ci"][0] == pytest.approx(wilson_interval(4, 4)[0])
    # 400 GPUs of the same fates: enough to say it.
    many = high_risk_check(np.ones(4000), np.full(4000, 0.6), groups=np.repeat(np.arange(400), 10))
    assert many["verdict"] == "outside"
    # The reliability table's intervals count the same way.
    table = reliability(y, p, groups=gpus)["bins"]
    top = next(b for b in table if b["n_rows"])
    assert top["observed_ci"] == pytest.approx(list(wilson_interval(4, 4)))


def test_the_summary_is_the_reliability_figures_without_the_table():
    rng = np.random.default_rng(2)
    p = rng.uniform(0.0, 0.3, 400)
    y = (rng.random(400) < p).astype(float)
    y[:7] = np.nan
    table = reliability(y, p, groups=np.repeat(np.arange(40), 10))
    assert calibration_summary(y, p) == {k: v for k, v in table.items() if k != "bins"}


def test_group_codes_must_be_one_integer_per_row():
    with pytest.raises(ValueError, match="groups: expected 3 integer codes"):
        high_risk_check(np.ones(3), np.full(3, 0.6), groups=np.array(["a", "b", "c"]))
    with pytest.raises(ValueError, match="groups: expected 3 integer codes"):
        reliability(np.ones(3), np.full(3, 0.6), groups=np.arange(2))


# -- calibrated models ------------------------------------------------------------------------

HORIZON = "12h"
CALIBRATED = dict(
    kind="lightgbm",
    train_window="4d",
    horizon=HORIZON,
    params=ONE_THREAD,
    calibration="platt",
    calibration_window="2d",
)


def calibrated_model(method: str = "platt"):
    return train_model(demo_frame(), TrainOptions(**{**CALIBRATED, "calibration": method}))


def test_a_calibrated_model_is_trained_to_the_newest_settled_label_and_calibrated_out_of_time():
    frame = demo_frame()
    options = TrainOptions(**CALIBRATED)
    model = calibrated_model()
    settled = settled_until(frame, HORIZON)
    step = pd.Timedelta("1h")
    start, end = calibration_bounds(settled, options)
    assert end - start == pd.Timedelta(days=2) and start < end <= settled + step
    # Fresh: the served fit ends within one grid step of the newest settled label, the
    # calibration slice included (it was trained as of the slice's start before).
    assert settled - step < model.train_end <= settled
    # Calibrated out of time: the map is that of the fit made as of the slice's start (its last
    # label ends before the slice begins), from its logits on the slice's rows.
    info = model.calibration_info()
    assert info["slice_start"] == start.isoformat() and info["slice_end"] == end.isoformat()
    scorer = train_model(frame, calibration_fit_options(options, start))
    assert scorer.train_end + pd.Timedelta(HORIZON) < start
    assert info["scored_by_train_end"] == scorer.train_end.isoformat()
    part = frame[(frame["ts"] >= start) & (frame["ts"] < end) & frame["label"].notna()]
    assert info["n_positives"] == int((part["label"] == 1).sum()) > 0
    drawn = sample_negatives(part, options.negative_fraction, options.seed)
    expected = fit_calibration_on_logits(
        scorer.predict_uncalibrated_logit(drawn),
        drawn["label"].to_numpy(dtype=float),
        "platt",
        slice_start=start,
        slice_end=end,
        negative_fraction=options.negative_fraction,
    )
    assert info["params"] == pytest.approx(expected.params)
    # The served risk is the calibrated one, in the model's order.
    probe = part.head(3000)
    raw, risk = model.predict_uncalibrated_risk(probe), model.predict_risk(probe)
    np.testing.assert_allclose(risk, model.calibration.apply(raw))
    order = np.argsort(raw, kind="stable")
    assert np.all(np.diff(risk[order]) >= -1e-15)
    # With as_of, nothing at or after as_of - horizon is used, and the fit ends just before it.
    as_of = pd.Timestamp("2026-01-09T00:00Z")
    earlier = train_model(frame, TrainOptions(**CALIBRATED, as_of=as_of))
    assert pd.Timestamp(earlier.calibration_info()["slice_end"]) == as_of - pd.Timedelta(HORIZON)
    assert as_of - pd.Timedelta(HORIZON) - step <= earlier.train_end < as_of - pd.Timedelta(HORIZON)


def test_a_short_history_says_how_many_days_train_and_calibrate(caplog):
    frame = demo_frame()
    first = pd.to_datetime(frame["ts"]).min()
    long_window = dict(CALIBRATED, train_window="30d")
    with caplog.at_level("WARNING", logger="models.train"):
        model = train_model(frame, TrainOptions(**long_window))
    (line,) = [r.getMessage() for r in caplog.records if "short history" in r.getMessage()]
    assert f"the data starts {first:%Y-%m-%d %H:%M}" in line
    assert "train_window 30d + horizon 12h + calibration_window 2d (32.5 days)" in line
    served_days = (model.train_end - first) / pd.Timedelta(days=1)
    assert f"the served model trains on {served_days + 1 / 24:.1f} days" in line
    assert "its calibration map on 2.0 days" in line
    assert model.calibration_info()["note"] == line
    # A history long enough for both fits says nothing.
    caplog.clear()
    with caplog.at_level("WARNING", logger="models.train"):
        train_model(frame, TrainOptions(**CALIBRATED))
    assert not [r for r in caplog.records if "short history" in r.getMessage()]


@pytest.mark.parametrize("method", ["platt", "beta"])
def test_a_calibrated_model_saves_and_loads_with_its_calibration(tmp_path, method):
    model = calibrated_model(method)
    folder = save_model(model, tmp_path / "model")
    meta = json.loads((folder / METADATA_FILE).read_text())
    assert meta["format_version"] == FORMAT_VERSION == 2
    assert meta["calibrated"] is True and meta["calibration"]["method"] == method
    assert set(meta["calibration"]["params"]) == ({"slope", "offset"} if method == "platt" else {"a", "b", "c"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a calibrated model loads without a warning
        loaded = load_model(folder)
    probe = demo_frame().tail(1000)
    np.testing.assert_array_equal(loaded.predict_risk(probe), model.predict_risk(probe))
    assert loaded.version == model.version


def test_a_model_folder_without_calibration_loads_uncalibrated_with_a_warning(tmp_path):
    # A model as saved before models carried a calibration: no such attribute, format 1.
    model = train_model(demo_frame(), TrainOptions(kind="logistic", train_window="3d", horizon=HORIZON))
    del model.__dict__["calibration"]
    folder = save_model(model, tmp_path / "old")
    meta = json.loads((folder / METADATA_FILE).read_text())
    meta["format_version"] = 1
    for key in ("calibrated", "calibration"):
        meta.pop(key)
    (folder / METADATA_FILE).write_text(json.dumps(meta))
    with pytest.warns(UncalibratedModelWarning, match=r"no calibration \(format 1\).*served uncalibrated"):
        loaded = load_model(folder)
    assert not loaded.calibrated and loaded.calibration_info() is None
    probe = demo_frame().tail(500)
    np.testing.assert_array_equal(loaded.predict_risk(probe), loaded.predict_uncalibrated_risk(probe))
    assert loaded.metadata()["calibrated"] is False


def test_a_calibration_slice_without_failures_is_a_clear_error():
    frame = demo_frame()
    settled = settled_until(frame, HORIZON)
    start, end = calibration_bounds(settled, TrainOptions(**CALIBRATED))
    in_slice = (frame["ts"] >= start) & (frame["ts"] < end)
    healthy = frame.loc[~(in_slice & (frame["label"] == 1))]
    with pytest.raises(InputError, match=r"calibration slice .* 0 failures.*calibration_window"):
        train_model(healthy, TrainOptions(**CALIBRATED))
