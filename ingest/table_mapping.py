"""The TOML mapping that tells `gpufail ingest table` how another system's columns map to ours.

    [telemetry]                  # required: one row per GPU sample
    gpu = "device_serial"        # the column that identifies a GPU (becomes gpu_uuid)
    node = "hostname"            # or node_value = "n1" for a file of one node
    time = "sampled_at"
    time_format = "%Y-%m-%d %H:%M:%S"   # strftime codes; default: ISO 8601 (or epoch, see time_unit)
    time_zone = "Europe/Warsaw"  # of naive times; default UTC
    [telemetry.metrics]          # our column = their column, or a table with a scale
    temp_gpu_c = "temp"
    power_w = { column = "power_mw", scale = 0.001 }

    [failures]                   # optional: `failures` rows; their own file or flagged rows
    file = "tickets.csv"         # relative to the mapping file; default: the telemetry file
    flag = "event"               # with values: the rows that are failures
    values = ["gpu_failure"]

    [repairs]                    # optional: `repairs` rows
    file = "repairs.csv"
    action = "kind"
    actions = { RMA = "replace", reboot = "reset" }

Validated with pydantic; `load_mapping` turns every problem into one `InputError` naming the
mapping file and the key.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ingest.errors import InputError
from ingest.schema import metric_columns

TimeUnit = Literal["s", "ms", "us", "ns"]
RepairAction = Literal["replace", "reseat", "reset"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MetricColumn(_Strict):
    column: str = Field(min_length=1)
    scale: float = 1.0
    """Multiplies their value into our column's unit (e.g. 0.001 for mW -> W)."""


class TimeColumns(_Strict):
    time: str | None = None
    time_format: str | None = None
    time_zone: str | None = None
    time_unit: TimeUnit | None = None
    """For times stored as numbers: the epoch unit."""

    @field_validator("time_zone")
    @classmethod
    def _known_zone(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ZoneInfo(value)
            except (ZoneInfoNotFoundError, ValueError):
                raise ValueError(f"unknown time zone {value!r}; expected an IANA name such as 'UTC'") from None
        return value

    @model_validator(mode="after")
    def _one_way_to_read_time(self) -> TimeColumns:
        if self.time_format is not None and self.time_unit is not None:
            raise ValueError("time_format and time_unit exclude each other (text times or epoch numbers)")
        return self


class TelemetryMapping(TimeColumns):
    time: str = Field(min_length=1)  # type: ignore[assignment]
    gpu: str = Field(min_length=1)
    node: str | None = None
    node_value: str | None = None
    gpu_index: str | None = None
    gpu_model: str | None = None
    driver: str | None = None
    pci_bus_id: str | None = None
    metrics: dict[str, str | MetricColumn] = Field(min_length=1)

    @field_validator("metrics")
    @classmethod
    def _our_columns(cls, value: dict[str, str | MetricColumn]) -> dict[str, str | MetricColumn]:
        ours = set(metric_columns())
        unknown = sorted(set(value) - ours)
        if unknown:
            raise ValueError(
                f"unknown telemetry columns {unknown}; expected names from ingest/metrics.csv "
                "or your own metrics, declared as [metrics.<name>] tables in the configuration"
            )
        return value

    @model_validator(mode="after")
    def _one_node_source(self) -> TelemetryMapping:
        if (self.node is None) == (self.node_value is None):
            raise ValueError("give exactly one of node (a column) and node_value (one name for the whole file)")
        return self

    def metric_columns(self) -> dict[str, MetricColumn]:
        return {ours: MetricColumn(column=m) if isinstance(m, str) else m for ours, m in self.metrics.items()}


class EventMapping(TimeColumns):
    file: str | None = None
    """Relative to the mapping file. Default: the telemetry file itself."""
    gpu: str | None = None
    """Default: the telemetry mapping's `gpu`."""
    flag: str | None = None
    values: list[str] | None = None
    """With `flag`: the values that mark an event; default: true, 1, yes."""

    @model_validator(mode="after")
    def _flag_where_shared(self) -> EventMapping:
        if self.file is None and self.flag is None:
            raise ValueError("events in the telemetry file need flag (the column that marks them); or give file")
        if self.values is not None and self.flag is None:
            raise ValueError("values needs flag (the column they are looked up in)")
        return self


class FailureMapping(EventMapping):
    mode: str | None = None
    """Column with the failure's kind; default 'unknown'."""
    xid: str | None = None


class RepairMapping(EventMapping):
    action: str | None = None
    actions: dict[str, RepairAction] = Field(default_factory=dict)
    """Their action value -> ours; values already ours need no entry."""
    default_action: RepairAction = "replace"
    new_gpu: str | None = None


class TableMapping(_Strict):
    telemetry: TelemetryMapping
    failures: FailureMapping | None = None
    repairs: RepairMapping | None = None


def load_mapping(path: Path) -> TableMapping:
    """The mapping in a TOML file, or `InputError` naming the file, the key and the problem."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"mapping {path}: cannot read ({exc.strerror}); expected a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"mapping {path}: not TOML ({exc})") from None
    try:
        return TableMapping.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"]) or "(top level)"
            problems.append(f"[{key}] {err['msg'].removeprefix('Value error, ')}")
        raise InputError(f"mapping {path}: " + "; ".join(problems)) from None
