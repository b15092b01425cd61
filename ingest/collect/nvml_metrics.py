"""Where each telemetry column comes from in NVML: the packaged `nvml_metrics.csv`.

One row per (column, NVML source). A column may have several rows: they are tried in file order
and the first one the GPU supports gives the value (power: the 1-s average where the board has
one, else the instantaneous reading). `getter` is either `field` (read in the one batched
`nvmlDeviceGetFieldValues` call per GPU, `argument` naming the NVML_FI_* constant) or one of
the per-device getters below. NVML's unit is turned into the column's unit by dividing by
`divisor` (mW -> W, bytes -> MiB, ns -> us). `zero_is_missing` marks readings where a 0 means
"no sensor", as the dcgm-exporter path already treats them, so both sources agree.

Kept as data: a new counter is one CSV line, not new code.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal, get_args

from ingest.schema import metric_columns

Getter = Literal[
    "field",
    "temperature",
    "utilization",
    "clock",
    "memory",
    "clock_event_reasons",
    "enforced_power_limit",
]

# Getters whose argument is a member of the structure NVML returns rather than a constant.
_STRUCT_MEMBERS: dict[str, tuple[str, ...]] = {"utilization": ("gpu", "memory"), "memory": ("used",)}
# Getters that need an NVML constant (a field id, a sensor, a clock domain) as argument.
_NEEDS_CONSTANT = frozenset({"field", "temperature", "clock"})


@dataclass(frozen=True)
class NvmlSource:
    """One way of reading one telemetry column from NVML."""

    column: str
    getter: Getter
    argument: str
    divisor: int
    zero_is_missing: bool


@cache
def nvml_sources() -> tuple[NvmlSource, ...]:
    """The packaged mapping, validated against the telemetry schema."""
    text = resources.files("ingest.collect").joinpath("nvml_metrics.csv").read_text()
    return parse_nvml_sources(text, "nvml_metrics.csv")


def parse_nvml_sources(text: str, name: str) -> tuple[NvmlSource, ...]:
    """Parse and check a mapping; a bad row raises ValueError naming the file, line and field."""
    columns = set(metric_columns())
    sources = []
    for line_no, row in enumerate(csv.DictReader(text.splitlines()), start=2):
        where = f"{name} line {line_no}"
        column, getter, argument = row["column"], row["getter"], row["argument"] or ""
        if column not in columns:
            raise ValueError(f"{where}: column {column!r} is not a telemetry metric column")
        if getter not in get_args(Getter):
            raise ValueError(f"{where}: getter {getter!r}; expected one of {list(get_args(Getter))}")
        if getter in _STRUCT_MEMBERS and argument not in _STRUCT_MEMBERS[getter]:
            raise ValueError(f"{where}: {getter} argument {argument!r}; expected one of {_STRUCT_MEMBERS[getter]}")
        if getter in _NEEDS_CONSTANT and not argument.startswith("NVML_"):
            raise ValueError(f"{where}: {getter} needs an NVML_* constant as argument, got {argument!r}")
        try:
            divisor = int(row["divisor"])
        except ValueError:
            divisor = 0
        if divisor <= 0:
            raise ValueError(f"{where}: divisor {row['divisor']!r}; expected a positive integer")
        if row["zero_is_missing"] not in ("true", "false"):
            raise ValueError(f"{where}: zero_is_missing {row['zero_is_missing']!r}; expected true or false")
        sources.append(NvmlSource(column, getter, argument, divisor, row["zero_is_missing"] == "true"))  # type: ignore[arg-type]
    return tuple(sources)
