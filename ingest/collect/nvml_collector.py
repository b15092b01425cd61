"""The NVML collector: one telemetry row per GPU per call, XID events, lost GPUs as events.

Per call of `collect()` and per GPU: one batched `nvmlDeviceGetFieldValues` for every column
whose source is a field (ECC, retired pages, remapped rows, PCIe replays, NVLink, power,
violation counters, memory temperature), then the few per-device getters NVML has no field for
(GPU temperature, utilisation, clocks, framebuffer use, clock-event reasons). The mapping is
data (`nvml_metrics.csv`). Counters are stored as NVML's cumulative values; the feature stage
computes increases.

Then the XID event set is drained with a wait timeout of 0, so a call never blocks. Identical
XIDs of one GPU within one call fold into one `xid_events` row with `repeat_count`.

A GPU that answers NVML_ERROR_GPU_IS_LOST (or times out, or has an interrupt problem) is data:
one `xid_events` row with xid 79 and source "nvml" when it goes, no telemetry rows while it
stays gone (the gap is itself a signal), and the other GPUs are still read. A GPU that
answers again is read again, and a later loss is a new event. Readings a board does not have
(NVML_ERROR_NOT_SUPPORTED) are nulls, and are not asked for again.

Only failures of the library as a whole (no libnvidia-ml.so.1, driver not loaded, no
permission, the device list unreadable) raise `CollectorError`, with one line saying what to
do. The next `collect()` tries again from nvmlInit, so a driver loaded later is picked up.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import pyarrow as pa

from ingest.collect.base import Clock, Collected, CollectorError, SystemClock
from ingest.collect.nvml_client import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_IRQ_ISSUE,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
    NVML_SUCCESS,
    DeviceHandle,
    EventSet,
    NvmlCallError,
    NvmlClient,
    PynvmlClient,
)
from ingest.collect.nvml_metrics import NvmlSource, nvml_sources
from ingest.metric_ranges import in_range
from ingest.schema import metric_catalogue, normalise_pci_bus_id, schema_for

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Codes that mean the GPU itself is gone or not answering, as opposed to one reading missing.
LOST_CODES = frozenset({NVML_ERROR_GPU_IS_LOST, NVML_ERROR_TIMEOUT, NVML_ERROR_IRQ_ISSUE})
# Codes that mean "this board or driver cannot give this reading": a null, asked for no more.
UNSUPPORTED_CODES = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND})

XID_GPU_LOST = 79  # NVIDIA's "GPU has fallen off the bus"
UNKNOWN_PCI_BUS_ID = "unknown"  # xid_events needs a bus id; a GPU lost before NVML gave one has none
MAX_EVENTS_PER_CALL = 100_000  # bounds one drain of the event set during an XID flood
SOURCE = "nvml"

_INIT_HINTS = {
    NVML_ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 was not found; is the NVIDIA driver installed on this node?",
    NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded (load it, e.g. modprobe nvidia, or disable the nvml collector)",
    NVML_ERROR_NO_PERMISSION: "no permission to open the NVIDIA devices (/dev/nvidia*); run as a user that may",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "libnvidia-ml.so.1 and the loaded kernel driver are different versions; reload the driver or reboot",
}


@dataclass
class _Gpu:
    """What the collector knows about one GPU index; static attributes are read once."""

    index: int
    handle: DeviceHandle | None = None
    key: int | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    model: str | None = None
    lost: bool = False
    field_ids: list[int] = field(default_factory=list)  # the fields this GPU has not refused
    unsupported: set[int] = field(default_factory=set)  # ordinals of sources this GPU refused
    warned: set[tuple[str, int]] = field(default_factory=set)


class _GpuLost(Exception):
    def __init__(self, error: NvmlCallError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class _ResolvedSource:
    source: NvmlSource
    constant: int | None  # field id, sensor or clock domain; None where the getter needs none
    integer: bool  # the column is an integer column
    ordinal: int  # position in the mapping: a cheap key for per-GPU bookkeeping


class NvmlCollector:
    """Reads every GPU on this node through NVML. See the module docstring for the contract."""

    name = "nvml"

    def __init__(
        self,
        cluster: str,
        node: str,
        *,
        clock: Clock | None = None,
        client: NvmlClient | None = None,
        sources: Sequence[NvmlSource] | None = None,
    ) -> None:
        self.cluster = cluster
        self.node = node
        self._clock = clock if clock is not None else SystemClock()
        self._client = client if client is not None else PynvmlClient()
        self._sources = tuple(sources) if sources is not None else nvml_sources()
        self._open = False
        self._driver: str | None = None
        self._gpus: list[_Gpu] = []
        self._event_set: EventSet | None = None
        self._resolved: dict[str, list[_ResolvedSource]] = {}
        self._field_ids: list[int] = []
        self._sources_by_field: dict[int, list[int]] = {}
        self._telemetry_schema = schema_for("telemetry")
        self._xid_schema = schema_for("xid_events")
        self._no_xid_events = self._xid_schema.empty_table()  # the usual answer, built once
        self._event_errors_seen: set[int] = set()
        self._metrics = {m.column: m for m in metric_catalogue()}
        self._out_of_range: dict[str, int] = {}

    # ---- lifecycle ----

    def collect(self) -> Collected:
        self._ensure_open()
        ts = self._clock.now()
        rows: list[dict[str, object]] = []
        events: list[dict[str, object]] = []
        for gpu in self._gpus:
            row = self._sample(gpu, ts, events)
            if row is not None:
                rows.append(row)
        events.extend(self._drain_xid_events(ts))
        return {
            "telemetry": pa.Table.from_pylist(rows, schema=self._telemetry_schema),
            "xid_events": pa.Table.from_pylist(events, schema=self._xid_schema) if events else self._no_xid_events,
        }

    def counts(self) -> dict[str, dict[str, int]]:
        """NVML calls that failed, by function (counted by the client; see `NOT_AN_ERROR`), and
        readings left missing as out of range (`ingest.metric_ranges`), by column."""
        return {"nvml_errors": dict(getattr(self._client, "errors", {})), "out_of_range": dict(self._out_of_range)}

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self._event_set is not None:
            try:
                self._client.event_set_free(self._event_set)
            except NvmlCallError as exc:  # shutting down: say it, and still shut NVML down
                log.warning("nvml: closing: %s", exc)
        self._event_set = None
        self._gpus = []
        self._shutdown_quietly()

    def _ensure_open(self) -> None:
        if self._open:
            return
        try:
            self._client.init()
        except NvmlCallError as exc:
            hint = _INIT_HINTS.get(exc.code, "NVML could not be initialised")
            raise CollectorError(f"nvml collector on {self.node}: {hint} ({exc})") from None
        try:
            self._driver = self._optional(self._client.driver_version)
            count = self._client.device_count()
        except NvmlCallError as exc:
            self._shutdown_quietly()
            raise CollectorError(f"nvml collector on {self.node}: cannot list the GPUs ({exc})") from None
        self._resolve_sources()
        self._event_set = self._create_event_set()
        self._gpus = [_Gpu(index, field_ids=list(self._field_ids)) for index in range(count)]
        for gpu in self._gpus:
            # A lost GPU: its first sample meets the same error and records the loss as an event.
            with contextlib.suppress(_GpuLost):
                self._attach(gpu)
        self._open = True

    def _shutdown_quietly(self) -> None:
        try:
            self._client.shutdown()
        except NvmlCallError as exc:
            log.warning("nvml: shutdown: %s", exc)

    def _resolve_sources(self) -> None:
        integer_columns = {m.column for m in metric_catalogue() if pa.types.is_integer(m.arrow_type)}
        resolved: dict[str, list[_ResolvedSource]] = {}
        for ordinal, source in enumerate(self._sources):
            constant = None
            if source.argument.startswith("NVML_"):
                constant = self._client.constant(source.argument)
                if constant is None:
                    log.warning("nvml: this nvidia-ml-py has no %s; %s skips it", source.argument, source.column)
                    continue
            resolved.setdefault(source.column, []).append(
                _ResolvedSource(source, constant, source.column in integer_columns, ordinal)
            )
        self._resolved = resolved
        self._sources_by_field = {}
        for candidates in resolved.values():
            for r in candidates:
                if r.source.getter == "field" and r.constant is not None:
                    self._sources_by_field.setdefault(r.constant, []).append(r.ordinal)
        self._field_ids = sorted(self._sources_by_field)

    # ---- per GPU ----

    def _attach(self, gpu: _Gpu) -> None:
        """Get the handle and static attributes, once; a lost GPU is marked, not raised."""
        try:
            if gpu.handle is None:
                handle = self._client.device_handle(gpu.index)
                gpu.handle, gpu.key = handle, self._client.device_key(handle)
                self._register_xid_events(gpu)
            if gpu.uuid is None:
                gpu.uuid = self._client.uuid(gpu.handle)
            if gpu.pci_bus_id is None:
                gpu.pci_bus_id = self._bus_id(gpu)
            if gpu.model is None:
                gpu.model = self._optional(self._client.name, gpu.handle)
        except NvmlCallError as exc:
            if exc.code not in LOST_CODES:
                self._warn_once(gpu, exc, f"GPU {gpu.index}: cannot identify it yet, retrying next call")
                return
            raise _GpuLost(exc) from None

    def _sample(self, gpu: _Gpu, ts: datetime, events: list[dict[str, object]]) -> dict[str, object] | None:
        try:
            if gpu.handle is None or gpu.uuid is None:
                self._attach(gpu)
                if gpu.handle is None or gpu.uuid is None:
                    return None
            values = self._read_metrics(gpu)
        except _GpuLost as lost:
            if not gpu.lost:
                gpu.lost = True
                events.append(self._lost_event(gpu, ts, lost.error))
                log.warning("nvml: GPU %d (%s) is lost: %s", gpu.index, gpu.uuid or "uuid unknown", lost.error)
            return None
        if gpu.lost:
            log.warning("nvml: GPU %d (%s) answers again", gpu.index, gpu.uuid)
            gpu.lost = False
        return {
            "ts": ts,
            "cluster": self.cluster,
            "node": self.node,
            "gpu_index": gpu.index,
            "gpu_uuid": gpu.uuid,
            "pci_bus_id": gpu.pci_bus_id,
            "gpu_model": gpu.model,
            "driver": self._driver,
            **values,
        }

    def _read_metrics(self, gpu: _Gpu) -> dict[str, object]:
        fields = self._read_fields(gpu)
        getter_cache: dict[tuple[str, int | None], object] = {}
        values: dict[str, object] = {}
        for column, candidates in self._resolved.items():
            value = None
            rejected = False
            for candidate in candidates:
                if candidate.ordinal in gpu.unsupported:
                    continue
                if candidate.source.getter == "field":
                    raw = fields.get(candidate.constant)  # type: ignore[arg-type]
                else:
                    raw = self._read_getter(gpu, candidate, getter_cache)
                value = _convert(raw, candidate)
                if value is not None and not in_range(value, self._metrics[column]):
                    # NaN, an infinity or a magnitude its column cannot hold (a double field
                    # value gone wrong): not a reading; the next source may have one.
                    value, rejected = None, True
                if value is not None:
                    break
            if value is None and rejected:
                self._out_of_range[column] = self._out_of_range.get(column, 0) + 1
            values[column] = value
        return values

    def _bus_id(self, gpu: _Gpu) -> str | None:
        raw = self._optional(self._client.pci_bus_id, gpu.handle)
        try:
            return normalise_pci_bus_id(raw) if raw else None
        except ValueError as exc:
            log.warning("nvml: GPU %d: %s", gpu.index, exc)
            return None

    def _read_fields(self, gpu: _Gpu) -> dict[int, float | int]:
        """One batched nvmlDeviceGetFieldValues for every field this GPU has not refused."""
        field_ids = list(gpu.field_ids)
        if not field_ids:
            return {}
        try:
            readings = self._client.field_values(gpu.handle, field_ids)
        except NvmlCallError as exc:
            if exc.code in LOST_CODES:
                raise _GpuLost(exc) from None
            self._warn_once(gpu, exc, f"GPU {gpu.index}: field values unreadable this call")
            return {}
        values: dict[int, float | int] = {}
        for field_id, reading in zip(field_ids, readings, strict=True):
            if reading.code == NVML_SUCCESS and reading.value is not None:
                values[field_id] = reading.value
            elif reading.code in LOST_CODES:
                raise _GpuLost(
                    NvmlCallError(f"nvmlDeviceGetFieldValues(field {field_id})", reading.code, "GPU is lost")
                )
            elif reading.code in UNSUPPORTED_CODES:
                gpu.field_ids.remove(field_id)
                gpu.unsupported.update(self._sources_by_field[field_id])
            else:
                self._warn_once(gpu, NvmlCallError(f"field {field_id}", reading.code, "field unreadable"), "")
        return values

    def _read_getter(
        self, gpu: _Gpu, candidate: _ResolvedSource, cache: dict[tuple[str, int | None], object]
    ) -> float | int | None:
        source = candidate.source
        key = (source.getter, candidate.constant)
        try:
            if key not in cache:
                cache[key] = self._call_getter(gpu.handle, source.getter, candidate.constant)
        except NvmlCallError as exc:
            if exc.code in LOST_CODES:
                raise _GpuLost(exc) from None
            if exc.code in UNSUPPORTED_CODES:
                gpu.unsupported.add(candidate.ordinal)
            else:
                self._warn_once(gpu, exc, f"GPU {gpu.index}: {source.column} unreadable")
            return None
        result = cache[key]
        if isinstance(result, tuple):  # utilization: (gpu %, memory %)
            return int(result[0] if source.argument == "gpu" else result[1])
        return result  # type: ignore[return-value]

    def _call_getter(self, handle: DeviceHandle, getter: str, constant: int | None) -> object:
        client = self._client
        if getter == "temperature":
            return client.temperature(handle, constant or 0)
        if getter == "utilization":
            return client.utilization(handle)
        if getter == "clock":
            return client.clock(handle, constant or 0)
        if getter == "memory":
            return client.memory_used(handle)
        if getter == "clock_event_reasons":
            return client.clock_event_reasons(handle)
        if getter == "enforced_power_limit":
            return client.enforced_power_limit(handle)
        raise AssertionError(f"getter {getter!r} passed nvml_metrics validation but has no call")

    # ---- events ----

    def _create_event_set(self) -> EventSet | None:
        try:
            return self._client.event_set_create()
        except NvmlCallError as exc:
            log.warning("nvml: no XID events on this node: %s", exc)
            return None

    def _register_xid_events(self, gpu: _Gpu) -> None:
        if self._event_set is None:
            return
        try:
            self._client.register_events(gpu.handle, NVML_EVENT_TYPE_XID_CRITICAL_ERROR, self._event_set)
        except NvmlCallError as exc:
            if exc.code in LOST_CODES:
                raise _GpuLost(exc) from None
            log.warning("nvml: GPU %d reports no XID events: %s", gpu.index, exc)

    def _drain_xid_events(self, ts: datetime) -> list[dict[str, object]]:
        if self._event_set is None:
            return []
        by_key = {gpu.key: gpu for gpu in self._gpus if gpu.key is not None}
        folded: dict[tuple[int | None, int], dict[str, object]] = {}
        for _ in range(MAX_EVENTS_PER_CALL):
            try:
                event = self._client.wait_event(self._event_set, 0)
            except NvmlCallError as exc:
                # A lost GPU can make the whole set report GPU_IS_LOST on every call; the per-GPU
                # reads already said which one, so stop draining for this call and say it once.
                if exc.code not in self._event_errors_seen:
                    self._event_errors_seen.add(exc.code)
                    log.warning("nvml: reading XID events: %s", exc)
                break
            if event is None:
                break
            if not event.event_type & NVML_EVENT_TYPE_XID_CRITICAL_ERROR:
                continue
            gpu = by_key.get(event.device_key)
            slot = (gpu.index if gpu else None, event.data)
            if slot in folded:
                folded[slot]["repeat_count"] += 1  # type: ignore[operator]
            else:
                folded[slot] = self._event_row(gpu, ts, event.data, f"Xid {event.data} (NVML XID critical error event)")
        else:
            log.warning("nvml: more than %d XID events in one call; the rest wait for the next", MAX_EVENTS_PER_CALL)
        return list(folded.values())

    def _lost_event(self, gpu: _Gpu, ts: datetime, error: NvmlCallError) -> dict[str, object]:
        message = f"GPU is lost: {error.call} returned {error.text} (NVML error {error.code}); fallen off the bus or not answering"
        return self._event_row(gpu, ts, XID_GPU_LOST, message)

    def _event_row(self, gpu: _Gpu | None, ts: datetime, xid: int, message: str) -> dict[str, object]:
        return {
            "ts": ts,
            "last_ts": ts,
            "cluster": self.cluster,
            "node": self.node,
            "pci_bus_id": (gpu.pci_bus_id if gpu else None) or UNKNOWN_PCI_BUS_ID,
            "gpu_index": gpu.index if gpu else None,
            "gpu_uuid": gpu.uuid if gpu else None,
            "xid": xid,
            "pid": None,
            "process": None,
            "message": message,
            "source": SOURCE,
            "repeat_count": 1,
        }

    # ---- helpers ----

    def _optional(self, getter: Callable[..., _T], *args: Any) -> _T | None:
        """A static attribute that some boards or drivers lack: None instead of an error."""
        try:
            return getter(*args)
        except NvmlCallError as exc:
            if exc.code in UNSUPPORTED_CODES:
                return None
            raise

    def _warn_once(self, gpu: _Gpu, exc: NvmlCallError, context: str) -> None:
        if (exc.call, exc.code) not in gpu.warned:
            gpu.warned.add((exc.call, exc.code))
            log.warning("nvml: %s%s%s", context, ": " if context else "", exc)


def _convert(raw: float | int | None, resolved: _ResolvedSource) -> float | int | None:
    """NVML's reading in the column's unit and type; None for a missing reading."""
    if raw is None:
        return None
    source = resolved.source
    if source.zero_is_missing and raw == 0:
        return None
    if resolved.integer and not (isinstance(raw, float) and not math.isfinite(raw)):
        return int(raw) // source.divisor
    return float(raw) / source.divisor
