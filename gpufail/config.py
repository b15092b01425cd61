"""Configuration: one TOML file with a table per stage, overridable by environment variables.

Precedence, highest first: environment (`GPUFAIL_<TABLE>__<KEY>`, e.g.
`GPUFAIL_LABELS__HORIZON=12h`), the TOML file (the first of `--config`, `$GPUFAIL_CONFIG`,
`./gpufail.toml`, `/etc/gpufail/gpufail.toml`: `find_config`), the defaults below.
`gpufail.example.toml` at the repository root documents every key; a test keeps it identical
to these defaults.

Settings are read once, in the CLI, and passed down as plain values:
nothing here runs at import time, and no other package imports this module. `Settings` turns
its tables into the option objects the packages take (`feature_spec`, `build_options`,
`train_options`, `walk_forward_plan`, `publish_options`, `serve_options`, `nightly_options`, ...), so that the
commands and the nightly job never copy settings into them by hand.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Collection, Mapping
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from features.durations import DURATION_EXAMPLES, format_duration, parse_duration
from features.spec import (
    DEFAULT_FAIL_SLOW_WINDOW,
    DEFAULT_GRID,
    DEFAULT_HORIZON,
    DEFAULT_LOST_AFTER,
    DEFAULT_MAX_SILENCE,
    DEFAULT_MERGE_WINDOW,
    DEFAULT_WINDOWS,
    FeatureSpec,
    default_failure_xids,
    inconsistencies,
)
from ingest.errors import ConfigError

if TYPE_CHECKING:
    from features.runner import BuildOptions
    from gpufail.nightly import NightlyOptions
    from ingest.collect.daemon import CollectOptions
    from ingest.schema import Metric
    from models.alarms import AlarmRules
    from models.train import TrainOptions
    from models.walk_forward import WalkForwardPlan
    from serving.api_state import ServeOptions
    from serving.policy import PolicyConfig
    from serving.publish import JobActions
    from serving.publishing import PublisherConfig, PublishOptions


def _positive(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise ValueError(f"expected a duration above zero such as {DURATION_EXAMPLES}, got '{format_duration(value)}'")
    return value


Duration = Annotated[timedelta, BeforeValidator(parse_duration)]
"""A duration that may be zero (where zero means "none", e.g. no cooldown)."""
PositiveDuration = Annotated[timedelta, BeforeValidator(parse_duration), AfterValidator(_positive)]

_ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
EnvName = Annotated[str, Field(pattern=f"^{_ENV_NAME}$")]
"""The name of an environment variable (that holds a secret)."""
HttpUrl = Annotated[str, Field(pattern=r"^https?://\S+$")]
NonEmpty = Annotated[str, Field(min_length=1)]


class _Table(BaseModel):
    # A misspelt key must fail loudly rather than silently fall back to a default.
    # NaN and infinity are refused too: `holdout_days = inf` ended in an OverflowError.
    # Strict types: `port = true` is not port 1, nor `read_requires_token = "off"` false (an
    # integer may still stand for a float).
    # A table's validator is built when the table is first validated (`defer_build`), not at
    # import: a command that loads a few tables (`load_settings(tables=...)`) builds only theirs.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True, defer_build=True)


_T = TypeVar("_T", bound=_Table)


def _default(table: type[_T]) -> Any:
    """A table's default: its default values, made without validating them (they are the
    class's own; `gpufail.example.toml` holds the same and a test loads it), so that a table
    nobody set builds no validator."""
    return Field(default_factory=lambda: table.model_construct())


_METRIC_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class MetricSettings(_Table):
    """One metric of the user's (`[metrics.<name>]`): a telemetry column gpufail does not
    collect itself, stored, imported and turned into window features by its kind like its own
    (`ingest.user_metrics`)."""

    kind: Literal["gauge", "counter", "flag", "bitmask"]
    """gauge: a level (mean/std/min/max/slope over windows); counter: a cumulative count (its
    increases); flag: 0/1 (whether it was set); bitmask: bits (how often each changed)."""
    unit: NonEmpty
    min: float | None = None
    """Smallest valid reading; an import counts a smaller one and stores it as missing."""
    max: float | None = None
    """Largest valid reading (likewise)."""
    description: str = ""
    dcgm_field: str | None = Field(default=None, pattern=r"^DCGM_FI_[A-Z0-9_]+$")
    """The dcgm-exporter field (`DCGM_FI_PROF_SM_ACTIVE`) `gpufail ingest dcgm-exporter` stores in it."""

    @model_validator(mode="after")
    def _range(self) -> MetricSettings:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min:g} is above max {self.max:g}; expected min <= max")
        return self


def _metric_names(value: dict[str, MetricSettings]) -> dict[str, MetricSettings]:
    from ingest.schema import TELEMETRY_ID_FIELDS, builtin_metrics

    ours = {m.column for m in builtin_metrics()} | {f.name for f in TELEMETRY_ID_FIELDS}
    for name in value:
        if not _METRIC_NAME.match(name):
            raise ValueError(
                f"expected a metric name of lower-case letters, digits and _ (a column name), got {name!r}"
            )
        if name in ours:
            raise ValueError(f"expected a name that is not gpufail's own column (ingest/metrics.csv), got {name!r}")
    return value


class StoreSettings(_Table):
    root: NonEmpty = "data"
    """Data root: a local folder or an fsspec URL (s3://bucket/prefix)."""
    compact_settle: Duration = timedelta(hours=6)
    """`gpufail compact` (and the nightly's compact step) leaves a day alone until this long
    after its end: collectors may still be writing to it."""


class SimulateSettings(_Table):
    preset: Literal["demo", "paper"] = "demo"
    seed: int = Field(default=7, ge=0)


_PROMETHEUS_IDENTITY = ("node", "gpu_uuid", "gpu_index", "pci_bus_id", "gpu_model", "driver", "cluster")


def _identity_labels(value: dict[str, str]) -> dict[str, str]:
    unknown = sorted(set(value) - set(_PROMETHEUS_IDENTITY))
    if unknown:
        raise ValueError(f"expected keys among {', '.join(_PROMETHEUS_IDENTITY)}, got {', '.join(unknown)}")
    return value


class PrometheusSettings(_Table):
    """`gpufail ingest prometheus` and `gpufail collect --source prometheus`: dcgm-exporter
    series from a Prometheus HTTP API (Prometheus, Thanos, Mimir, VictoriaMetrics). Credentials
    come from the environment: GPUFAIL_PROMETHEUS_TOKEN, or GPUFAIL_PROMETHEUS_USER and
    GPUFAIL_PROMETHEUS_PASSWORD."""

    url: Annotated[str, Field(pattern=r"^(https?://\S+)?$")] = ""
    """The server, e.g. http://prometheus:9090; "" means --url must be given."""
    match: str = ""
    """A series selector narrowing what is read, e.g. {cluster="a"}; "" reads every DCGM series."""
    labels: Annotated[dict[str, NonEmpty], AfterValidator(_identity_labels)] = Field(default_factory=dict)
    """gpufail's identity column -> the label holding it, where it is not dcgm-exporter's
    (node = Hostname, gpu_uuid = UUID, gpu_index = gpu, pci_bus_id, gpu_model = modelName,
    driver = DCGM_FI_DRIVER_VERSION; cluster: none, [ingest] cluster), e.g. node = "kubernetes_node"."""
    concurrency: int = Field(default=4, ge=1)
    """Queries in flight at once."""
    timeout: PositiveDuration = timedelta(seconds=60)
    """How long one query may take before it is retried."""
    retries: int = Field(default=3, ge=0)
    """Tries after the first for a query that timed out or got a 5xx answer."""
    ca_file: str = ""
    """PEM certificates to trust for an https URL; "" uses the system's."""


class IngestSettings(_Table):
    cluster: NonEmpty = "default"
    """Cluster name written into every row, so several clusters can share a data root."""
    xid_dedup_window: Duration = timedelta(minutes=5)
    """Identical XIDs on one GPU within this window are one incident with a repeat count."""
    workers: int = Field(default=0, ge=0)
    """Processes parsing kernel-log files at once (`gpufail ingest kernel-log`); 0: one per core."""
    prometheus: PrometheusSettings = _default(PrometheusSettings)


class FeatureSettings(_Table):
    # The defaults of the settings that shape features are the FeatureSpec's (features.spec).
    grid: PositiveDuration = DEFAULT_GRID
    windows: list[PositiveDuration] = Field(default_factory=lambda: list(DEFAULT_WINDOWS), min_length=1)
    max_silence: Duration = DEFAULT_MAX_SILENCE
    """A GPU keeps getting rows this long after its last sample (silence is a signal)."""
    fail_slow: bool = True
    """Compute the fail-slow features (a GPU's sustained deficit against its peers) over
    `fail_slow_window`, one of `windows`: what the evaluation and the policy's fail_slow alarm
    class use."""
    fail_slow_window: PositiveDuration = DEFAULT_FAIL_SLOW_WINDOW
    buckets_in_memory: int = Field(default=4_000_000, ge=0)
    """Hourly (grid) buckets the build holds for one shard of whole nodes: bounds its memory."""
    block_days: int = Field(default=14, ge=1)
    """Days whose features are built together: the 7-day lookback before them is computed once per block."""
    rows_per_part: int = Field(default=500_000, ge=1)
    """Grid rows of whole GPUs whose wide bucket statistics the build holds at once: bounds its memory."""
    workers: int = Field(default=1, ge=1)
    """Shards of a block built at once (each holds up to buckets_in_memory / workers buckets)."""
    read_ahead: bool = True
    """Read and aggregate the next block's days while a block is built: faster, ~3 GB more at the paper's scale."""
    write_ahead: bool = True
    """Write a block's finished rows on a thread of their own while the next rows are computed: faster, ~0.5 GB more."""


class LabelSettings(_Table):
    horizon: PositiveDuration = DEFAULT_HORIZON
    """Label at grid time t: does the GPU fail in (t, t + horizon]?"""
    failure_xids: list[int] = Field(default_factory=lambda: list(default_failure_xids()))
    merge_window: Duration = DEFAULT_MERGE_WINDOW
    """Failure events on one GPU closer than this are one failure episode."""
    lost_after: PositiveDuration = DEFAULT_LOST_AFTER
    """A GPU silent this long while its node keeps reporting is lost (a failure)."""


SingleKind = Literal["lightgbm", "xgboost", "logistic", "random_forest", "mlp"]
ModelKind = Literal["lightgbm", "xgboost", "logistic", "random_forest", "mlp", "parallel", "cascade"]
_DEFAULT_MEMBERS: list[SingleKind] = ["lightgbm", "xgboost", "logistic"]


class ModelSettings(_Table):
    kind: ModelKind = "lightgbm"
    params: dict[str, Any] = Field(default_factory=dict)
    """The model's parameters on top of its kind's defaults (`models/kinds.py` DEFAULT_PARAMS,
    e.g. n_estimators, learning_rate, num_leaves for lightgbm; ENSEMBLE_DEFAULTS for parallel
    and cascade), as `gpufail train` and `nightly` fit it; they win over the keys below."""
    train_window: PositiveDuration = timedelta(days=21)
    top_k: int = Field(default=10, gt=0)
    """Precision is reported over the K highest-risk GPUs at each grid time."""
    threads: int = Field(default=1, ge=1)
    """Threads for LightGBM/XGBoost. More are faster only on an otherwise idle machine: on a
    2-core machine with other load, 2 OpenMP threads trained 4x slower per tree than 1."""
    negative_fraction: float = Field(default=0.1, gt=0.0, le=1.0)
    """Share of the healthy rows a fit keeps (every failing row is kept); the odds are corrected."""
    max_negatives_per_positive: float = Field(default=20.0, gt=0.0)
    """...but at most this many healthy rows per failing row (`train` and `nightly`; a large
    number: no cap; `models.train.capped_negative_fraction`). On the paper fleet's 21-day
    window 10% of the healthy rows is ~70 per failing row; scored on the 3 days after it
    (`python -m benchmarks.negative_caps`), 20 kept the hourly precision of the top 30 (0.552 against
    0.526 at 10%), lost ~0.02 of average precision (0.218 against 0.237, about one draw's
    noise) and retrained 2.6x faster. The demo's walk-forward evaluation draws ~15 per failing
    row (`[evaluate] negative_fraction` 0.05)."""
    monotone_increasing: list[str] = Field(
        default_factory=lambda: ["ecc_dbe_*_increase_*", "remapped_rows_*_increase_*"]
    )
    """Features (names or globs) whose rise must never lower a GPU's risk: a new double-bit ECC
    error or remapped row is never good news. Constrains LightGBM, XGBoost, the random forest,
    logistic regression and ensembles of them; the MLP cannot be constrained (set [] for it)."""
    members: list[SingleKind] = Field(default_factory=lambda: list(_DEFAULT_MEMBERS), min_length=2)
    """kind = "parallel": the member models, each ranking every GPU."""
    combine: Literal["top_k_intersection", "rank_average"] = "top_k_intersection"
    """kind = "parallel": GPUs in every member's top_k first, or the mean rank alone."""
    cascade_first: SingleKind = "logistic"
    """kind = "cascade": the model that keeps the GPUs worth a second look."""
    cascade_first_params: dict[str, Any] = Field(default_factory=dict)
    """kind = "cascade": the first stage's parameters on top of its kind's defaults (the
    walk-forward's "cascade sliding" contender uses a small LightGBM: cascade_first = "lightgbm"
    with {n_estimators = 20, num_leaves = 7})."""
    cascade_second: SingleKind = "lightgbm"
    """kind = "cascade": the model that ranks the kept GPUs."""
    cascade_second_params: dict[str, Any] = Field(default_factory=dict)
    """kind = "cascade": the second stage's parameters on top of its kind's defaults."""
    cascade_recall: float = Field(default=0.95, gt=0.0, le=1.0)
    """kind = "cascade": share of the failures the first stage must keep (out of fold)."""
    calibration: Literal["platt", "beta", "isotonic"] = "platt"
    """How the served risk is calibrated (models/calibration.py), on the calibration_window of
    labels at the end of the training window, as scored by a fit made as of its start."""
    calibration_window: PositiveDuration = timedelta(days=7)


class TierSettings(_Table):
    enter: float = Field(ge=0.0, le=1.0)
    """A node enters the tier when its (calibrated) risk reaches this."""
    exit: float = Field(ge=0.0, le=1.0)
    """It leaves when its risk has stayed below this for [publish] recovery_period."""
    budget_per_day: float | None = Field(default=None, gt=0.0)
    """Set: an alarm budget instead of a threshold alone, at most this many nodes entering the
    tier per day (riskiest first); enter is then the least risk that may enter at all."""


class TiersSettings(_Table):
    """Risk tiers, weakest first; set one to `false` in TOML (null in JSON) to switch it off."""

    watch: TierSettings | None = TierSettings.model_construct(enter=0.2, exit=0.1)
    avoid: TierSettings | None = TierSettings.model_construct(enter=0.35, exit=0.25)
    drain_after_job: TierSettings | None = TierSettings.model_construct(enter=0.5, exit=0.35)
    drain_now: TierSettings | None = TierSettings.model_construct(enter=0.8, exit=0.6)

    @field_validator("*", mode="before")
    @classmethod
    def _false_is_off(cls, value: Any) -> Any:
        return None if value is False else value


_DEFAULT_TIERS = TiersSettings.model_construct()


class CostSettings(_Table):
    """[publish.cost]: what the cost policy prices actions with (serving/cost_policy.py,
    docs/actions.md); GPU-hours throughout."""

    horizon: PositiveDuration = timedelta(hours=24)
    """The horizon of the node risk: the [labels] horizon the model was trained with."""
    checkpoint_interval: PositiveDuration = timedelta(hours=1)
    """How often the jobs checkpoint: assumed for a job that reports no checkpoint, and the interval of
    one that reports only when it checkpointed; also the least time between two hints to a job."""
    checkpoint_time: Duration = timedelta(minutes=5)
    restart_time: Duration = timedelta(minutes=10)
    hang_time: Duration = timedelta(minutes=15)
    """How long a job hangs on a failed node before the failure is noticed."""
    new_job_gpus: float = Field(default=64.0, ge=0.0)
    """The GPUs of a job the scheduler would place on a free node."""
    avoid_share: float = Field(default=0.25, ge=0.0, le=1.0)
    avoid_cost: float = Field(default=0.5, ge=0.0)
    """GPU-hours per node GPU that keeping new large jobs off a node costs over the horizon."""
    false_drain: Duration = timedelta(hours=24)
    """How long a node drained for nothing stays out of service."""


class PublishSettings(_Table):
    """`gpufail publish`: the action policy (serving/policy.py) and the scheduler publishers."""

    target: Literal["log", "slurm", "kubernetes", "webhook"] = "log"
    policy: Literal["tiers", "cost"] = "tiers"
    """tiers: risk thresholds; cost: the cheapest action for the jobs on the node (docs/actions.md)."""
    cost: CostSettings = _default(CostSettings)
    placement_levels: int = Field(default=0, ge=0, le=100)
    """Risk levels for placement hints (Slurm weights, a Kubernetes node label); 0: none."""
    standby_nodes: int = Field(default=0, ge=0)
    """Warm standbys: the lowest-risk idle nodes kept in a reservation (Slurm) or labelled; 0: none."""
    jobs_url: str = ""
    """log and webhook targets: a URL or file of the job document (docs/actions.md); empty: none."""
    cluster: Annotated[str, Field(pattern=r"^([A-Za-z0-9][A-Za-z0-9_.-]*)?$")] = ""
    """slurm and kubernetes targets: the cluster (the [ingest] cluster of its rows) whose nodes they act on; empty:
    the predictions must hold one cluster."""
    slurm_checkpoint_signal: Annotated[str, Field(pattern=r"^(SIG)?[A-Z][A-Z0-9]*$|^[0-9]+$")] = "USR1"
    """The signal of a checkpoint hint (scancel --signal=... --batch JOB)."""
    slurm_standby_users: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*$")]] = Field(
        default_factory=lambda: ["root"], min_length=1
    )
    """Users who may run jobs in the standby reservation."""
    dry_run: bool = True
    """Record what would be done without doing it. Set false (or --no-dry-run) to act."""
    shadow: bool = False
    """With dry_run false: run the policy with its own state and record, but touch nothing."""
    tiers: TiersSettings = _default(TiersSettings)
    recovery_period: Duration = timedelta(hours=24)
    """A node leaves its tier after its risk stayed below the tier's exit threshold this long."""
    cooldown: Duration = timedelta(hours=6)
    """A node is not raised again within this of its last change (except to drain_now)."""
    breaker_max_nodes: int = Field(default=2, ge=0)
    breaker_max_fraction: float = Field(default=0.05, ge=0.0, le=1.0)
    """Circuit breaker: at most the larger of breaker_max_nodes and this share of the fleet
    raised to avoid or above within breaker_window; then it trips until --reset-breaker."""
    breaker_window: PositiveDuration = timedelta(hours=24)
    fail_slow: bool = True
    """The fail_slow alarm class (docs/actions.md): a node with a straggler GPU is put in the
    avoid tier through the same rules (breaker, cooldown, recovery, audit); false: not acted on."""
    fail_slow_threshold: float = Field(default=0.05, gt=0.0, lt=1.0)
    """A straggler: a GPU whose fail-slow score (its sustained deficit against its node and model
    peers; 0.05 = 5% slower) reaches this."""
    attempts: int = Field(default=3, ge=1)
    """Tries per scheduler call (with exponential back-off from `backoff`)."""
    backoff: Duration = timedelta(seconds=2)
    timeout: PositiveDuration = timedelta(seconds=30)
    slurm_bin_dir: str = ""
    """Folder of sinfo/scontrol; empty: PATH."""
    slurm_conf: str = ""
    """SLURM_CONF for sinfo/scontrol; empty: Slurm's default."""
    slurm_avoid_weight: int = Field(default=100_000, ge=1)
    """Slurm node weight for the avoid tier (Slurm fills lower weights first)."""
    kubeconfig: str = ""
    """Empty: the in-cluster service account, else ~/.kube/config."""
    webhook_url: Literal[""] | HttpUrl = ""
    webhook_secret_env: EnvName = "GPUFAIL_WEBHOOK_SECRET"
    """Environment variable holding the webhook's HMAC-SHA256 secret (never the config file)."""

    @model_validator(mode="after")
    def _policy_rules(self) -> PublishSettings:
        # The policy owns its rules (serving.policy.PolicyConfig); the defaults keep them, so
        # numpy is imported at load only when the tiers or the breaker were changed.
        if (self.tiers, self.breaker_max_nodes, self.breaker_max_fraction) != (_DEFAULT_TIERS, 2, 0.05):
            from ingest.errors import InputError

            try:
                self.policy_config()
            except InputError as exc:
                raise ValueError(str(exc)) from None
        return self

    def policy_config(self) -> PolicyConfig:
        """The action policy of these settings (`serving.policy`)."""
        from serving.policy import PolicyConfig, Tier

        configured = {name: getattr(self.tiers, name) for name in type(self.tiers).model_fields}
        return PolicyConfig(
            tiers=tuple(
                Tier(name, t.enter, t.exit, t.budget_per_day) for name, t in configured.items() if t is not None
            ),
            recovery_period=self.recovery_period,
            cooldown=self.cooldown,
            breaker_max_nodes=self.breaker_max_nodes,
            breaker_max_fraction=self.breaker_max_fraction,
            breaker_window=self.breaker_window,
            fail_slow_threshold=self.fail_slow_threshold if self.fail_slow else None,
        )

    def publisher_config(self) -> PublisherConfig:
        """How the publishers reach their schedulers (`serving.publishing`)."""
        from serving.publishing import PublisherConfig

        return PublisherConfig(
            attempts=self.attempts,
            backoff_s=self.backoff.total_seconds(),
            timeout_s=self.timeout.total_seconds(),
            slurm_bin_dir=self.slurm_bin_dir,
            slurm_conf=self.slurm_conf,
            slurm_avoid_weight=self.slurm_avoid_weight,
            slurm_checkpoint_signal=self.slurm_checkpoint_signal,
            slurm_standby_users=tuple(self.slurm_standby_users),
            kubeconfig=self.kubeconfig,
            webhook_url=self.webhook_url,
            webhook_secret_env=self.webhook_secret_env,
            jobs_url=self.jobs_url,
            cluster=self.cluster,
        )

    def job_actions(self) -> JobActions:
        """What a run does with the jobs on the nodes beyond the tiers (`serving.publish`): the
        policy, the cost policy's prices, placement levels and warm standbys."""
        from serving.cost_policy import CostConfig
        from serving.publish import JobActions

        c = self.cost
        return JobActions(
            policy=self.policy,
            cost=CostConfig(
                horizon=c.horizon,
                checkpoint_interval=c.checkpoint_interval,
                checkpoint_time=c.checkpoint_time,
                restart_time=c.restart_time,
                hang_time=c.hang_time,
                new_job_gpus=c.new_job_gpus,
                avoid_share=c.avoid_share,
                avoid_cost=c.avoid_cost,
                false_drain=c.false_drain,
            ),
            placement_levels=self.placement_levels,
            standby_nodes=self.standby_nodes,
        )

    def options(
        self, *, target: str | None = None, dry_run: bool | None = None, shadow: bool | None = None
    ) -> PublishOptions:
        """A publish run of these settings; `target`, `dry_run` and `shadow` override theirs."""
        from serving.publishing import PublishOptions, publish_mode

        dry = self.dry_run if dry_run is None else dry_run
        return PublishOptions(
            target=target or self.target,
            mode=publish_mode(dry, self.shadow if shadow is None else shadow),
            policy=self.policy_config(),
            publisher=self.publisher_config(),
            actions=self.job_actions(),
        )


class CollectSettings(_Table):
    """`gpufail collect`, the live collector daemon on each GPU node."""

    interval: PositiveDuration = timedelta(seconds=30)
    """Every collector is called once per interval."""
    sources: list[Literal["nvml", "kernel-log", "dcgm-exporter", "prometheus"]] = Field(
        default_factory=lambda: ["nvml", "kernel-log"]  # type: ignore[arg-type]
    )
    flush_rows: int = Field(default=50_000, ge=1)
    """Buffered rows are written when the buffer holds this many rows (a kill loses at most
    these), or when flush_interval has passed, or when the daemon stops."""
    flush_interval: PositiveDuration = timedelta(minutes=5)
    dcgm_exporter_url: HttpUrl = "http://localhost:9400/metrics"
    kernel_log_source: Literal["kmsg", "journal", "files"] = "kmsg"
    kernel_log_paths: list[str] = Field(default_factory=list)
    """Log files to follow when kernel_log_source = "files" (e.g. /var/log/kern.log)."""
    max_lines_per_run: int = Field(default=200_000, ge=1)
    """Kernel-log lines read per interval at most; a larger backlog is read over later ones."""
    node: str = ""
    """Node name written into every row; empty means this machine's hostname."""
    listen: str = "127.0.0.1:9410"
    """host:port of the daemon's /metrics, /healthz and /readyz; "" serves none."""

    @model_validator(mode="after")
    def _paths_for_files(self) -> CollectSettings:
        if self.kernel_log_source == "files" and not self.kernel_log_paths and "kernel-log" in self.sources:
            raise ValueError(
                'kernel_log_source = "files" needs kernel_log_paths, e.g. kernel_log_paths = ["/var/log/kern.log"]'
            )
        return self


class ContenderSettings(_Table):
    """One configuration of the walk-forward comparison (`gpufail evaluate`)."""

    name: str = Field(min_length=1)
    kind: ModelKind
    """A model kind of `train_model`: lightgbm, xgboost, logistic, and those added since."""
    mode: Literal["static", "sliding", "auto"]
    """static: trained once; sliding: retrained on `train_window`; auto: window chosen on validation."""
    train_window: PositiveDuration | None = None
    """static and sliding: overrides [evaluate] train_window."""
    params: dict[str, Any] = Field(default_factory=dict)


def _default_contenders() -> list[ContenderSettings]:
    # The class's own defaults, not validated (like `_default`'s).
    contender = ContenderSettings.model_construct
    # 100 trees instead of 200: ~2 s per fit on the demo, so ~100 daily fits fit the budget.
    trees = {"n_estimators": 100}
    singles: list[tuple[ModelKind, dict[str, Any]]] = [("lightgbm", trees), ("xgboost", trees), ("logistic", {})]
    out = [contender(name=f"{k} {m}", kind=k, mode=m, params=p) for m in ("static", "sliding") for k, p in singles]
    # The paper's ensembles, retrained daily. The parallel one's members are the single sliding
    # contenders' fits (the walk-forward makes each fit once); the cascade's first stage is a
    # small LightGBM (20 trees of 7 leaves), cheap next to its second.
    ensembles = [
        contender(
            name="parallel sliding",
            kind="parallel",
            mode="sliding",
            params={"members": [k for k, _ in singles], "combine": "top_k_intersection", "top_k": 10},
        ),
        contender(
            name="cascade sliding",
            kind="cascade",
            mode="sliding",
            params={
                "first": "lightgbm",
                "second": "lightgbm",
                "first_params": {"n_estimators": 20, "num_leaves": 7},
                "target_recall": 0.95,
            },
        ),
    ]
    return [*out, *ensembles, contender(name="lightgbm auto", kind="lightgbm", mode="auto", params=trees)]


class EvaluateSettings(_Table):
    test_days: float = Field(default=14.0, gt=0)
    """The walk-forward test period: the last test_days of settled labels."""
    retrain_every: PositiveDuration = timedelta(days=1)
    train_window: PositiveDuration = timedelta(days=21)
    """Training window of the static and sliding contenders (unless they set their own)."""
    candidate_windows: list[PositiveDuration] = Field(
        default_factory=lambda: [timedelta(days=d) for d in (7, 14, 21)], min_length=1
    )
    """Training windows the auto contenders choose from before each retrain."""
    validation_window: PositiveDuration = timedelta(days=7)
    """The auto choice is made on the most recent validation_window of settled labels (on the
    demo, 3 days switched windows 5 times in 14 retrains, 7 days once)."""
    switch_margin: float = Field(default=0.01, ge=0.0, le=1.0)
    """auto: leave the current window only for one better on validation by more than this
    (precision@K, absolute)."""
    top_k: list[str] = Field(default_factory=lambda: ["10", "expected"], min_length=1)
    """K as a count ("10"), a share of the fleet ("1%") or "expected" (failures per day); the first is the headline."""
    negative_fraction: float = Field(default=0.05, gt=0.0, le=1.0)
    """Share of the healthy rows each walk-forward fit trains on (every failing row is kept)."""
    bootstrap_samples: int = Field(default=1000, ge=0)
    seed: int = Field(default=0, ge=0)
    jobs: int = Field(default=2, ge=1)
    """Processes that run the fits (each fit uses one thread)."""
    alarm_budgets: list[Annotated[float, Field(gt=0.0)]] = Field(
        default_factory=lambda: [0.5, 1.0, 2.0, 5.0], min_length=1
    )
    """Operating points, in alarms per 1,000 GPUs per day: a daily quota on the test period (every
    scorer at the same volume) and a threshold chosen on the validation slice before it
    (models/alarms.py)."""
    long_horizon: PositiveDuration = timedelta(hours=72)
    """The second window an alarm and a failure are judged in, beside the label horizon: an
    alarm is right when its GPU fails within it; a failure is caught when its GPU alarmed within
    it before (models/alarms.py)."""
    seeds: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """Run the comparison under each of these seeds and report mean and range (empty: seed alone)."""
    contenders: list[ContenderSettings] = Field(default_factory=_default_contenders, min_length=1)

    @field_validator("top_k")
    @classmethod
    def _k(cls, value: list[str]) -> list[str]:
        from ingest.errors import InputError
        from models.top_k import parse_top_k

        for spec in value:
            try:
                parse_top_k(spec)
            except InputError as exc:
                expected = str(exc).split(": ", 1)[-1]
                raise ValueError(f"{expected}, got {spec!r}") from None
        return value

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, value: list[int]) -> list[int]:
        repeated = sorted({s for s in value if value.count(s) > 1})
        if repeated:
            raise ValueError(f"expected each seed once, got {repeated} more than once")
        return value

    @field_validator("contenders")
    @classmethod
    def _distinct_names(cls, value: list[ContenderSettings]) -> list[ContenderSettings]:
        names = [c.name for c in value]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"expected each contender name once, got {repeated} more than once")
        return value


class MlflowSettings(_Table):
    """The model registry (`gpufail mlflow` runs the embedded server)."""

    tracking_uri: NonEmpty = "http://127.0.0.1:5000"
    """Tracking and registry server; the default is the embedded one `gpufail mlflow` starts."""
    model_name: NonEmpty = "gpufail"
    """The registered model; aliases `champion` (serving) and `challenger` (newest candidate)."""
    experiment: NonEmpty = "gpufail-nightly"
    home: NonEmpty = "mlruns"
    """Embedded server: folder of its SQLite database (mlflow.db) and artifacts."""
    host: NonEmpty = "127.0.0.1"
    port: int = Field(default=5000, ge=1, le=65535)
    retries: int = Field(default=3, ge=0)
    """Attempts after the first while the server is unreachable, with doubling waits."""
    backoff: Duration = timedelta(seconds=2)
    """Wait before the first retry."""


class NightlySettings(_Table):
    """`gpufail nightly`: retrain, gate, score and publish once a day."""

    holdout_days: float = Field(default=3.0, gt=0)
    """The most recent held-out window (settled labels) both models are judged on."""
    promotion_margin: float = Field(default=0.01, ge=0.0)
    """The challenger must beat the champion's precision@K by at least this (absolute)."""
    recall_tolerance: float = Field(default=0.05, ge=0.0)
    """...and may lose at most this much episode recall (absolute)."""
    precision_floor: float = Field(default=0.02, ge=0.0, le=1.0)
    """With no champion yet, the first model is promoted only at or above this precision@K."""
    negative_fraction: float = Field(default=0.1, gt=0.0, le=1.0)
    """Share of the healthy rows the nightly fit trains on (every failing row is kept)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Model parameters for the nightly fit (e.g. n_estimators), on top of the kind's defaults."""
    work_dir: str = ""
    """Local folder for the lock, the trained model before it is logged, the report and the
    champion cache; empty means DATA/_nightly (a local data root is required then)."""


_SCHEDULER = re.compile(r"(tcp|tls|ucx|inproc)://\S+")


class DaskSettings(_Table):
    """Run `gpufail features`, `gpufail train` and the walk-forward of `gpufail evaluate` on Dask
    (docs/fleet-scale.md)."""

    scheduler: str = ""
    """Empty: one machine, no Dask. "local": a LocalCluster on 127.0.0.1. Else a running
    scheduler's address, such as "tcp://10.0.0.5:8786"."""
    n_workers: int = Field(default=2, ge=1)
    threads_per_worker: int = Field(default=1, ge=1)
    """scheduler = "local": worker processes, and threads in each."""
    connect_timeout: PositiveDuration = timedelta(seconds=10)
    partition_nodes: int = Field(default=64, ge=1)
    """Feature build: nodes per partition (whole nodes, so the node peer features are exact)."""
    partition_days: int = Field(default=14, ge=1)
    """Feature build: days per time partition; each also reads the ~8 days of lookback its
    windows need, so longer partitions read less twice but hold more in a worker."""

    @field_validator("scheduler")
    @classmethod
    def _address(cls, value: str) -> str:
        if value not in ("", "local") and not _SCHEDULER.fullmatch(value):
            raise ValueError(
                f"expected '' (one machine), 'local' (a LocalCluster) or a scheduler address such as "
                f"'tcp://10.0.0.5:8786', got {value!r}"
            )
        return value


class ServeSettings(_Table):
    """`gpufail serve`: the prediction REST endpoint (serving/api.py)."""

    host: NonEmpty = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    model: str = ""
    """Empty: the [mlflow] model_name's `champion` alias in the registry; else a model folder
    written by `gpufail train` (`--model` overrides)."""
    admin_token_env: EnvName = "GPUFAIL_SERVE_ADMIN_TOKEN"
    """Environment variable holding the bearer token of the admin endpoints (never the config
    file); without one, admin endpoints refuse every request."""
    read_token_env: EnvName = "GPUFAIL_SERVE_READ_TOKEN"
    """Environment variable holding the bearer token of the read endpoints (the admin token is
    accepted too), used when read_requires_token is true."""
    read_requires_token: bool = False
    max_body_bytes: int = Field(default=2_000_000, ge=1024)
    """Larger request bodies are refused (413) before they are parsed."""
    max_gpus_per_request: int = Field(default=2000, ge=1)
    max_top_features: int = Field(default=10, ge=0, le=50)
    """Explanations kept per GPU; a request asks for at most this many (`top_features`)."""
    reload_poll: PositiveDuration = timedelta(seconds=30)
    """How often the model source and the features dataset are checked for a new version."""
    features_max_age: Duration = timedelta(hours=30)
    """/readyz fails when the newest features are older than this (the nightly job builds them
    once a day); 0 turns the check off (replayed or simulated data)."""
    metrics_top: int = Field(default=20, ge=0, le=1000)
    """/metrics exports risk gauges for this many riskiest GPUs and nodes (bounded labels)."""
    header_timeout: PositiveDuration = timedelta(seconds=10)
    """A request's headers must arrive within this of its first byte (or of the connection);
    else 408 and the connection is closed, so slow clients cannot hold the server's sockets."""
    body_timeout: PositiveDuration = timedelta(seconds=30)
    """...and its body within this of its headers."""


class Settings(_Table):
    store: StoreSettings = _default(StoreSettings)
    simulate: SimulateSettings = _default(SimulateSettings)
    ingest: IngestSettings = _default(IngestSettings)
    features: FeatureSettings = _default(FeatureSettings)
    labels: LabelSettings = _default(LabelSettings)
    model: ModelSettings = _default(ModelSettings)
    evaluate: EvaluateSettings = _default(EvaluateSettings)
    publish: PublishSettings = _default(PublishSettings)
    collect: CollectSettings = _default(CollectSettings)
    mlflow: MlflowSettings = _default(MlflowSettings)
    nightly: NightlySettings = _default(NightlySettings)
    dask: DaskSettings = _default(DaskSettings)
    serve: ServeSettings = _default(ServeSettings)
    metrics: Annotated[dict[str, MetricSettings], AfterValidator(_metric_names)] = Field(default_factory=dict)
    """The user's own metrics, by column name (`[metrics.<name>]`)."""

    def user_metrics(self) -> tuple[Metric, ...]:
        """The `[metrics]` tables as catalogue entries (`ingest.user_metrics.record_metrics`)."""
        from ingest.user_metrics import user_metric

        return tuple(
            user_metric(
                name,
                m.kind,
                m.unit,
                valid_min=m.min,
                valid_max=m.max,
                description=m.description,
                dcgm_field=m.dcgm_field,
            )
            for name, m in self.metrics.items()
        )

    def feature_spec(self) -> FeatureSpec:
        """The settings that shape features ([features] and [labels]) as one spec."""
        f, labels = self.features, self.labels
        return FeatureSpec(
            grid=f.grid,
            windows=tuple(f.windows),
            max_silence=f.max_silence,
            fail_slow_window=f.fail_slow_window if f.fail_slow else None,
            horizon=labels.horizon,
            failure_xids=tuple(labels.failure_xids),
            merge_window=labels.merge_window,
            lost_after=labels.lost_after,
        )

    def build_options(self, *, progress: bool = True) -> BuildOptions:
        """How the single-machine feature build runs ([features] memory bounds and threads)."""
        from features.runner import BuildOptions

        f = self.features
        return BuildOptions(
            max_buckets_in_memory=f.buckets_in_memory,
            rows_per_part=f.rows_per_part,
            block_days=f.block_days,
            workers=f.workers,
            read_ahead=f.read_ahead,
            write_ahead=f.write_ahead,
            progress=progress,
        )

    def model_params(self) -> dict[str, Any]:
        """The [model] kind's parameters for `models.kinds` (threads, ensemble members, cascade stages)."""
        m = self.model
        if m.kind == "parallel":
            base = {"n_jobs": m.threads, "members": list(m.members), "combine": m.combine, "top_k": m.top_k}
        elif m.kind == "cascade":
            base = {
                "n_jobs": m.threads,
                "first": m.cascade_first,
                "second": m.cascade_second,
                "first_params": dict(m.cascade_first_params),
                "second_params": dict(m.cascade_second_params),
                "target_recall": m.cascade_recall,
            }
        else:
            base = {"n_jobs": m.threads} if m.kind in ("lightgbm", "xgboost", "random_forest") else {}
        return {**base, **m.params}

    def train_options(self) -> TrainOptions:
        """`gpufail train`'s options for `models.train` (and its store and Dask forms): the
        [model] fit on features of this configuration's spec."""
        from models.train import TrainOptions

        spec = self.feature_spec()
        return TrainOptions(
            kind=self.model.kind,
            train_window=self.model.train_window,
            horizon=spec.horizon,
            params=self.model_params(),
            negative_fraction=self.model.negative_fraction,
            max_negatives_per_positive=self.model.max_negatives_per_positive,
            monotone_increasing=tuple(self.model.monotone_increasing),
            calibration=self.model.calibration,
            calibration_window=self.model.calibration_window,
            feature_spec=spec,
        )

    def walk_forward_plan(self, *, test_days: float | None = None) -> WalkForwardPlan:
        """`gpufail evaluate`'s walk-forward ([evaluate]), every fit calibrated as `gpufail
        train` calibrates the served model ([model] calibration); `test_days` overrides."""
        from models.walk_forward import WalkForwardPlan

        cfg = self.evaluate
        return WalkForwardPlan(
            horizon=self.labels.horizon,
            test_days=cfg.test_days if test_days is None else test_days,
            retrain_every=cfg.retrain_every,
            train_window=cfg.train_window,
            candidate_windows=tuple(cfg.candidate_windows),
            validation_window=cfg.validation_window,
            switch_margin=cfg.switch_margin,
            negative_fraction=cfg.negative_fraction,
            seed=cfg.seed,
            jobs=cfg.jobs,
            monotone_increasing=tuple(self.model.monotone_increasing),
            calibration=self.model.calibration,
            calibration_window=self.model.calibration_window,
        )

    def alarm_rules(self) -> AlarmRules:
        """How `gpufail evaluate` raises and judges alarms ([evaluate] and the label horizon)."""
        from models.alarms import AlarmRules

        return AlarmRules(horizon=self.labels.horizon, long_horizon=self.evaluate.long_horizon)

    def ingest_workers(self) -> int:
        """`[ingest] workers`, 0 meaning one per core."""
        return self.ingest.workers or os.cpu_count() or 1

    def collect_options(
        self,
        *,
        node: str | None = None,
        sources: str | None = None,
        interval: timedelta | None = None,
        listen: str | None = None,
    ) -> CollectOptions:
        """`gpufail collect`'s options ([collect] and [ingest]), with the command line's overrides;
        the node defaults to [collect] node, else this machine's hostname."""
        import socket

        from ingest.collect.daemon import CollectOptions, PrometheusSource, parse_sources

        cfg = self.collect
        pcfg = self.ingest.prometheus
        return CollectOptions(
            cluster=self.ingest.cluster,
            node=node or cfg.node or socket.gethostname(),
            sources=parse_sources(sources if sources is not None else cfg.sources),
            interval=cfg.interval if interval is None else interval,
            flush_rows=cfg.flush_rows,
            flush_interval=cfg.flush_interval,
            dcgm_exporter_url=cfg.dcgm_exporter_url,
            kernel_log_source=cfg.kernel_log_source,
            kernel_log_paths=tuple(cfg.kernel_log_paths),
            dedup_window=self.ingest.xid_dedup_window,
            max_lines=cfg.max_lines_per_run,
            listen=cfg.listen if listen is None else listen,
            prometheus=PrometheusSource(
                url=pcfg.url,
                match=pcfg.match,
                labels=tuple(pcfg.labels.items()),
                timeout_s=pcfg.timeout.total_seconds(),
                retries=pcfg.retries,
                ca_file=pcfg.ca_file or None,
            ),
        )

    def publish_options(
        self, *, target: str | None = None, dry_run: bool | None = None, shadow: bool | None = None
    ) -> PublishOptions:
        """A `gpufail publish` run of the [publish] settings, with the command line's overrides."""
        return self.publish.options(target=target, dry_run=dry_run, shadow=shadow)

    def serve_options(self, root: str, *, admin_token: str | None, read_token: str | None) -> ServeOptions:
        """`gpufail serve`'s options ([serve] and the policy's tiers) for the data root `root`;
        the tokens come from the environment variables [serve] names."""
        from serving.api_state import ServeOptions

        cfg = self.serve
        return ServeOptions(
            data_root=root,
            tiers=self.publish.policy_config(),
            model_name=self.mlflow.model_name,
            admin_token=admin_token,
            read_token=read_token,
            read_requires_token=cfg.read_requires_token,
            admin_token_env=cfg.admin_token_env,
            max_body_bytes=cfg.max_body_bytes,
            max_gpus_per_request=cfg.max_gpus_per_request,
            max_top_features=cfg.max_top_features,
            reload_poll_s=cfg.reload_poll.total_seconds(),
            features_max_age_s=cfg.features_max_age.total_seconds(),
            metrics_top=cfg.metrics_top,
        )

    def nightly_options(self, root: str, *, progress: bool = True) -> NightlyOptions:
        """`gpufail nightly`'s options: the same spec, build and training options the commands
        use, with the [nightly] fit's parameters and negative share on top."""
        from dataclasses import replace

        from gpufail.nightly import NightlyOptions, default_work_dir

        cfg, ml = self.nightly, self.mlflow
        return NightlyOptions(
            work_dir=default_work_dir(root, cfg.work_dir),
            tracking_uri=ml.tracking_uri,
            model_name=ml.model_name,
            experiment=ml.experiment,
            train=replace(
                self.train_options(),
                params={**self.model_params(), **cfg.params},
                negative_fraction=cfg.negative_fraction,
            ),
            top_k=self.model.top_k,
            holdout_days=cfg.holdout_days,
            promotion_margin=cfg.promotion_margin,
            recall_tolerance=cfg.recall_tolerance,
            precision_floor=cfg.precision_floor,
            feature_spec=self.feature_spec(),
            build=self.build_options(progress=progress),
            retries=ml.retries,
            backoff_s=ml.backoff.total_seconds(),
            cluster=self.ingest.cluster,
            dedup_window=self.ingest.xid_dedup_window,
            ingest_workers=self.ingest_workers(),
            compact_settle=self.store.compact_settle,
        )


_log = logging.getLogger(__name__)

ENV_PREFIX = "GPUFAIL_"
SECRET_ENV_SUFFIXES = ("_TOKEN", "_SECRET")
"""`GPUFAIL_*_TOKEN` / `GPUFAIL_*_SECRET` without `__` hold secrets (webhook secret, API tokens)
that settings refer to by name; they are not `GPUFAIL_<TABLE>__<KEY>` overrides."""


_ADDRESS = r"[0-9a-fA-F.:]+"
_NUMBER = r"\d+"
_PROTOCOL = r"tcp|udp|sctp"
_URL = rf"(?:{_PROTOCOL})://\[?{_ADDRESS}\]?:{_NUMBER}"
_SERVICE_LINKS = tuple(
    (rf"[A-Z0-9_]+_{name}", value)
    for name, value in (
        ("SERVICE_HOST", _ADDRESS),
        ("SERVICE_PORT(?:_[A-Z0-9_]+)?", _NUMBER),
        ("PORT", _URL),
        (r"PORT_\d+_(?:TCP|UDP|SCTP)", _URL),
        (r"PORT_\d+_(?:TCP|UDP|SCTP)_PROTO", _PROTOCOL),
        (r"PORT_\d+_(?:TCP|UDP|SCTP)_PORT", _NUMBER),
        (r"PORT_\d+_(?:TCP|UDP|SCTP)_ADDR", _ADDRESS),
    )
)
"""The variables the kubelet gives every pod for each Service of its namespace
(`enableServiceLinks`, on by default), by name and value: a Service named gpufail-serve becomes
`GPUFAIL_SERVE_SERVICE_HOST=10.0.0.7`, `GPUFAIL_SERVE_SERVICE_PORT[_HTTP]=8080`,
`GPUFAIL_SERVE_PORT=tcp://10.0.0.7:8080` and `GPUFAIL_SERVE_PORT_8080_TCP[_PROTO|_PORT|_ADDR]`.
Matching the value too keeps a mistyped override (`GPUFAIL_SERVE_PORT=8080`) an error. Kept as
patterns, compiled (and cached by `re`) when such a variable is first seen: compiling them all
was a tenth of loading the settings."""


def _is_service_link(name: str, value: str) -> bool:
    return any(re.fullmatch(shape, name) and re.fullmatch(values, value) for shape, values in _SERVICE_LINKS)


SYSTEM_CONFIG = Path("/etc/gpufail/gpufail.toml")
"""The configuration file of the machine, read when no other is named or found (docs/cli.md)."""
LOCAL_CONFIG = "gpufail.toml"
"""The configuration file of the current directory, read before the machine's."""


def find_config(
    path: str | Path | None, environ: Mapping[str, str], *, cwd: Path | None = None, system: Path | None = None
) -> tuple[Path | None, str]:
    """The configuration file to read and how it was found, first match wins: `--config`
    (`path`), then `$GPUFAIL_CONFIG`, then `./gpufail.toml`, then `system`; (None, "defaults")
    when there is none. A file named by `--config` or `$GPUFAIL_CONFIG` must exist; the other
    two are read only where they exist. `system` defaults to `SYSTEM_CONFIG`, looked up at
    the call (tests point it at a folder of their own)."""
    system = SYSTEM_CONFIG if system is None else system
    if path:
        return Path(path), "--config"
    if environ.get("GPUFAIL_CONFIG"):
        return Path(environ["GPUFAIL_CONFIG"]), "GPUFAIL_CONFIG"
    local = (Path.cwd() if cwd is None else cwd) / LOCAL_CONFIG
    if local.is_file():
        return local, "current directory"
    if system.is_file():
        return system, "system"
    return None, "defaults"


def load_settings(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    cwd: Path | None = None,
    system: Path | None = None,
    tables: Collection[str] | None = None,
) -> Settings:
    """Read the configuration file (if any, `find_config`) and the environment into one
    Settings object.

    Every value is checked here, before any command runs: types, ranges, units, and that the
    grid, the windows and the horizon fit together. An error is one line naming the file or
    environment variable, the table and key, what was received and what was expected.

    `tables` names the only tables a command reads (`gpufail at-risk`: a quick look should not
    pay for checking the whole file): only they are checked and in the object, the others must
    still be gpufail tables (reading one is an AttributeError, never its default in place of a
    value set).
    """
    return load_settings_and_origins(path, environ, cwd=cwd, system=system, tables=tables)[0]


def load_settings_and_origins(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    cwd: Path | None = None,
    system: Path | None = None,
    tables: Collection[str] | None = None,
) -> tuple[Settings, _Origins]:
    """`load_settings`, and where each setting came from (for `gpufail config show`)."""
    environ = os.environ if environ is None else environ
    found, how = find_config(path, environ, cwd=cwd, system=system)
    named_by = " (GPUFAIL_CONFIG)" if how == "GPUFAIL_CONFIG" else ""
    data = _read_file(found, f"config file {found}{named_by}") if found else {}
    origins = _Origins(
        str(found) if found else None, {(t, k) for t, v in data.items() if isinstance(v, dict) for k in v}
    )
    origins.found_by = how
    for name, table, key, value in _env_overrides(environ):
        section = data.setdefault(table, {})
        if not isinstance(section, dict):
            raise ConfigError(
                _printable(f"config file {found}: [{table}] must be a table (it is overridden by {name})")
            )
        section[key] = value
        origins.env[(table, key)] = name
    settings = _validated(data, origins, tables)
    problems = _inconsistencies(settings, origins) if tables is None or {"features", "labels"} <= set(tables) else []
    if problems:
        raise ConfigError(_printable("; ".join(problems)))
    return settings, origins


def _read_file(path: Path, where: str) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(_printable(f"{where}: not found")) from None
    except IsADirectoryError:
        raise ConfigError(_printable(f"{where}: is a folder; expected a TOML file")) from None
    except OSError as exc:
        raise ConfigError(_printable(f"{where}: cannot be read ({exc.strerror or exc})")) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            _printable(
                f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); expected a TOML file"
            )
        ) from None
    import tomllib  # only where a file is read

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(_printable(f"{where}: not valid TOML ({exc})")) from None


def _env_overrides(environ: Mapping[str, str]) -> list[tuple[str, str, str, Any]]:
    """`GPUFAIL_LABELS__HORIZON=12h` -> ("GPUFAIL_LABELS__HORIZON", "labels", "horizon", "12h").

    A value that parses as JSON (numbers, booleans, lists) is used as such, so
    `GPUFAIL_LABELS__FAILURE_XIDS='[48, 79]'` works; anything else stays a string."""
    found = []
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == "GPUFAIL_CONFIG":
            continue
        table, sep, key = name.removeprefix(ENV_PREFIX).lower().partition("__")
        if not sep and name.endswith(SECRET_ENV_SUFFIXES):
            continue  # a secret the settings name (GPUFAIL_WEBHOOK_SECRET), not an override
        if not sep and _is_service_link(name, raw):
            _log.debug("environment variable %s: a Kubernetes service link, not a setting; ignored", name)
            continue
        if not sep or not key:
            raise ConfigError(
                _printable(
                    f"environment variable {name}: expected GPUFAIL_<TABLE>__<KEY>, e.g. GPUFAIL_LABELS__HORIZON"
                )
            )
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError as exc:
            # os.environ keeps undecodable bytes as lone surrogates (PEP 383): name the byte.
            byte = ord(raw[exc.start]) - 0xDC00
            raise ConfigError(
                _printable(f"environment variable {name}: not UTF-8 text (byte 0x{byte:02x} at offset {exc.start})")
            ) from None
        try:
            value: Any = json.loads(raw)
        except ValueError as exc:
            if raw.lstrip().startswith(("[", "{")):
                raise ConfigError(
                    _printable(
                        f"environment variable {name}: {raw!r} is not valid JSON ({exc}); expected e.g. '[48, 79]'"
                    )
                ) from None
            value = raw
        found.append((name, table, key, value))
    return found


class _Origins:
    """Where each (table, key) came from: the environment, the file, or the defaults."""

    def __init__(self, path: str | None, file_keys: set[tuple[str, str]]) -> None:
        self.path = path
        self.file_keys = file_keys
        self.env: dict[tuple[str, str], str] = {}
        self.found_by = "defaults"
        """How the file was found (`find_config`)."""

    def set_in(self, table: str, key: str) -> str:
        """` (set in config file c.toml)`, ` (set in environment variable ...)`, or nothing for a default."""
        if (table, key) in self.env:
            return f" (set in environment variable {self.env[(table, key)]})"
        return f" (set in config file {self.path})" if (table, key) in self.file_keys else ""

    def where(self, table: str, key: str | None = None, rest: str = "") -> str:
        """`config file c.toml: [labels] horizon`, `environment variable GPUFAIL_LABELS__HORIZON
        ([labels] horizon)` or `[labels] horizon (default)`."""
        place = f"[{table}] {key}{rest}" if key else f"[{table}]"
        if key is None:
            names = sorted(n for (t, _), n in self.env.items() if t == table)
            if names and not any(t == table for t, _ in self.file_keys):
                return f"environment variable {', '.join(names)} ({place})"
            return f"config file {self.path}: {place}" if self.path else place
        if (table, key) in self.env:
            return f"environment variable {self.env[(table, key)]} ({place})"
        if (table, key) in self.file_keys:
            return f"config file {self.path}: {place}"
        return f"{place} (default)"


def _validated(data: dict[str, Any], origins: _Origins, only: Collection[str] | None = None) -> Settings:
    """`Settings(**data)`, validating only the tables `data` has (the others are the defaults),
    and with `only` (`load_settings`' `tables`) holding only those tables: a table's validator
    is built on its first use, and building them all was most of the time of loading the
    settings."""
    errors: list[dict[str, Any]] = []
    tables: dict[str, Any] = {}
    for name, value in data.items():
        if name not in Settings.model_fields:
            errors.append({"loc": (name,), "type": "extra_forbidden", "msg": "", "input": value})
        elif only is None or name in only:
            try:
                tables[name] = _table_validator(name).validate_python(value)
            except ValidationError as exc:
                errors += [{**err, "loc": (name, *err["loc"])} for err in exc.errors()]
    if errors:
        order = list(Settings.model_fields)
        errors.sort(key=lambda err: order.index(err["loc"][0]) if err["loc"][0] in order else len(order))
        raise ConfigError(_printable(_describe(errors, origins)))
    # Tables outside `only` are not there rather than their defaults: set, they were not checked;
    # unset, making their defaults was most of the time left of a quick command's settings.
    left_out = [name for name in Settings.model_fields if only is not None and name not in only]
    settings = Settings.model_construct(**tables, **dict.fromkeys(left_out))
    for name in left_out:
        del settings.__dict__[name]
    return settings


@cache
def _table_validator(name: str) -> TypeAdapter[Any]:
    """The validator of the table `name` of `Settings` (made once per process)."""
    field = Settings.model_fields[name]
    kind: Any = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return TypeAdapter(kind)


def _describe(errors: list[dict[str, Any]], origins: _Origins) -> str:
    problems = []
    for err in errors:
        loc = [str(part) for part in err["loc"]]
        table = loc[0] if loc else "?"
        key = loc[1] if len(loc) > 1 else None
        where = origins.where(table, key, "".join(f".{part}" for part in loc[2:]))
        if err["type"] == "extra_forbidden" and key is None:
            tables = ", ".join(f"[{name}]" for name in Settings.model_fields)
            problems.append(f"{where}: unknown table (not a gpufail setting); expected one of {tables}")
        elif err["type"] == "extra_forbidden":
            problems.append(f"{where}: unknown key (not a gpufail setting; gpufail.example.toml lists them all)")
        else:
            message = err["msg"].removeprefix("Value error, ")
            received = "" if "got " in message else f", got {err.get('input')!r}"
            problems.append(f"{where}: {message}{received}")
    return "; ".join(problems)


_SPEC_KEYS = {"grid": ("features", "grid"), "windows": ("features", "windows"), "horizon": ("labels", "horizon")}
"""Where each setting `features.spec.inconsistencies` checks lives in the configuration."""


def _inconsistencies(settings: Settings, origins: _Origins) -> list[str]:
    """The grid, the windows and the horizon must fit together (`features.spec.inconsistencies`,
    the check every `FeatureSpec` makes): checked here so that a daily grid with the default
    hourly windows is refused at load, naming where each setting was set, not when the spec is
    made for a command."""
    grid = settings.features.grid
    grid_name = f"[features] grid '{format_duration(grid)}'" + origins.set_in("features", "grid")
    found = inconsistencies(grid, settings.features.windows, settings.labels.horizon, grid_name=grid_name)
    return [f"{origins.where(*_SPEC_KEYS[p.field])}: {p.message}" for p in found]


def _printable(message: str) -> str:
    """One line that any terminal can print: undecodable bytes from the environment or a file
    name (lone surrogates) written as escapes instead of failing the print."""
    return " ".join(message.encode("utf-8", "backslashreplace").decode("utf-8").split("\n"))
