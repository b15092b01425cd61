"""Bad configuration and bad command-line arguments, as an adversarial user gives them.

Every case runs through the real entry point (`gpufail.cli.main`, in this process: each
case is refused before any work starts) and must end with a non-zero exit status, no
traceback, and exactly one line on stderr that names the file, environment variable or option
and the key at fault. A traceback here is an exception escaping `main`, which fails the case.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from ingest.store import Store
from tests.cli import gpufail


@dataclass(frozen=True)
class Case:
    id: str
    args: list[str]
    expect: list[str]
    """Substrings of the one error line (the key, the file or variable, what was expected)."""
    config: bytes | str | None = None
    """Written to {tmp}/gpufail.toml and passed with --config."""
    env: dict[str, str] = field(default_factory=dict)


# A command that reads nothing but the settings before it fails on its data root: the cases
# below fail earlier, at load.
FEATURES = ["features", "--data", "{tmp}/missing-root"]


def config(text: bytes | str, *expect: str, args: list[str] = FEATURES, id: str) -> Case:
    return Case(id, args, ["gpufail.toml", *expect], config=text)


def env(name: str, value: str, *expect: str, id: str) -> Case:
    return Case(id, FEATURES, [name, *expect], env={name: value})


CONFIG_FILES = [
    config(b"\xff\xfe[labels]\nhorizon = '1h'\n", "not UTF-8 text (byte 0xff at offset 0)", id="file-not-utf8"),
    config(random.Random(7).randbytes(300), "not UTF-8 text", id="file-random-bytes"),
    config("[[[ = = =\n", "not valid TOML", id="file-garbage-text"),
    config("[labels]\nhorizon = '1h'\nhorizon = '2h'\n", "not valid TOML", id="file-duplicate-key"),
    config("[labels]\nhorizon = '1h\n", "not valid TOML", id="file-unterminated-string"),
    config("[lables]\nhorizon = '12h'\n", "[lables]: unknown table", id="unknown-table"),
    config("[labels]\nhorizn = '12h'\n", "[labels] horizn: unknown key", id="unknown-key"),
    config("grid = '1h'\n", "[grid]: unknown table", id="key-outside-any-table"),
    config("features = 5\n", "[features]", "valid dictionary", id="table-not-a-table"),
    # Durations: a unit is required, and most must be above zero.
    config(
        "[labels]\nhorizon = 12\n", "[labels] horizon", "got 12 (a number without a unit)", id="horizon-bare-number"
    ),
    config("[labels]\nhorizon = 12.5\n", "[labels] horizon", "a number without a unit", id="horizon-bare-float"),
    config("[labels]\nhorizon = '12'\n", "[labels] horizon", "expected a duration", id="horizon-string-without-unit"),
    config("[labels]\nhorizon = 'soon'\n", "[labels] horizon", "'soon'", id="horizon-words"),
    config("[labels]\nhorizon = '-1h'\n", "[labels] horizon", "'-1h'", id="horizon-negative"),
    config("[labels]\nhorizon = '0s'\n", "[labels] horizon", "above zero", id="horizon-zero"),
    config("[labels]\nhorizon = '99999999999d'\n", "[labels] horizon", "at most", id="horizon-overflows"),
    config("[labels]\nhorizon = true\n", "[labels] horizon", "expected a duration", id="horizon-boolean"),
    config("[ingest]\nxid_dedup_window = 300\n", "[ingest] xid_dedup_window", "without a unit", id="dedup-bare-number"),
    config("[publish]\ntimeout = '0s'\n", "[publish] timeout", "above zero", id="publish-timeout-zero"),
    config("[collect]\ninterval = '0s'\n", "[collect] interval", "above zero", id="collect-interval-zero"),
    config("[serve]\nreload_poll = '0m'\n", "[serve] reload_poll", "above zero", id="serve-reload-poll-zero"),
    config("[dask]\nconnect_timeout = 10\n", "[dask] connect_timeout", "without a unit", id="dask-timeout-bare"),
    # The grid, the windows and the horizon.
    config("[features]\ngrid = '0s'\n", "[features] grid", "above zero", id="grid-zero"),
    config("[features]\ngrid = '7h'\n", "[features] grid", "divides a day", id="grid-not-dividing-a-day"),
    config("[features]\ngrid = '2d'\nwindows = ['2d']\nhorizon = '2d'\n", "[features]", id="grid-longer-than-a-day"),
    config("[features]\nwindows = []\n", "[features] windows", "at least 1 item", id="windows-empty"),
    config(
        "[features]\nwindows = ['90m']\n", "[features] windows", "multiple of [features] grid", id="window-off-grid"
    ),
    config("[features]\nwindows = ['1h', '1h']\n", "[features] windows", "distinct", id="windows-repeated"),
    config("[features]\nwindows = '1h'\n", "[features] windows", "valid list", id="windows-not-a-list"),
    config("[features]\nwindows = ['1h', 6]\n", "[features] windows.1", "without a unit", id="window-bare-number"),
    Case(
        "daily-grid-default-windows",
        FEATURES,
        ["[features] windows (default)", "grid '1d' (set in config file", 'e.g. windows = ["1d", "7d"]'],
        config="[features]\ngrid = '1d'\n",
    ),
    config(
        "[features]\ngrid = '1d'\nwindows = ['1d', '7d']\n[labels]\nhorizon = '12h'\n",
        "[labels] horizon",
        'e.g. horizon = "1d"',
        id="horizon-off-a-daily-grid",
    ),
    # Numbers, enums, lists, strings.
    config("[model]\ntop_k = 0\n", "[model] top_k", "greater than 0", id="top-k-zero"),
    config("[model]\ntop_k = 'many'\n", "[model] top_k", "valid integer", id="top-k-words"),
    config("[model]\nkind = 'magic'\n", "[model] kind", "'lightgbm'", id="model-kind-unknown"),
    config("[model]\nnegative_fraction = 1.5\n", "[model] negative_fraction", "1.5", id="negative-fraction-above-1"),
    config("[model]\nnegative_fraction = nan\n", "[model] negative_fraction", "finite", id="negative-fraction-nan"),
    config("[model]\nmembers = ['lightgbm']\n", "[model] members", "at least 2", id="members-one"),
    config("[model]\nmembers = ['lightgbm', 5]\n", "[model] members.1", "got 5", id="members-number"),
    config("[model]\nthreads = -1\n", "[model] threads", "-1", id="threads-negative"),
    config("[model]\ncascade_recall = 0\n", "[model] cascade_recall", id="cascade-recall-zero"),
    config("[nightly]\nholdout_days = inf\n", "[nightly] holdout_days", "finite", id="holdout-days-inf"),
    config("[nightly]\nparams = [1]\n", "[nightly] params", "valid dictionary", id="nightly-params-list"),
    config("[simulate]\npreset = 'huge'\n", "[simulate] preset", "'demo' or 'paper'", id="preset-unknown"),
    config("[simulate]\nseed = -1\n", "[simulate] seed", "-1", id="seed-negative"),
    config("[store]\nroot = ''\n", "[store] root", "at least 1 character", id="root-empty"),
    config("[store]\nroot = 5\n", "[store] root", "valid string", id="root-number"),
    config("[ingest]\nworkers = -1\n", "[ingest] workers", id="ingest-workers-negative"),
    config("[ingest]\ncluster = ''\n", "[ingest] cluster", id="cluster-empty"),
    config("[features]\nblock_days = 0\n", "[features] block_days", id="block-days-zero"),
    config("[features]\nbuckets_in_memory = -1\n", "[features] buckets_in_memory", id="buckets-negative"),
    config("[features]\nread_ahead = 'maybe'\n", "[features] read_ahead", "valid boolean", id="read-ahead-not-bool"),
    config("[labels]\nfailure_xids = ['a']\n", "[labels] failure_xids.0", "valid integer", id="failure-xids-words"),
    config("[labels]\nfailure_xids = 48\n", "[labels] failure_xids", "valid list", id="failure-xids-not-a-list"),
    config("[evaluate]\ntop_k = ['abc']\n", "[evaluate] top_k", "got 'abc'", id="evaluate-top-k-words"),
    config("[evaluate]\ntop_k = ['inf']\n", "[evaluate] top_k", "got 'inf'", id="evaluate-top-k-inf"),
    config("[evaluate]\ntop_k = ['150%']\n", "[evaluate] top_k", "got '150%'", id="evaluate-top-k-over-100-percent"),
    config("[evaluate]\ncandidate_windows = []\n", "[evaluate] candidate_windows", id="candidate-windows-empty"),
    config("[evaluate]\ntest_days = -3\n", "[evaluate] test_days", id="test-days-negative"),
    config(
        "[[evaluate.contenders]]\nname = 'x'\nkind = 'svm'\nmode = 'static'\n",
        "[evaluate] contenders.0.kind",
        id="contender-kind-unknown",
    ),
    config(
        "[[evaluate.contenders]]\nname = 'x'\nkind = 'lightgbm'\nmode = 'weekly'\n",
        "[evaluate] contenders.0.mode",
        id="contender-mode-unknown",
    ),
    config(
        "[[evaluate.contenders]]\nname = 'x'\nkind = 'lightgbm'\nmode = 'static'\n"
        "[[evaluate.contenders]]\nname = 'x'\nkind = 'xgboost'\nmode = 'static'\n",
        "[evaluate] contenders",
        "['x'] more than once",
        id="contender-names-repeated",
    ),
    config("[publish]\ntarget = 'email'\n", "[publish] target", "'log'", id="publish-target-unknown"),
    config(
        "[publish.tiers.watch]\nenter = 0.1\nexit = 0.5\n",
        "[publish]",
        "tiers.watch",
        "exit <= enter",
        id="tier-exit-above-enter",
    ),
    config("[publish.tiers.watch]\nenter = 0.9\nexit = 0.1\n", "[publish]", "stronger tier", id="tiers-out-of-order"),
    config("[publish.tiers.avoid]\nenter = 0.4\n", "[publish] tiers.avoid.exit", "required", id="tier-without-exit"),
    config("[publish]\nbreaker_max_fraction = 2\n", "[publish] breaker_max_fraction", id="breaker-fraction-2"),
    config("[publish]\nwebhook_url = 'ftp://hooks'\n", "[publish] webhook_url", id="webhook-url-not-http"),
    config("[publish]\nwebhook_secret_env = 'my secret'\n", "[publish] webhook_secret_env", id="secret-env-bad-name"),
    config("[collect]\nsources = ['nvml', 5]\n", "[collect] sources.1", "got 5", id="collect-sources-number"),
    config("[collect]\nsources = ['smart']\n", "[collect] sources.0", "'nvml'", id="collect-source-unknown"),
    config(
        "[collect]\nkernel_log_source = 'files'\n", "[collect]", "kernel_log_paths", id="collect-files-without-paths"
    ),
    config("[collect]\nflush_rows = 0\n", "[collect] flush_rows", id="flush-rows-zero"),
    config("[collect]\ndcgm_exporter_url = 'localhost:9400'\n", "[collect] dcgm_exporter_url", id="dcgm-url-no-scheme"),
    config("[mlflow]\nport = 70000\n", "[mlflow] port", "65535", id="mlflow-port-too-high"),
    config("[mlflow]\nretries = -1\n", "[mlflow] retries", id="mlflow-retries-negative"),
    config("[mlflow]\ntracking_uri = ''\n", "[mlflow] tracking_uri", id="tracking-uri-empty"),
    config("[dask]\nscheduler = '10.0.0.5:8786'\n", "[dask] scheduler", "tcp://", id="dask-scheduler-no-scheme"),
    config("[dask]\nn_workers = 0\n", "[dask] n_workers", id="dask-workers-zero"),
    config("[serve]\nport = 0\n", "[serve] port", id="serve-port-zero"),
    config("[serve]\nmax_body_bytes = 10\n", "[serve] max_body_bytes", id="serve-body-limit-tiny"),
    config("[serve]\nadmin_token_env = '$TOKEN'\n", "[serve] admin_token_env", id="serve-token-env-bad-name"),
    config("[serve]\nmax_top_features = 100\n", "[serve] max_top_features", id="serve-top-features-100"),
    config("[serve]\nheader_timeout = '0s'\n", "[serve] header_timeout", "above zero", id="serve-header-timeout-zero"),
    config("[serve]\nbody_timeout = 30\n", "[serve] body_timeout", "without a unit", id="serve-body-timeout-bare"),
    config(
        "[labels]\nhorizon = 12\n[model]\ntop_k = 0\n", "[labels] horizon", "[model] top_k", id="two-problems-one-line"
    ),
    # Types are taken as written: a boolean is not a number, nor a word a boolean.
    config("[serve]\nport = true\n", "[serve] port", "valid integer", "got True", id="port-boolean"),
    config("[serve]\nport = '8080'\n", "[serve] port", "valid integer", "got '8080'", id="port-string"),
    config("[mlflow]\nport = 5000.0\n", "[mlflow] port", "valid integer", id="port-float"),
    config(
        "[serve]\nread_requires_token = 'off'\n",
        "[serve] read_requires_token",
        "valid boolean",
        "got 'off'",
        id="read-requires-token-word",
    ),
    config("[serve]\nread_requires_token = 1\n", "[serve] read_requires_token", "valid boolean", id="bool-number"),
    config("[publish]\ndry_run = 'no'\n", "[publish] dry_run", "valid boolean", "got 'no'", id="dry-run-word"),
    config("[publish]\nbreaker_max_nodes = true\n", "[publish] breaker_max_nodes", "valid integer", id="int-boolean"),
    config("[publish]\nattempts = 2.0\n", "[publish] attempts", "valid integer", id="attempts-float"),
]

ENVIRONMENT = [
    env("GPUFAIL_LABELS__HORIZON", "1\udcffh", "not UTF-8 text (byte 0xff at offset 1)", id="env-not-utf8"),
    env("GPUFAIL_LABELS__HORIZON", "12", "[labels] horizon", "without a unit", id="env-bare-number"),
    env("GPUFAIL_LABELS__HORIZON", "forever", "[labels] horizon", "'forever'", id="env-duration-words"),
    env("GPUFAIL_HORIZON", "12h", "expected GPUFAIL_<TABLE>__<KEY>", id="env-without-table"),
    env("GPUFAIL_LABELS__", "12h", "expected GPUFAIL_<TABLE>__<KEY>", id="env-without-key"),
    env("GPUFAIL_FOO__BAR", "1", "([foo]): unknown table", id="env-unknown-table"),
    env("GPUFAIL_LABELS__HORIZN", "12h", "([labels] horizn): unknown key", id="env-unknown-key"),
    env("GPUFAIL_COLLECT__SOURCES", '["nvml", 5]', "[collect] sources.1", "got 5", id="env-list-with-a-number"),
    env("GPUFAIL_MODEL__MONOTONE_INCREASING", "[5]", "[model] monotone_increasing.0", id="env-number-for-a-string"),
    env("GPUFAIL_LABELS__FAILURE_XIDS", "[48,", "not valid JSON", id="env-broken-json"),
    env("GPUFAIL_MODEL__TOP_K", "1e999", "[model] top_k", id="env-infinite-number"),
    env("GPUFAIL_STORE__ROOT", "", "[store] root", id="env-empty-root"),
    env("GPUFAIL_NIGHTLY__PARAMS", '{"n_estimators": 5', "not valid JSON", id="env-broken-json-table"),
    env(
        "GPUFAIL_FEATURES__GRID",
        "1d",
        "[features] windows (default)",
        "(set in environment variable",
        id="env-daily-grid",
    ),
    env("GPUFAIL_CONFIG", "{tmp}/nowhere.toml", "nowhere.toml (GPUFAIL_CONFIG): not found", id="env-config-missing"),
    env("GPUFAIL_CONFIG", "{tmp}", "is a folder", id="env-config-is-a-folder"),
    Case(
        "env-overrides-a-table-the-file-breaks",
        FEATURES,
        ["gpufail.toml", "[features] must be a table", "GPUFAIL_FEATURES__GRID"],
        config="features = 5\n",
        env={"GPUFAIL_FEATURES__GRID": "1h"},
    ),
    Case(
        "env-value-named-over-the-file",
        FEATURES,
        ["environment variable GPUFAIL_LABELS__HORIZON ([labels] horizon)", "without a unit"],
        config="[labels]\nhorizon = '12h'\n",
        env={"GPUFAIL_LABELS__HORIZON": "12"},
    ),
]

ROOT = "{tmp}/data"  # an empty data root (created for every case)

ARGUMENTS = [
    Case("config-missing", ["--config", "{tmp}/missing.toml", *FEATURES], ["missing.toml: not found"]),
    Case("config-is-a-folder", ["--config", "{tmp}", *FEATURES], ["'--config'", "is a directory"]),
    Case("unknown-command", ["sumary"], ["No such command 'sumary'"]),
    Case("unknown-option", ["features", "--overwrit"], ["gpufail features", "--overwrit"]),
    Case("simulate-preset", ["simulate", "--out", "{tmp}/x", "--preset", "huge"], ["preset 'huge'"]),
    Case("simulate-days-zero", ["simulate", "--out", "{tmp}/x", "--days", "0"], ["'--days'"]),
    Case("simulate-seed-negative", ["simulate", "--out", "{tmp}/x", "--seed", "-1"], ["'--seed'"]),
    Case("simulate-seed-words", ["simulate", "--out", "{tmp}/x", "--seed", "abc"], ["'--seed'"]),
    Case("simulate-out-missing", ["simulate"], ["'--out'"]),
    Case("kernel-log-root-missing", ["ingest", "kernel-log", "--data", "{tmp}/missing"], ["missing' does not exist"]),
    Case(
        "kernel-log-boot-time",
        ["ingest", "kernel-log", "--data", ROOT, "--boot-time", "yesterday", "{tmp}/k.log"],
        ["'--boot-time'", "'yesterday'"],
    ),
    Case("kernel-log-tz", ["ingest", "kernel-log", "--data", ROOT, "--tz", "Mars/Base", "{tmp}/k.log"], ["Mars/Base"]),
    Case("kernel-log-file-missing", ["ingest", "kernel-log", "--data", ROOT, "{tmp}/none.log"], ["none.log"]),
    Case("nvidia-smi-time", ["ingest", "nvidia-smi", "--data", ROOT, "--time", "noon", "{tmp}/k.log"], ["'--time'"]),
    Case(
        "nvidia-smi-tz",
        ["ingest", "nvidia-smi", "--data", ROOT, "--quiet", "--tz", "Mars/Base", "{tmp}/k.log"],
        ["'--tz'", "Mars/Base"],
    ),
    Case("nvidia-smi-no-files", ["ingest", "nvidia-smi", "--data", ROOT], ["'FILES...'"]),
    Case(
        "table-mapping-missing", ["ingest", "table", "--data", ROOT, "--map", "{tmp}/m.toml", "{tmp}/k.log"], ["m.toml"]
    ),
    Case("dcgm-no-sources", ["ingest", "dcgm-exporter", "--data", ROOT], ["'SOURCES...'"]),
    Case(
        "collect-interval-words", ["collect", "--data", ROOT, "--interval", "soon", "--once"], ["--interval", "'soon'"]
    ),
    Case(
        "collect-interval-bare", ["collect", "--data", ROOT, "--interval", "30", "--once"], ["--interval", "got '30'"]
    ),
    Case("collect-max-runs-zero", ["collect", "--data", ROOT, "--max-runs", "0"], ["'--max-runs'"]),
    Case("collect-option-source-unknown", ["collect", "--data", ROOT, "--source", "smart", "--once"], ["smart"]),
    Case("features-start", ["features", "--data", ROOT, "--start", "monday"], ["'--start'", "'monday'"]),
    Case("features-end", ["features", "--data", ROOT, "--end", "2026-13-01"], ["'--end'", "'2026-13-01'"]),
    Case(
        "features-end-before-start",
        ["features", "--data", ROOT, "--start", "2026-02-02", "--end", "2026-02-01"],
        ["--end 2026-02-01: expected a time after --start 2026-02-02"],
    ),
    Case("features-root-missing", ["features", "--data", "{tmp}/missing"], ["missing' does not exist"]),
    Case("features-dictionary-folder", ["features", "--dictionary", "{tmp}"], ["'--dictionary'", "is a directory"]),
    Case("train-model-out-missing", ["train", "--data", ROOT], ["'--model-out'"]),
    Case("train-empty-root", ["train", "--data", ROOT, "--model-out", "{tmp}/m"], ["features dataset is empty"]),
    Case(
        "evaluate-test-days-zero",
        ["evaluate", "--data", ROOT, "--report", "{tmp}/r", "--test-days", "0"],
        ["'--test-days'"],
    ),
    Case(
        "evaluate-test-days-nan",
        ["evaluate", "--data", ROOT, "--report", "{tmp}/r", "--test-days", "nan"],
        ["'--test-days'"],
    ),
    Case(
        "evaluate-test-days-inf",
        ["evaluate", "--data", ROOT, "--report", "{tmp}/r", "--test-days", "inf"],
        ["'--test-days'"],
    ),
    Case("score-model-missing", ["score", "--data", ROOT, "--model", "{tmp}/nomodel"], ["nomodel: not found"]),
    Case("score-model-not-a-model", ["score", "--data", ROOT, "--model", "{tmp}"], ["expected a folder written by"]),
    Case("publish-target", ["publish", "--data", ROOT, "--to", "email"], ["'--to'", "'email'"]),
    Case("publish-root-missing", ["publish", "--data", "{tmp}/missing"], ["missing' does not exist"]),
    Case("summary-report-missing", ["summary", "--data", ROOT, "--report", "{tmp}/r"], ["metrics.json: not found"]),
    Case("mlflow-port-zero", ["mlflow", "--port", "0"], ["'--port'"]),
    Case("nightly-root-missing", ["nightly", "--data", "{tmp}/missing"], ["missing' does not exist"]),
    Case("serve-port", ["serve", "--data", ROOT, "--port", "70000"], ["'--port'"]),
]

CASES = CONFIG_FILES + ENVIRONMENT + ARGUMENTS


def test_there_are_many_distinct_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 100


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_is_refused_in_one_line_naming_it(case, tmp_path):
    Store.create(str(tmp_path / "data"))
    (tmp_path / "k.log").write_text("")
    tmp = str(tmp_path)
    env = {name: value.replace("{tmp}", tmp) for name, value in case.env.items()}
    args = [a.replace("{tmp}", tmp) for a in case.args]
    if case.config is not None:
        path = tmp_path / "gpufail.toml"
        (path.write_bytes if isinstance(case.config, bytes) else path.write_text)(case.config)
        args = ["--config", str(path), *args]

    ran = gpufail(*args, env=env)
    code, err = ran.returncode, ran.stderr

    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, err
    assert len(lines) == 1, err
    assert lines[0].startswith("gpufail: error: "), err
    for text in case.expect:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    assert not (tmp_path / "x").exists() and not (tmp_path / "missing-root").exists()
