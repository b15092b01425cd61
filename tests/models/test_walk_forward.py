"""Walk-forward training on small synthetic frames: the horizon gap, auto L_train under a
planted drift, static vs sliding, and refusing what cannot be run."""

from __future__ import annotations

from functools import cache

import numpy as np
import pandas as pd
import pytest

from ingest.errors import InputError
from models.walk_forward import Contender, WalkForwardPlan, check_contenders, duration_label, run_walk_forward
from tests.models import START, make_synthetic_frame
from tests.models.walk_forward_cases import FAST, PLAN, small_frame


@cache
def small_run():
    contenders = [
        Contender("lgb static", "lightgbm", "static", FAST),
        Contender("lgb sliding", "lightgbm", "sliding", FAST),
        Contender("lgb auto", "lightgbm", "auto", FAST),
    ]
    return run_walk_forward(small_frame(), contenders, PLAN)


def test_no_fit_trains_on_a_row_whose_label_window_reaches_its_test_period():
    result = small_run()
    horizon = pd.Timedelta(hours=12)
    trained = [f for f in result.fits if f.status == "trained"]
    assert len(trained) == 1 + 3 + 3  # static once, sliding and auto at each of the 3 days
    step = pd.Timedelta(hours=1)
    for fit in trained:
        # A training row at ts has its label window (ts, ts + horizon]; the model scores from
        # retrain_at and is trained up to the newest label settled then (within a grid step), as
        # the served model is. Its map was fitted on the calibration slice
        # [retrain_at - horizon - 1d, retrain_at - horizon) as scored by a fit that no label of
        # the slice reached.
        assert fit.retrain_at - horizon - step <= fit.train_end and fit.train_end + horizon < fit.retrain_at
        slice_start, slice_end = (pd.Timestamp(fit.calibration[k]) for k in ("slice_start", "slice_end"))
        assert slice_end == fit.retrain_at - horizon and slice_end - slice_start == pd.Timedelta(days=1)
        assert pd.Timestamp(fit.calibration["scored_by_train_end"]) + horizon < slice_start
        assert fit.calibration["n_positives"] > 0 and fit.calibration["method"] == "platt"
    ts = result.test["ts"]
    for name in ("lgb sliding", "lgb auto"):
        assert not np.isnan(result.scores[name]).any()
        ages = result.model_age_h[name]
        assert ages.min() >= 0 and ages.max() < 24  # every row scored by the model of its own day
    static_age = result.model_age_h["lgb static"]
    assert static_age.max() == pytest.approx((ts.max() - result.test_start) / pd.Timedelta(hours=1))


def test_the_sliding_window_moves_with_the_retraining_time():
    fits = [f for f in small_run().fits if f.contender == "lgb sliding"]
    assert [f.retrain_at - fits[0].retrain_at for f in fits] == [pd.Timedelta(days=d) for d in range(3)]
    for f in fits:
        assert f.train_window == "4d"
        assert f.train_end - f.train_start <= pd.Timedelta(days=4)
        # The window ends a horizon before retrain_at.
        assert f.train_start >= f.retrain_at - pd.Timedelta(hours=12) - pd.Timedelta(days=4)


def test_the_test_period_ends_at_the_last_settled_label_and_spans_test_days():
    result = small_run()
    last = small_frame()["ts"].max()
    assert result.test_end == last - pd.Timedelta(hours=12)
    assert result.test["ts"].min() == result.test_start
    assert result.test_end - result.test_start == pd.Timedelta(days=3) - pd.Timedelta(hours=1)
    assert result.test["label"].notna().all()


def drifting_frame(seed: int = 0) -> pd.DataFrame:
    """The precursor that announces failures switches from one column to another on day 6:
    a long window mixes the old pattern in, a short one has only the new."""
    frame = make_synthetic_frame(n_gpus=160, n_hours=24 * 14, horizon_h=12, fail_fraction=0.5, seed=seed, signal=4.0)
    rng = np.random.default_rng(seed + 100)
    switch = START + pd.Timedelta(days=6)
    late = (frame["ts"] >= switch).to_numpy()
    signal = frame["pcie_replay_rate_6h"].to_numpy().copy()
    # After the switch the old column is noise and the new one carries the ramp; before, the reverse.
    frame["nvlink_crc_rate_6h"] = np.where(late, signal, rng.normal(0.0, 1.0, len(frame))).astype("float32")
    frame["pcie_replay_rate_6h"] = np.where(late, rng.normal(0.0, 1.0, len(frame)), signal).astype("float32")
    frame["xid_count_24h"] = np.float32(0.0)
    return frame


def test_auto_picks_the_window_that_is_best_on_validation_after_a_drift():
    frame = drifting_frame()
    plan = WalkForwardPlan(
        horizon="12h",
        test_days=2,
        candidate_windows=("2d", "8d"),
        validation_window="1d",
        negative_fraction=0.5,
        top_k="5",
        calibration_window="1d",
    )
    result = run_walk_forward(frame, [Contender("auto", "logistic", "auto")], plan)
    fits = result.fits
    assert len(fits) == 2
    for fit in fits:
        # The models are trained as of 1.5 days before they score (calibration slice and horizon):
        # the 2-day window then holds mostly the new pattern, the 8-day one mostly the old.
        assert fit.validation is not None
        assert fit.validation["2d"] > fit.validation["8d"]
        assert fit.train_window == "2d"
        assert fit.train_end - fit.train_start <= pd.Timedelta(days=2)


def test_a_kind_that_is_not_available_is_refused_before_any_training():
    contenders = [Contender("ok", "lightgbm", "sliding"), Contender("future", "quantum_forest", "sliding")]
    with pytest.raises(InputError, match=r"'future'.*'quantum_forest' is not available"):
        run_walk_forward(small_frame(), contenders, PLAN)


@pytest.mark.parametrize(
    ("contenders", "message"),
    [
        ([], "at least one contender"),
        ([Contender("a", "lightgbm", "static"), Contender("a", "logistic", "static")], "unique name"),
        ([Contender("random", "lightgbm", "static")], "unique name"),
        ([Contender("a", "lightgbm", "weekly")], "mode expected one of"),
    ],
)
def test_bad_contender_lists_are_refused(contenders, message):
    with pytest.raises(InputError, match=message):
        check_contenders(contenders)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"test_days": 0}, "test_days"),
        ({"test_days": 30}, "before any settled training label"),
        ({"negative_fraction": 0.0}, "negative_fraction"),
        ({"jobs": 0}, "jobs"),
        ({"top_k": "many"}, "top_k 'many'"),
        ({"candidate_windows": ()}, "candidate_windows"),
        ({"retrain_every": "soon"}, "retrain_every"),
    ],
)
def test_bad_plans_are_refused(change, message):
    plan = WalkForwardPlan(**{**PLAN.__dict__, **change})
    with pytest.raises(InputError, match=message):
        run_walk_forward(small_frame(), [Contender("auto", "logistic", "auto")], plan)


def test_a_retrain_without_failures_keeps_the_previous_model():
    frame = small_frame().copy()
    # No failure is labelled during the last 3 days of training data before the last test day.
    last_day = frame["ts"].max() - pd.Timedelta(hours=12) - pd.Timedelta(days=1)
    quiet = (frame["ts"] >= last_day - pd.Timedelta(days=3)) & (frame["ts"] < last_day)
    frame.loc[quiet & (frame["label"] == 1), "label"] = 0
    plan = WalkForwardPlan(**{**PLAN.__dict__, "train_window": "2d"})
    result = run_walk_forward(frame, [Contender("lr", "logistic", "sliding")], plan)
    statuses = [f.status for f in result.fits]
    assert statuses[0] == "trained"
    assert any(s.startswith("kept previous model") for s in statuses)
    assert not np.isnan(result.scores["lr"]).any()
    kept = next(f for f in result.fits if f.status != "trained")
    rows = (result.test["ts"] >= kept.retrain_at).to_numpy()
    assert result.model_age_h["lr"][rows].min() >= 24  # scored by an older model


def test_a_contender_that_cannot_train_at_its_first_retrain_is_an_error():
    frame = small_frame().copy()
    frame["label"] = frame["label"].where(frame["label"].isna(), 0).astype("Int8")
    with pytest.raises(InputError, match="could not be trained at its first retraining time"):
        run_walk_forward(frame, [Contender("lr", "logistic", "static")], PLAN)


def test_duration_labels():
    assert [duration_label(d) for d in ("21d", "36h", "90m", "45s", pd.Timedelta(days=2))] == [
        "21d",
        "36h",
        "90m",
        "45s",
        "2d",
    ]


@pytest.mark.slow
def test_two_processes_give_the_same_scores_as_one():
    contenders = [Contender("lgb sliding", "lightgbm", "sliding", FAST), Contender("lr auto", "logistic", "auto")]
    one = run_walk_forward(small_frame(), contenders, PLAN)
    two = run_walk_forward(small_frame(), contenders, WalkForwardPlan(**{**PLAN.__dict__, "jobs": 2}))
    for name in one.scores:
        assert np.array_equal(one.scores[name], two.scores[name])
    assert [f.as_dict() for f in one.fits] == [f.as_dict() for f in two.fits]


def test_a_fit_scores_its_rows_as_runs_of_consecutive_positions():
    from models.walk_forward_rows import Span, spans

    ns = np.arange(10) * 3600 * 10**9
    assert spans(np.array([], dtype=np.int64), ns) == []
    assert spans(np.array([4]), ns) == [Span(slice(4, 5), ns[4], ns[4] + 1000)]
    # a calibration slice, the horizon gap, then the day the model serves
    assert [s.rows for s in spans(np.array([0, 1, 2, 6, 7, 9]), ns)] == [slice(0, 3), slice(6, 8), slice(9, 10)]
    # each run names the grid times it covers (to the store's microsecond), which is how the
    # store is read for it
    assert [(s.start_ns, s.end_ns) for s in spans(np.array([0, 1, 2, 6, 7, 9]), ns)] == [
        (ns[0], ns[2] + 1000),
        (ns[6], ns[7] + 1000),
        (ns[9], ns[9] + 1000),
    ]


def test_a_fit_with_no_rows_to_score_trains_and_says_why_it_cannot_be_calibrated():
    from models.walk_forward import _Calibrates, _FitTask, _outcome, _run_fit, _spec, _Timeline
    from models.walk_forward_rows import FrameRows, Pool

    frame = small_frame()
    timeline = _Timeline(frame, PLAN.negative_fraction, 0)
    end = pd.Timestamp(timeline.ns[-1], tz="UTC")
    first = pd.Timestamp(timeline.ns[0], tz="UTC")
    pool = Pool(first, end - pd.Timedelta(hours=12), end - timeline.step, end)
    frames = FrameRows(timeline.frame.iloc[:0], timeline.frame, timeline.ns, timeline.trainable)
    fit = _run_fit(_FitTask(_spec("lightgbm", FAST, "30d", ()), end, pool, pd.Timedelta(hours=12)), frames)
    nothing = np.zeros(0, dtype=np.int64)
    outcome = _outcome(fit, nothing, None, _Calibrates(nothing, (end, end)), np.zeros(0), "platt")
    assert outcome.model is not None and outcome.status == "trained"
    assert len(outcome.rows) == 0 and outcome.raw is not None and len(outcome.raw) == 0
    assert outcome.calibration is None and "0 labelled rows with 0 failures" in str(outcome.calibration_error)


class _EndsTheProcess:
    """Unpickled in a fit worker as it starts, it ends that process at once, as the kernel's
    out-of-memory killer would."""

    def __reduce__(self):
        import os

        return (os._exit, (9,))

    def __len__(self) -> int:
        return 1000


@pytest.mark.slow
def test_a_fit_process_that_dies_is_one_line_naming_memory_and_the_setting_to_lower():
    from ingest.errors import GpufailError
    from models.walk_forward import _FitTask, _run_fit, _Runner, _spec
    from models.walk_forward_rows import FrameRows, Pool

    frames = FrameRows(_EndsTheProcess(), pd.DataFrame(), np.zeros(0), np.zeros(0))  # type: ignore[arg-type]
    task = _FitTask(_spec("lightgbm", FAST, "7d", ()), START, Pool(START, START, START, START), pd.Timedelta(hours=24))
    with (
        pytest.raises(
            GpufailError, match=r"fit process ended abruptly, most likely killed for lack of memory.*jobs = 1"
        ),
        _Runner(frames, jobs=2, client=None, progress=False) as runner,
    ):
        list(runner.map(_run_fit, iter([task]), 1, "fits"))


def test_a_caller_that_stops_early_cancels_the_fits_still_queued(monkeypatch):
    import concurrent.futures

    from models.walk_forward import _run_fit, _Runner
    from models.walk_forward_rows import FrameRows

    shutdowns = []

    class Recorded(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, max_workers, mp_context=None, initializer=None, initargs=()):
            super().__init__(max_workers)

        def map(self, fn, *iterables, **kwargs):
            return (f"outcome {task}" for task in iterables[0])

        def shutdown(self, wait=True, *, cancel_futures=False):
            shutdowns.append(cancel_futures)
            super().shutdown(wait, cancel_futures=cancel_futures)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Recorded)
    frames = FrameRows(pd.DataFrame(), pd.DataFrame(), np.zeros(0), np.zeros(0))
    with _Runner(frames, jobs=2, client=None, progress=False) as runner:
        outcomes = runner.map(_run_fit, iter(range(50)), 50, "fits")
        assert next(outcomes) == "outcome 0"
    # as an error in the caller, or Ctrl-C, would: the runner closes
    assert shutdowns == [True]


def test_monotone_constraints_reach_every_contender_that_can_take_them() -> None:
    from models.walk_forward import _constraints_for

    wanted = ("ecc_dbe_*_increase_*",)
    assert _constraints_for(Contender("l", "lightgbm", "sliding"), wanted) == wanted
    assert _constraints_for(Contender("p", "parallel", "sliding"), wanted) == wanted  # default members
    assert _constraints_for(Contender("c", "cascade", "static"), wanted) == wanted
    # the MLP has no monotone constraint: alone or as a member it trains unconstrained
    assert _constraints_for(Contender("m", "mlp", "static"), wanted) == ()
    assert _constraints_for(Contender("p", "parallel", "static", {"members": ["lightgbm", "mlp"]}), wanted) == ()


def test_fits_train_on_the_pool_as_drawn_without_subsampling_it_again(monkeypatch) -> None:
    # The plan draws the negatives once (negative_fraction); train_model must keep them all,
    # or every fit would see a second, different sample and the recorded factor would be wrong.
    import models.walk_forward as wf

    seen: list = []
    real = wf.train_model

    def recording(frame, options):
        seen.append(options)
        return real(frame, options)

    monkeypatch.setattr(wf, "train_model", recording)
    run_walk_forward(small_frame(), [Contender("lgb static", "lightgbm", "static", FAST)], PLAN)
    assert seen and all(options.negative_fraction == 1.0 for options in seen)


# -- shared fits: a parallel ensemble from its members' walk-forward scores -----------------------


@cache
def tiny_frame() -> pd.DataFrame:
    return make_synthetic_frame(n_gpus=60, n_hours=24 * 9, horizon_h=12, fail_fraction=0.5, seed=3)


TINY = WalkForwardPlan(horizon="12h", test_days=2, train_window="3d", negative_fraction=1.0, calibration_window="1d")


@pytest.mark.parametrize("combine", ["top_k_intersection", "rank_average"])
def test_a_parallel_contender_scores_exactly_what_the_fitted_ensemble_scores(combine):
    from models.train import TrainOptions, train_model

    members = {"members": ["lightgbm", "logistic"], "member_params": {"lightgbm": {"n_estimators": 20}}}
    ensemble = {**members, "combine": combine, "top_k": 5, "n_jobs": 1}
    contenders = [
        Contender("lgb", "lightgbm", "sliding", {"n_estimators": 20, "n_jobs": 1}),
        Contender("lr", "logistic", "sliding"),
        Contender("par", "parallel", "sliding", ensemble),
    ]
    result = run_walk_forward(tiny_frame(), contenders, TINY)
    # The ensemble's members are the two single contenders' fits: nothing trained twice. Each
    # retrain is two fits: the model, and the fit as of its calibration slice's start.
    assert result.n_fits == 2 * 2 * 2 and result.n_fits_unshared == 4 * 2 * 2
    ts = result.test["ts"]
    for r in result.retrain_times:
        # What `gpufail train` makes as of r: trained up to r - horizon, calibrated on the day
        # before r - horizon as scored by a fit as of that day's start.
        options = TrainOptions(
            kind="parallel",
            train_window="3d",
            horizon="12h",
            as_of=r,
            params=ensemble,
            negative_fraction=1.0,
            calibration="platt",
            calibration_window="1d",
        )
        fitted = train_model(tiny_frame(), options)
        day = ((ts >= r) & (ts < r + pd.Timedelta(days=1))).to_numpy()
        rows = result.test.loc[day]
        # To the last bit but for the logistic member's dot products: BLAS blocks a batch's rows by
        # position, so a row scored beside other rows may round a unit apart.
        np.testing.assert_allclose(result.scores["par"][day], fitted.predict_uncalibrated_risk(rows), rtol=1e-14)
        np.testing.assert_allclose(result.calibrated["par"][day], fitted.predict_risk(rows), rtol=1e-9)
        np.testing.assert_array_equal(result.flags["par"][day], fitted.estimator.flags(fitted.design_matrix(rows)))
        fit = next(f for f in result.fits if f.contender == "par" and f.retrain_at == r)
        assert (fit.status, fit.train_end, fit.n_rows) == ("trained", fitted.train_end, fitted.n_rows)
        assert fit.calibration == fitted.calibration_info()
    # The operating points' validation rows: the first model's calibration slice, before the test.
    first = result.retrain_times[0]
    assert result.validation["ts"].min() == first - pd.Timedelta("12h") - pd.Timedelta(days=1)
    assert result.validation["ts"].max() < first - pd.Timedelta("12h")
    assert len(result.validation_calibrated["par"]) == len(result.validation) == len(result.validation_flags["par"])
    assert set(result.flags) == set(result.validation_flags) == {"par"}


def test_a_static_contender_shares_its_fit_with_the_first_sliding_one():
    contenders = [Contender("s", "lightgbm", "static", FAST), Contender("d", "lightgbm", "sliding", FAST)]
    result = run_walk_forward(tiny_frame(), contenders, TINY)
    # Each retrain is two fits (the model; the fit scoring its calibration slice): the static
    # contender's two are the first sliding retrain's.
    assert (result.n_fits, result.n_fits_unshared) == (4, 6)
    first = (result.test["ts"] < result.retrain_times[1]).to_numpy()
    np.testing.assert_array_equal(result.scores["s"][first], result.scores["d"][first])
    assert not np.array_equal(result.scores["s"][~first], result.scores["d"][~first])


def test_an_ensemble_contender_with_members_that_are_not_single_kinds_is_refused():
    with pytest.raises(InputError, match=r"'p'.*params.members: expected a list of at least two kinds"):
        check_contenders([Contender("p", "parallel", "sliding", {"members": ["lightgbm", "cascade"]})])
    with pytest.raises(InputError, match=r"params.combine: expected one of"):
        check_contenders([Contender("p", "parallel", "sliding", {"combine": "vote"})])
    with pytest.raises(InputError, match=r"params.top_k: expected a positive number"):
        check_contenders([Contender("p", "parallel", "sliding", {"top_k": 0})])
    with pytest.raises(InputError, match=r"'c'.*params.first: expected one of"):
        check_contenders([Contender("c", "cascade", "sliding", {"first": "svm"})])


def test_auto_keeps_its_window_unless_another_beats_it_by_the_margin():
    from models.walk_forward import _choose

    scored = {"7d": (0.30, 0.2), "14d": (0.32, 0.1), "21d": None}
    windows = ["7d", "14d", "21d"]
    assert _choose(None, windows, scored, 0.05) == "14d"  # no window yet: the best
    assert _choose("7d", windows, scored, 0.05) == "7d"  # 0.02 better is within the margin
    assert _choose("7d", windows, scored, 0.01) == "14d"
    assert _choose("21d", windows, scored, 0.05) == "14d"  # the current one has no score today
    tie = {"7d": (0.3, 0.1), "14d": (0.3, 0.1)}
    assert _choose(None, ["7d", "14d"], tie, 0.0) == "7d"  # exact ties: the first listed
    assert _choose("14d", ["7d", "14d"], {"7d": None, "14d": None}, 0.0) == "14d"
    assert _choose(None, ["7d", "14d"], {"7d": None, "14d": None}, 0.0) == "14d"  # none scored: the longest


def test_auto_scores_validation_days_with_each_windows_own_walk_forward_models():
    plan = WalkForwardPlan(**{**TINY.__dict__, "candidate_windows": ("1d", "3d"), "validation_window": "1d"})
    contenders = [Contender("a", "lightgbm", "auto", FAST), Contender("d", "lightgbm", "sliding", FAST)]
    result = run_walk_forward(tiny_frame(), contenders, plan)
    # Days before the test period (horizon + validation window: 2 days) are fit per window too;
    # the 3d track inside the test period is the sliding contender's.
    # Each retrain is two fits (the model; the fit scoring its calibration slice).
    assert result.n_fits == 2 * (2 + 2) * 2 and result.n_fits_unshared == (2 * (2 + 2) + 2) * 2
    auto = [f for f in result.fits if f.contender == "a"]
    assert [f.retrain_at for f in auto] == result.retrain_times
    for f in auto:
        assert set(f.validation) == {"1d", "3d"} and all(v is not None for v in f.validation.values())
        assert f.validation[f.train_window] == max(f.validation.values())  # margin 0: the best (PR-AUC breaks ties)


# -- the negative draw: the stored (GPU, time) hash, as training draws ---------------------------


def _pool_keys(frame: pd.DataFrame, seed: int = 0) -> set[tuple[str, pd.Timestamp]]:
    from models.walk_forward import _Timeline

    timeline = _Timeline(frame, 0.3, seed)
    ts = pd.to_datetime(frame["ts"], utc=True)
    pool = timeline.frame.iloc[timeline.training_rows(None, ts.max() + pd.Timedelta(hours=1), ts.min())]
    return set(zip(pool["gpu_uuid"], pd.to_datetime(pool["ts"], utc=True), strict=True))


def test_the_walk_forward_draws_the_same_negatives_whatever_the_order_or_the_other_rows():
    frame = small_frame()
    drawn = _pool_keys(frame)
    # reordered: the same rows drawn
    assert _pool_keys(frame.sample(frac=1.0, random_state=5)) == drawn
    # filtered (half the GPUs gone): the other GPUs keep exactly their drawn rows
    kept_gpus = set(frame["gpu_uuid"].unique()[::2])
    filtered = frame[frame["gpu_uuid"].isin(kept_gpus)]
    assert _pool_keys(filtered) == {k for k in drawn if k[0] in kept_gpus}
    # and they are the rows `gpufail train` draws at the same share and seed
    from models.train import sample_negatives

    trained = sample_negatives(frame[frame["label"].notna()], 0.3, seed=0)
    assert {(g, t) for g, t in zip(trained["gpu_uuid"], pd.to_datetime(trained["ts"], utc=True), strict=True)} == drawn
    # another seed draws other negatives
    assert _pool_keys(frame, seed=1) != drawn


def test_every_calibration_method_is_fitted_on_the_slice_of_the_map_in_use():
    # What the report compares for `[model] calibration`: a plan's other methods give each test
    # row what a plan with that method would serve it, fits and slices the same.
    from dataclasses import replace

    ensemble = {"members": ["lightgbm", "logistic"], "member_params": {"lightgbm": {"n_estimators": 20}}, "top_k": 5}
    contenders = [
        Contender("lgb static", "lightgbm", "static", {"n_estimators": 20, "n_jobs": 1}),
        Contender("lr", "logistic", "sliding"),
        Contender("par", "parallel", "sliding", ensemble),
    ]
    runs = {
        method: run_walk_forward(tiny_frame(), contenders, replace(TINY, calibration=method))
        for method in ("platt", "beta")
    }
    for name in ("lgb static", "lr", "par"):
        assert set(runs["platt"].calibrated_by_method[name]) == {"beta", "isotonic"}
        assert set(runs["beta"].calibrated_by_method[name]) == {"platt", "isotonic"}
        for method, other in (("platt", "beta"), ("beta", "platt")):
            np.testing.assert_allclose(
                runs[method].calibrated_by_method[name][other], runs[other].calibrated[name], rtol=1e-9
            )
        np.testing.assert_allclose(
            runs["platt"].calibrated_by_method[name]["isotonic"],
            runs["beta"].calibrated_by_method[name]["isotonic"],
            rtol=1e-9,
        )
        assert not np.allclose(runs["platt"].calibrated[name], runs["beta"].calibrated[name])


def test_a_method_that_cannot_map_a_slice_is_left_out_unless_it_is_the_one_in_use():
    from models.train import TrainOptions, train_model
    from models.walk_forward import _fit_maps

    scorer = train_model(tiny_frame(), TrainOptions(kind="logistic", train_window="3d", horizon="12h"))
    rng = np.random.default_rng(0)
    z = rng.normal(-4.0, 1.5, 20_000)
    y = (rng.random(len(z)) < 1.0 / (1.0 + np.exp(z + 8.0))).astype(float)  # failures where the score is low
    bounds = (START, START + pd.Timedelta(days=1))
    in_use, others = _fit_maps(z, y, "platt", bounds, scorer)
    assert in_use.method == "platt" and in_use.params["slope"] < 0
    assert set(others) == {"isotonic"}  # beta refuses a falling score; the rest go on
    assert others["isotonic"].extra["scored_by_train_end"] == scorer.train_end.isoformat()
    with pytest.raises(InputError, match="beta calibration found the risk falling"):
        _fit_maps(z, y, "beta", bounds, scorer)
