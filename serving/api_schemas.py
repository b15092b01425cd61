"""Request and response bodies of the REST endpoint (serving/api.py), as pydantic models.

They are the OpenAPI document: every field says what it holds and what is accepted. Numbers
must be finite (JSON has no NaN; Python's parser accepts the `NaN`/`Infinity` tokens, which are
refused here); a missing reading is `null`. Unknown fields are refused so that a misspelt
feature or metric name is an error instead of a silently missing value.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, create_model, model_validator

from ingest.schema import metric_catalogue

GpuId = str
MAX_ID_LENGTH = 200


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


FLOAT32_MAX = 3.4e38
INT64_MAX = 2**63 - 1
# Values are stored as float32 / int64 / int32 (the datasets' types): larger ones are refused
# here rather than overflowing (to inf, or an error) further down.


def _float32(value: float) -> float:
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"expected a number within float32 range (at most 3.4e38 in size), got {value:g}")
    return value


FiniteOrNull = Annotated[float, AfterValidator(_float32)] | None
CounterOrNull = Annotated[int, Field(ge=0, le=INT64_MAX)] | None
EARLIEST, LATEST = datetime(1970, 1, 1, tzinfo=UTC), datetime(2200, 1, 1, tzinfo=UTC)


def _plausible(moment: datetime) -> datetime:
    # pandas timestamps end in 2262; a sample from before 1970 or after 2200 is a broken clock.
    if not EARLIEST <= moment < LATEST:
        raise ValueError(f"expected a time between 1970 and 2200, got {moment.isoformat()}")
    return moment


Timestamp = Annotated[AwareDatetime, AfterValidator(_plausible)]


class FeatureRow(_Strict):
    """One GPU's model inputs at one grid time (the feature frame's columns, `docs/features.md`)."""

    gpu_uuid: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    cluster: str = Field(default="api", max_length=MAX_ID_LENGTH)
    node: str = Field(
        default="", max_length=MAX_ID_LENGTH, description="Node name; GPUs of one node share its node risk."
    )
    gpu_index: int = Field(default=0, ge=0, le=1023)
    ts: Timestamp | None = Field(default=None, description="Grid time of the features (default: now).")
    gpu_model: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    driver: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    values: dict[str, FiniteOrNull] = Field(
        description="Feature name -> value (null or absent: missing). Names must be among the model's features "
        "(GET /v1/model lists them)."
    )


class XidEventRow(_Strict):
    """One XID incident (the `xid_events` dataset's columns)."""

    ts: Timestamp
    last_ts: Timestamp | None = None
    cluster: str = Field(default="api", max_length=MAX_ID_LENGTH)
    node: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    pci_bus_id: str = Field(min_length=1, max_length=64)
    gpu_index: int | None = Field(default=None, ge=0, le=1023)
    gpu_uuid: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    xid: int = Field(ge=0, le=100_000)
    repeat_count: int = Field(default=1, ge=1, le=2**31 - 1)
    source: str = Field(default="api", max_length=64)
    message: str | None = Field(default=None, max_length=2000)


def _metric_field(arrow_type: Any, description: str) -> tuple[Any, Any]:
    kind = CounterOrNull if str(arrow_type) == "int64" else FiniteOrNull
    return kind, Field(default=None, description=description)


class TelemetryIds(_Strict):
    """One GPU sample (the `telemetry` dataset's columns; metrics absent or null are missing)."""

    ts: Timestamp
    cluster: str = Field(default="api", max_length=MAX_ID_LENGTH)
    node: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    gpu_index: int = Field(ge=0, le=1023)
    gpu_uuid: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    pci_bus_id: str | None = Field(default=None, max_length=64)
    gpu_model: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    driver: str | None = Field(default=None, max_length=MAX_ID_LENGTH)


# One field per metric of the catalogue (ingest/metrics.csv), so the OpenAPI document lists them.
TelemetryRow: type[TelemetryIds] = create_model(  # type: ignore[call-overload]
    "TelemetryRow",
    __base__=TelemetryIds,
    __doc__=TelemetryIds.__doc__,
    **{m.column: _metric_field(m.arrow_type, f"{m.description} ({m.unit})") for m in metric_catalogue()},
)


class PredictRequest(_Strict):
    """Exactly one of `gpu_uuids` (the fast path: the server's latest features), `features`
    (model inputs per GPU) or `telemetry` (raw samples, with optional `xid_events`, featurised by
    the same code as training)."""

    gpu_uuids: list[GpuId] | None = Field(
        default=None, description="GPUs of the server's latest features, scored with the served model."
    )
    features: list[FeatureRow] | None = None
    telemetry: list[TelemetryRow] | None = None  # type: ignore[valid-type]
    xid_events: list[XidEventRow] | None = Field(default=None, description="Only with `telemetry`.")
    top_features: int = Field(
        default=3,
        ge=0,
        description="Top contributing features per GPU (0: none, faster); at most [serve] max_top_features.",
    )

    @model_validator(mode="after")
    def _one_input(self) -> PredictRequest:
        given = [name for name in ("gpu_uuids", "features", "telemetry") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"expected exactly one of gpu_uuids, features or telemetry, got {given or 'none'}")
        if self.xid_events is not None and self.telemetry is None:
            raise ValueError("xid_events: expected only together with telemetry")
        return self


class Contribution(BaseModel):
    feature: str
    value: float | str | None = Field(description="The GPU's value of the feature (null: missing).")
    contribution: float = Field(description="Signed; positive raises the risk (units per model kind).")


class GpuPrediction(BaseModel):
    gpu_uuid: str
    cluster: str
    node: str
    gpu_index: int
    ts: datetime | None = Field(description="Grid time of the features scored.")
    risk: float = Field(description="Probability that the GPU fails within the model's horizon.")
    rank: int = Field(description="1 = the riskiest GPU of this response.")
    fleet_rank: int | None = Field(
        description="Rank among the GPUs of the server's latest features (null for payloads)."
    )
    tier: str = Field(description="The risk tier the GPU's own risk enters ([publish] tiers; no hysteresis).")
    node_risk: float = Field(description="1 - prod(1 - risk) over the node's GPUs (the fleet's, or the payload's).")
    node_tier: str
    top_features: list[Contribution]
    model_version: str
    payload_only_features: list[str] | None = Field(
        default=None,
        description="Telemetry requests: the features that need the fleet or the GPU's history (gpu_age_h, the XID "
        "features, the GPU-model deltas) computed from the payload alone, because the server's store does not know "
        "this GPU or this grid time (empty: all from the store's fleet facts).",
    )


class NotScored(BaseModel):
    gpu_uuid: str
    reason: str


class PredictResponse(BaseModel):
    model_version: str
    source: Literal["latest_features", "features", "telemetry"]
    horizon_h: float
    gpus: list[GpuPrediction]
    not_scored: list[NotScored] = Field(
        default_factory=list, description="Telemetry GPUs without a feature row (e.g. out of service after a failure)."
    )


class AtRiskResponse(BaseModel):
    model_version: str
    ts: datetime | None
    n_gpus: int = Field(description="GPUs in the latest features.")
    gpus: list[GpuPrediction]


class NodeGpu(BaseModel):
    gpu_uuid: str
    gpu_index: int
    risk: float
    fleet_rank: int
    tier: str


class NodeResponse(BaseModel):
    cluster: str
    node: str
    ts: datetime | None
    node_risk: float
    node_tier: str
    node_rank: int = Field(description="1 = the riskiest node of the fleet.")
    n_gpus: int
    model_version: str
    gpus: list[NodeGpu]


class ModelResponse(BaseModel):
    name: str
    version: str
    registry_version: str | None
    alias: str | None
    source: str
    kind: str
    train_start: datetime
    train_end: datetime
    horizon_h: float
    n_rows: int
    n_positives: int
    n_features: int
    feature_columns: list[str]
    metrics: dict[str, float] | None = Field(
        description="The registry run's evaluation metrics (null for a model folder)."
    )
    calibrated: bool = Field(
        description="Whether the served risk is calibrated; false for a model saved before models carried a "
        "calibration (its risk is then the odds-corrected model output)."
    )
    calibration: dict[str, Any] | None = Field(
        description="The calibration's provenance: method, slice_start, slice_end, n_rows, n_positives, "
        "negative_fraction, its parameters (null when not calibrated)."
    )
    library_versions: dict[str, str] = Field(description="Recorded at training.")
    installed_versions: dict[str, str | None]
    loaded_at: datetime
    features_ts: datetime | None
    last_reload_error: str | None


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    ready: bool
    reasons: list[str]
    model_version: str | None
    features_ts: datetime | None


class ReloadResponse(BaseModel):
    changed: bool
    model_version: str | None
    previous_version: str | None
    features_ts: datetime | None
    error: str | None


class ErrorBody(BaseModel):
    detail: str = Field(description="What was wrong, where, and what was expected.")
    errors: list[dict[str, Any]] | None = None
