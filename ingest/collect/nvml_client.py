"""The NVML calls the collector makes, behind a typed Protocol, so that tests pass a fake and need no GPU.

`PynvmlClient` is the real implementation over nvidia-ml-py (`import pynvml`); tests run it
against a fake libnvidia-ml.so.1, and anything else that speaks this Protocol (a pure-Python
fake, a recorded session) can stand in for it. Every NVML failure leaves a client as one
`NvmlCallError` carrying the NVML return code, so the collector decides what a code means
(unsupported reading, lost GPU, broken library) without knowing pynvml's exception classes.
"""

from __future__ import annotations

import ctypes
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

# nvmlReturn_t codes the collector reacts to. The numbers are part of the NVML C ABI (nvml.h).
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x8

# Answers that say "this board, driver or binding has no such reading or function version":
# the collector asks no more (or falls back), so they are not counted as call errors.
NOT_AN_ERROR = frozenset(
    {NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_ARGUMENT_VERSION_MISMATCH}
)

DeviceHandle = Any
"""Opaque per-GPU handle; only the client that made it looks inside."""
EventSet = Any
"""Opaque NVML event set."""


class NvmlCallError(Exception):
    """One NVML call failed: which call, NVML's return code and its text."""

    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call}: {text} (NVML error {code})")
        self.call = call
        self.code = code
        self.text = text


@dataclass(frozen=True, slots=True)
class FieldReading:
    """One entry of a batched field-value read: NVML's per-field return code and the value."""

    code: int
    value: float | int | None


@dataclass(frozen=True, slots=True)
class NvmlEvent:
    """One event from an event set. `device_key` matches `NvmlClient.device_key` of a handle."""

    device_key: int
    event_type: int
    data: int


class NvmlClient(Protocol):
    """The subset of NVML gpufail reads. Every method raises only `NvmlCallError`."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def constant(self, name: str) -> int | None:
        """The value of an NVML constant (NVML_FI_*, NVML_CLOCK_*); None if the binding lacks it."""
        ...

    def driver_version(self) -> str: ...
    def device_count(self) -> int: ...
    def device_handle(self, index: int) -> DeviceHandle: ...
    def device_key(self, handle: DeviceHandle) -> int:
        """A number identifying the device behind a handle, equal for every handle to it."""
        ...

    def name(self, handle: DeviceHandle) -> str: ...
    def uuid(self, handle: DeviceHandle) -> str: ...
    def pci_bus_id(self, handle: DeviceHandle) -> str: ...
    def field_values(self, handle: DeviceHandle, field_ids: Sequence[int]) -> list[FieldReading]: ...
    def temperature(self, handle: DeviceHandle, sensor: int) -> int: ...
    def utilization(self, handle: DeviceHandle) -> tuple[int, int]:
        """(gpu percent, memory percent)."""
        ...

    def clock(self, handle: DeviceHandle, clock_type: int) -> int: ...
    def memory_used(self, handle: DeviceHandle) -> int:
        """Framebuffer memory in use by allocations, bytes: without what the driver reserves for
        itself, as nvidia-smi's memory.used and DCGM's FB_USED count it."""
        ...

    def clock_event_reasons(self, handle: DeviceHandle) -> int: ...
    def enforced_power_limit(self, handle: DeviceHandle) -> int:
        """Milliwatts."""
        ...

    def event_set_create(self) -> EventSet: ...
    def register_events(self, handle: DeviceHandle, event_types: int, event_set: EventSet) -> None: ...
    def wait_event(self, event_set: EventSet, timeout_ms: int) -> NvmlEvent | None:
        """The next event, or None when none arrived within `timeout_ms` (0: do not wait)."""
        ...

    def event_set_free(self, event_set: EventSet) -> None: ...


_T = TypeVar("_T")

# c_nvmlValue_t member holding the value, by nvmlValueType_t.
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")

# c_nvmlFieldValue_t as nvidia-ml-py declares it (fieldId, scopeId, timestamp, latencyUsec,
# valueType, nvmlReturn, value): unpacking the whole array at once is several times cheaper
# than pynvml's per-attribute access. Used only when pynvml's declared offsets match.
_FIELD_VALUE = struct.Struct("=IIqqii8s")
_FIELD_VALUE_OFFSETS = (0, 4, 8, 16, 24, 28, 32)
_VALUE_BY_TYPE = tuple(
    struct.Struct(f) for f in ("=d", "=I", "=Q" if ctypes.sizeof(ctypes.c_ulong) == 8 else "=I", "=Q", "=q", "=i", "=H")
)


def _packed_layout_matches(structure: Any) -> bool:
    offsets = tuple(getattr(structure, name).offset for name, _ in structure._fields_)
    return ctypes.sizeof(structure) == _FIELD_VALUE.size and offsets == _FIELD_VALUE_OFFSETS


class PynvmlClient:
    """`NvmlClient` over nvidia-ml-py. pynvml is imported on first use, not at import time."""

    def __init__(self) -> None:
        self._pynvml: Any = None
        self._unpack_fields = False
        self._memory_v1_only = False
        self.errors: Counter[str] = Counter()
        """Failed calls by NVML function (the daemon's gpufail_collector_nvml_errors_total)."""

    def _module(self) -> Any:
        if self._pynvml is None:
            try:
                import pynvml
            except ImportError as exc:  # the dependency is declared; this is a broken install
                self.errors["import pynvml"] += 1
                raise NvmlCallError("import pynvml", NVML_ERROR_LIBRARY_NOT_FOUND, str(exc)) from None
            self._pynvml = pynvml
            self._unpack_fields = _packed_layout_matches(pynvml.c_nvmlFieldValue_t)
        return self._pynvml

    def _call(self, call: str, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return fn(*args)
        except self._pynvml.NVMLError as exc:
            if exc.value not in NOT_AN_ERROR:
                self.errors[call] += 1
            raise NvmlCallError(call, exc.value, str(exc)) from None

    def init(self) -> None:
        nv = self._module()
        self._call("nvmlInit", nv.nvmlInit)

    def shutdown(self) -> None:
        self._call("nvmlShutdown", self._pynvml.nvmlShutdown)

    def constant(self, name: str) -> int | None:
        value = getattr(self._module(), name, None)
        return value if isinstance(value, int) else None

    def driver_version(self) -> str:
        return str(self._call("nvmlSystemGetDriverVersion", self._pynvml.nvmlSystemGetDriverVersion))

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount", self._pynvml.nvmlDeviceGetCount))

    def device_handle(self, index: int) -> DeviceHandle:
        return self._call("nvmlDeviceGetHandleByIndex", self._pynvml.nvmlDeviceGetHandleByIndex, index)

    def device_key(self, handle: DeviceHandle) -> int:
        # A handle is a pointer to the library's per-device structure; event data carries the
        # same pointer, so its address identifies the device.
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)

    def name(self, handle: DeviceHandle) -> str:
        return str(self._call("nvmlDeviceGetName", self._pynvml.nvmlDeviceGetName, handle))

    def uuid(self, handle: DeviceHandle) -> str:
        return str(self._call("nvmlDeviceGetUUID", self._pynvml.nvmlDeviceGetUUID, handle))

    def pci_bus_id(self, handle: DeviceHandle) -> str:
        info = self._call("nvmlDeviceGetPciInfo", self._pynvml.nvmlDeviceGetPciInfo, handle)
        bus_id = info.busId
        return bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)

    def field_values(self, handle: DeviceHandle, field_ids: Sequence[int]) -> list[FieldReading]:
        raw = self._call("nvmlDeviceGetFieldValues", self._pynvml.nvmlDeviceGetFieldValues, handle, list(field_ids))
        readings = _unpack_field_values(raw) if self._unpack_fields else self._field_readings(raw)
        failed = sum(1 for r in readings if r.code != NVML_SUCCESS and r.code not in NOT_AN_ERROR)
        if failed:
            self.errors["nvmlDeviceGetFieldValues"] += failed
        return readings

    def _field_readings(self, raw: Any) -> list[FieldReading]:
        readings = []
        for entry in raw:
            if entry.nvmlReturn != NVML_SUCCESS:
                readings.append(FieldReading(entry.nvmlReturn, None))
            elif 0 <= entry.valueType < len(_VALUE_MEMBERS):
                readings.append(FieldReading(NVML_SUCCESS, getattr(entry.value, _VALUE_MEMBERS[entry.valueType])))
            else:  # a value type newer than this binding: unreadable, not wrong
                readings.append(FieldReading(NVML_ERROR_NOT_SUPPORTED, None))
        return readings

    def temperature(self, handle: DeviceHandle, sensor: int) -> int:
        return int(self._call("nvmlDeviceGetTemperature", self._pynvml.nvmlDeviceGetTemperature, handle, sensor))

    def utilization(self, handle: DeviceHandle) -> tuple[int, int]:
        rates = self._call("nvmlDeviceGetUtilizationRates", self._pynvml.nvmlDeviceGetUtilizationRates, handle)
        return int(rates.gpu), int(rates.memory)

    def clock(self, handle: DeviceHandle, clock_type: int) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", self._pynvml.nvmlDeviceGetClockInfo, handle, clock_type))

    def memory_used(self, handle: DeviceHandle) -> int:
        # nvmlDeviceGetMemoryInfo (v1) counts the driver's reserved memory as used: an idle H100
        # on driver 580 reads 480 MiB where nvidia-smi and DCGM say 0. Version 2 reports the
        # reservation apart. A driver without it (before R510) keeps v1's figure.
        get = self._pynvml.nvmlDeviceGetMemoryInfo
        version = getattr(self._pynvml, "nvmlMemory_v2", None)  # older nvidia-ml-py lacks it
        if version is not None and not self._memory_v1_only:
            try:
                return int(self._call("nvmlDeviceGetMemoryInfo_v2", get, handle, version).used)
            except NvmlCallError as exc:
                if exc.code not in (NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
                    raise
                self._memory_v1_only = True
        return int(self._call("nvmlDeviceGetMemoryInfo", get, handle).used)

    def clock_event_reasons(self, handle: DeviceHandle) -> int:
        fn = self._pynvml.nvmlDeviceGetCurrentClocksEventReasons
        return int(self._call("nvmlDeviceGetCurrentClocksEventReasons", fn, handle))

    def enforced_power_limit(self, handle: DeviceHandle) -> int:
        fn = self._pynvml.nvmlDeviceGetEnforcedPowerLimit
        return int(self._call("nvmlDeviceGetEnforcedPowerLimit", fn, handle))

    def event_set_create(self) -> EventSet:
        return self._call("nvmlEventSetCreate", self._pynvml.nvmlEventSetCreate)

    def register_events(self, handle: DeviceHandle, event_types: int, event_set: EventSet) -> None:
        self._call("nvmlDeviceRegisterEvents", self._pynvml.nvmlDeviceRegisterEvents, handle, event_types, event_set)

    def wait_event(self, event_set: EventSet, timeout_ms: int) -> NvmlEvent | None:
        try:
            data = self._pynvml.nvmlEventSetWait_v2(event_set, timeout_ms)
        except self._pynvml.NVMLError as exc:
            if exc.value == NVML_ERROR_TIMEOUT:
                return None
            self.errors["nvmlEventSetWait"] += 1
            raise NvmlCallError("nvmlEventSetWait", exc.value, str(exc)) from None
        return NvmlEvent(self.device_key(data.device), int(data.eventType), int(data.eventData))

    def event_set_free(self, event_set: EventSet) -> None:
        self._call("nvmlEventSetFree", self._pynvml.nvmlEventSetFree, event_set)


def _unpack_field_values(raw: Any) -> list[FieldReading]:
    """Decode a c_nvmlFieldValue_t array from its bytes (layout checked by `_packed_layout_matches`)."""
    readings = []
    for _, _, _, _, value_type, code, value in _FIELD_VALUE.iter_unpack(ctypes.string_at(raw, ctypes.sizeof(raw))):
        if code != NVML_SUCCESS:
            readings.append(FieldReading(code, None))
        elif 0 <= value_type < len(_VALUE_BY_TYPE):
            readings.append(FieldReading(NVML_SUCCESS, _VALUE_BY_TYPE[value_type].unpack_from(value)[0]))
        else:
            readings.append(FieldReading(NVML_ERROR_NOT_SUPPORTED, None))
    return readings
