"""The NVML collector against a fake libnvidia-ml.so.1 (tests/fake_nvml) through the real
nvidia-ml-py code path, with readings from real nvidia-smi captures (tests/fixtures/nvml), and
against a real GPU where one is present (marker `gpu`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from ingest.collect.base import Collector, CollectorError
from ingest.collect.nvml_client import NVML_ERROR_GPU_IS_LOST, NvmlCallError, PynvmlClient
from ingest.collect.nvml_collector import NvmlCollector
from ingest.collect.nvml_metrics import nvml_sources, parse_nvml_sources
from ingest.schema import metric_columns, schema_for
from tests.fake_nvml.scenario import field_id, scenario_from_capture

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nvml"
H100, A100, T4 = FIXTURES / "qx-h100.xml", FIXTURES / "qx-a100.xml", FIXTURES / "qx-t4.xml"
REPO = Path(__file__).parents[2]
T0 = datetime(2026, 8, 21, 8, 54, tzinfo=UTC)


class StepClock:
    """Each now() is one minute after the previous one; never sleeps."""

    def __init__(self) -> None:
        self.ts = T0 - timedelta(minutes=1)

    def now(self) -> datetime:
        self.ts += timedelta(minutes=1)
        return self.ts

    def monotonic(self) -> float:
        return (self.ts - T0).total_seconds()

    def sleep(self, seconds: float) -> None:
        self.ts += timedelta(seconds=seconds)


@pytest.fixture
def make_collector() -> Iterator[Callable[..., NvmlCollector]]:
    made: list[NvmlCollector] = []

    def make(**kwargs: object) -> NvmlCollector:
        collector = NvmlCollector("test-cluster", "node-01", clock=StepClock(), **kwargs)  # type: ignore[arg-type]
        made.append(collector)
        return collector

    yield make
    for collector in made:
        collector.close()


def rows(table: pa.Table) -> list[dict[str, object]]:
    return table.to_pylist()


# ---- normal GPUs ----


def test_reads_every_gpu_of_a_real_h100_node(use_scenario, make_collector) -> None:
    use_scenario(scenario_from_capture(H100, nvlink_counters=True))
    collector = make_collector()
    assert isinstance(collector, Collector)

    out = collector.collect()

    telemetry = out["telemetry"]
    assert telemetry.schema == schema_for("telemetry")
    assert out["xid_events"].schema == schema_for("xid_events") and out["xid_events"].num_rows == 0
    assert telemetry.num_rows == 8
    first = rows(telemetry)[0]
    # GPU 0 of qx-h100.xml, as nvidia-smi printed it
    assert first["ts"] == T0
    assert (first["cluster"], first["node"], first["gpu_index"]) == ("test-cluster", "node-01", 0)
    assert first["gpu_uuid"] == "GPU-00000000-0000-0000-0000-000000000000"
    assert first["pci_bus_id"] == "0000:53:00"
    assert first["gpu_model"] == "NVIDIA H100 80GB HBM3"
    assert first["driver"] == "580.105.08"
    assert first["temp_gpu_c"] == 29.0
    assert first["temp_mem_c"] == 37.0
    assert first["power_w"] == pytest.approx(68.57)  # the 1-s average, not the instant 68.92
    assert first["power_limit_w"] == 700.0
    assert (first["sm_clock_mhz"], first["mem_clock_mhz"]) == (345.0, 2619.0)
    assert (first["util_gpu_pct"], first["util_mem_pct"], first["fb_used_mib"]) == (0.0, 0.0, 0.0)
    assert first["clock_event_reasons"] == 1  # GPU idle
    assert first["pcie_replay_total"] == 150
    assert first["power_violation_us_total"] == 7015662857
    assert first["ecc_dbe_volatile_total"] == 0 and first["remapped_rows_failure"] == 0
    assert first["nvlink_replay_errors_total"] == 0
    assert first["retired_pages_sbe_total"] is None  # N/A on Hopper: row remapping instead
    buses = [r["pci_bus_id"] for r in rows(telemetry)]
    assert buses == [
        "0000:53:00",
        "0000:64:00",
        "0000:75:00",
        "0000:86:00",
        "0000:97:00",
        "0000:a8:00",
        "0000:b9:00",
        "0000:ca:00",
    ]
    assert [r["gpu_uuid"] for r in rows(telemetry)] == [f"GPU-{i:08d}-0000-0000-0000-{i:012d}" for i in range(8)]


def test_a100_without_a_one_second_average_reports_instant_power(use_scenario, make_collector) -> None:
    use_scenario(scenario_from_capture(A100))
    row = rows(make_collector().collect()["telemetry"])[0]
    assert row["power_w"] == pytest.approx(49.68)
    assert row["power_limit_w"] == 400.0
    assert row["temp_mem_c"] == 34.0
    assert row["pci_bus_id"] == "0000:06:00"


def test_readings_a_t4_lacks_are_null_and_its_own_are_read(use_scenario, make_collector) -> None:
    use_scenario(scenario_from_capture(T4))
    row = rows(make_collector().collect()["telemetry"])[0]
    assert row["temp_mem_c"] is None  # GDDR6: no memory temperature sensor
    assert row["remapped_rows_correctable_total"] is None and row["remapped_rows_failure"] is None
    assert row["nvlink_crc_flit_errors_total"] is None
    assert (row["retired_pages_sbe_total"], row["retired_pages_dbe_total"], row["retired_pages_pending"]) == (0, 0, 0)
    assert row["ecc_sbe_aggregate_total"] == 1  # the one DRAM correctable error in the capture
    assert row["pci_bus_id"] == "0000:00:1e"


def test_power_limit_falls_back_to_the_enforced_limit_getter(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(A100)
    del scenario.gpus[0].fields[field_id("NVML_FI_DEV_POWER_CURRENT_LIMIT")]
    scenario.gpus[0].power_limit_mw = 250_000
    use_scenario(scenario)
    assert rows(make_collector().collect()["telemetry"])[0]["power_limit_w"] == 250.0


def test_a_memory_temperature_of_zero_is_a_missing_reading(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(A100)
    scenario.gpus[0].set_field("NVML_FI_DEV_MEMORY_TEMP", 0, value_type=1)
    use_scenario(scenario)
    assert rows(make_collector().collect()["telemetry"])[0]["temp_mem_c"] is None


# An H100 on driver 580.159.04 under a matrix-multiply load (gpufail's device run, 2026-11-24):
# nvidia-smi's memory.used 1139 MiB, its reservation 480 MiB; NVML's v1 memory call said 1618.8.
USED_MIB, RESERVED_MIB = 1139, 480


def test_memory_used_leaves_out_the_drivers_reservation_as_nvidia_smi_does(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(H100)
    scenario.gpus = scenario.gpus[:1]
    scenario.gpus[0].memory = (81559 << 20, USED_MIB << 20, RESERVED_MIB << 20)
    fake = use_scenario(scenario)
    collector = make_collector()
    assert [rows(collector.collect()["telemetry"])[0]["fb_used_mib"] for _ in range(2)] == [USED_MIB] * 2
    assert fake.call_count("nvmlDeviceGetMemoryInfo_v2") == 2
    assert fake.call_count("nvmlDeviceGetMemoryInfo") == 0


def test_a_driver_without_memory_info_v2_reports_v1s_figure_and_is_asked_v2_once(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(H100)
    scenario.gpus = scenario.gpus[:2]
    for gpu in scenario.gpus:
        gpu.memory = (81559 << 20, USED_MIB << 20, RESERVED_MIB << 20)
    scenario.memory_v2 = False
    fake = use_scenario(scenario)
    collector = make_collector()
    for _ in range(3):
        used = [r["fb_used_mib"] for r in rows(collector.collect()["telemetry"])]
        assert used == [USED_MIB + RESERVED_MIB] * 2  # v1 counts the reservation; nothing better to read
    assert fake.call_count("nvmlDeviceGetMemoryInfo_v2") == 1
    assert fake.call_count("nvmlDeviceGetMemoryInfo") == 3 * 2


class _AttributeDecoding(PynvmlClient):
    """The real client made to read field values through pynvml's structure attributes, the path
    it takes when nvidia-ml-py declares a c_nvmlFieldValue_t layout it cannot unpack directly."""

    def _module(self) -> object:
        module = super()._module()
        self._unpack_fields = False
        return module


@pytest.mark.parametrize("client", [PynvmlClient, _AttributeDecoding])
def test_every_field_value_type_is_decoded(use_scenario, make_collector, client) -> None:
    scenario = scenario_from_capture(A100)
    scenario.gpus[0].field_errors[field_id("NVML_FI_DEV_RETIRED_SBE")] = 3  # not supported
    for value_type in range(7):  # double, uint, ulong, ulonglong, slonglong, sint, ushort
        scenario.gpus[0].set_field("NVML_FI_DEV_PCIE_REPLAY_COUNTER", 4242, value_type=value_type)
        use_scenario(scenario)
        collector = make_collector(client=client())
        row = rows(collector.collect()["telemetry"])[0]
        assert row["pcie_replay_total"] == 4242, value_type
        assert row["retired_pages_sbe_total"] is None
        assert row["temp_mem_c"] == 34.0
        collector.close()


def test_counters_move_between_calls_and_stay_cumulative(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(H100, nvlink_counters=True)
    scenario.gpus[2].set_field("NVML_FI_DEV_ECC_SBE_VOL_TOTAL", 10, step=3)
    scenario.gpus[2].set_field("NVML_FI_DEV_ECC_DBE_AGG_TOTAL", 0, step=1)
    scenario.gpus[2].set_field("NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", 100, step=50)
    use_scenario(scenario)
    collector = make_collector()

    samples = [rows(collector.collect()["telemetry"])[2] for _ in range(3)]

    assert [s["ecc_sbe_volatile_total"] for s in samples] == [10, 13, 16]
    assert [s["ecc_dbe_aggregate_total"] for s in samples] == [0, 1, 2]
    assert [s["nvlink_crc_data_errors_total"] for s in samples] == [100, 150, 200]
    assert [s["ts"] for s in samples] == [T0, T0 + timedelta(minutes=1), T0 + timedelta(minutes=2)]


def test_one_batched_field_read_per_gpu_and_static_attributes_read_once(use_scenario, make_collector) -> None:
    fake = use_scenario(scenario_from_capture(H100, nvlink_counters=True))
    collector = make_collector()
    for _ in range(3):
        collector.collect()
    assert fake.call_count("nvmlDeviceGetFieldValues") == 3 * 8
    for static in (
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetPciInfo_v3",
    ):
        assert fake.call_count(static) == 8, static
    assert fake.call_count("nvmlSystemGetDriverVersion") == 1
    assert fake.call_count("nvmlInitWithFlags") == 1
    assert fake.call_count("nvmlDeviceGetUtilizationRates") == 3 * 8  # one call for both columns


def test_a_getter_the_board_does_not_support_is_not_asked_again(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(T4)
    scenario.gpus[0].temp = None
    fake = use_scenario(scenario)
    collector = make_collector()
    samples = [rows(collector.collect()["telemetry"])[0] for _ in range(3)]
    assert [s["temp_gpu_c"] for s in samples] == [None, None, None]
    assert fake.call_count("nvmlDeviceGetTemperature") == 1


# ---- lost GPUs ----


def test_a_gpu_lost_mid_run_is_one_xid_79_event_and_the_others_keep_being_read(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(H100, nvlink_counters=True)
    scenario.gpus[3].fail_after = (1, NVML_ERROR_GPU_IS_LOST)
    use_scenario(scenario)
    collector = make_collector()

    first, second, third = collector.collect(), collector.collect(), collector.collect()

    assert first["telemetry"].num_rows == 8 and first["xid_events"].num_rows == 0
    assert [r["gpu_index"] for r in rows(second["telemetry"])] == [0, 1, 2, 4, 5, 6, 7]
    (event,) = rows(second["xid_events"])
    assert second["xid_events"].schema == schema_for("xid_events")
    assert event["xid"] == 79 and event["source"] == "nvml" and event["repeat_count"] == 1
    assert (event["gpu_index"], event["gpu_uuid"], event["pci_bus_id"]) == (
        3,
        "GPU-00000003-0000-0000-0000-000000000003",
        "0000:86:00",
    )
    assert "GPU is lost" in event["message"]
    assert event["ts"] == event["last_ts"] == T0 + timedelta(minutes=1)
    assert third["telemetry"].num_rows == 7 and third["xid_events"].num_rows == 0  # reported once


def test_a_gpu_that_stops_answering_is_recorded_as_lost(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(H100, nvlink_counters=True)
    scenario.gpus[6].fail_after = (2, 10)  # NVML_ERROR_TIMEOUT
    use_scenario(scenario)
    collector = make_collector()
    outs = [collector.collect() for _ in range(3)]
    assert [o["telemetry"].num_rows for o in outs] == [8, 8, 7]
    (event,) = rows(outs[2]["xid_events"])
    assert event["gpu_index"] == 6 and event["xid"] == 79 and "Timeout" in event["message"]


def test_a_gpu_lost_before_the_first_call_is_an_event_without_identity(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(H100, nvlink_counters=True)
    scenario.gpus[5].fail_after = (0, NVML_ERROR_GPU_IS_LOST)
    use_scenario(scenario)
    out = make_collector().collect()
    assert [r["gpu_index"] for r in rows(out["telemetry"])] == [0, 1, 2, 3, 4, 6, 7]
    (event,) = rows(out["xid_events"])
    assert (event["gpu_index"], event["gpu_uuid"], event["pci_bus_id"], event["xid"]) == (5, None, "unknown", 79)


def test_a_field_that_reports_the_gpu_lost_marks_the_gpu_lost(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(A100)
    scenario.gpus[0].field_errors[field_id("NVML_FI_DEV_ECC_DBE_VOL_TOTAL")] = NVML_ERROR_GPU_IS_LOST
    use_scenario(scenario)
    out = make_collector().collect()
    assert out["telemetry"].num_rows == 0
    assert [r["xid"] for r in rows(out["xid_events"])] == [79]


@pytest.mark.parametrize("client", [PynvmlClient, _AttributeDecoding])
def test_failed_calls_are_counted_by_function_and_unsupported_readings_are_not(
    use_scenario, make_collector, client
) -> None:
    scenario = scenario_from_capture(H100)
    scenario.gpus[0].field_errors[field_id("NVML_FI_DEV_RETIRED_SBE")] = 3  # not supported: asked once
    scenario.gpus[1].field_errors[field_id("NVML_FI_DEV_PCIE_REPLAY_COUNTER")] = 999  # unknown error
    scenario.gpus[2].fail_after = (1, NVML_ERROR_GPU_IS_LOST)
    use_scenario(scenario)
    collector = make_collector(client=client())
    assert collector.counts() == {"nvml_errors": {}, "out_of_range": {}}
    for _ in range(3):
        collector.collect()
    errors = collector.counts()["nvml_errors"]
    # GPU 1's field fails in each of the 3 batched reads; GPU 2 answers once, then is lost twice.
    assert errors["nvmlDeviceGetFieldValues"] == 3 + 2
    assert set(errors) == {"nvmlDeviceGetFieldValues"}


class _LostOnCalls(PynvmlClient):
    """The real client, except GPU 1's temperature read says GPU_IS_LOST on chosen calls."""

    def __init__(self, lost_on: set[int]) -> None:
        super().__init__()
        self.lost_on, self.calls = lost_on, 0

    def temperature(self, handle: object, sensor: int) -> int:
        if self.uuid(handle).endswith("0001"):
            self.calls += 1
            if self.calls in self.lost_on:
                raise NvmlCallError("nvmlDeviceGetTemperature", NVML_ERROR_GPU_IS_LOST, "GPU is lost")
        return super().temperature(handle, sensor)


def test_a_gpu_that_answers_again_is_read_again_and_a_new_loss_is_a_new_event(use_scenario, make_collector) -> None:
    use_scenario(scenario_from_capture(H100, nvlink_counters=True))
    collector = make_collector(client=_LostOnCalls(lost_on={2, 3, 5}))
    outs = [collector.collect() for _ in range(5)]
    assert [o["telemetry"].num_rows for o in outs] == [8, 7, 7, 8, 7]
    assert [o["xid_events"].num_rows for o in outs] == [0, 1, 0, 0, 1]


# ---- XID events ----


def test_xid_events_are_read_without_blocking_and_folded_per_gpu_and_xid(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(H100, nvlink_counters=True)
    scenario.events = [(1, 48, 1), (1, 48, 1), (1, 63, 1), (5, 94, 2)]
    fake = use_scenario(scenario)
    collector = make_collector()

    first, second, third = collector.collect(), collector.collect(), collector.collect()

    assert fake.last_wait_timeout_ms() == 0
    assert first["xid_events"].schema == schema_for("xid_events")
    got = sorted((r["gpu_index"], r["xid"], r["repeat_count"]) for r in rows(first["xid_events"]))
    assert got == [(1, 48, 2), (1, 63, 1)]
    (late,) = rows(second["xid_events"])
    assert (late["gpu_index"], late["xid"], late["gpu_uuid"], late["pci_bus_id"], late["source"]) == (
        5,
        94,
        "GPU-00000005-0000-0000-0000-000000000005",
        "0000:a8:00",
        "nvml",
    )
    assert late["ts"] == T0 + timedelta(minutes=1)
    assert third["xid_events"].num_rows == 0


def test_a_gpu_without_event_support_still_reports_telemetry(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(A100)
    scenario.gpus[0].supported_events = 0
    scenario.events = [(0, 13, 0)]
    use_scenario(scenario)
    out = make_collector().collect()
    assert out["telemetry"].num_rows == 1 and out["xid_events"].num_rows == 0


def test_an_event_set_that_reports_an_error_stops_the_drain_not_the_collection(use_scenario, make_collector) -> None:
    class WaitFails(PynvmlClient):
        def wait_event(self, event_set: object, timeout_ms: int) -> None:
            raise NvmlCallError("nvmlEventSetWait", NVML_ERROR_GPU_IS_LOST, "GPU is lost")

    scenario = scenario_from_capture(H100, nvlink_counters=True)
    scenario.events = [(0, 48, 0)]
    use_scenario(scenario)
    collector = make_collector(client=WaitFails())
    outs = [collector.collect() for _ in range(2)]
    assert [(o["telemetry"].num_rows, o["xid_events"].num_rows) for o in outs] == [(8, 0), (8, 0)]


# ---- the library as a whole failing ----


def test_driver_not_loaded_is_one_clear_collector_error_and_a_later_call_retries(use_scenario, make_collector) -> None:
    scenario = scenario_from_capture(A100)
    scenario.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    use_scenario(scenario)
    collector = make_collector()

    with pytest.raises(CollectorError) as caught:
        collector.collect()
    message = str(caught.value)
    assert "\n" not in message
    assert "node-01" in message and "driver is not loaded" in message and "Driver Not Loaded" in message

    scenario.init_error = None  # the driver was loaded meanwhile
    use_scenario(scenario)
    assert collector.collect()["telemetry"].num_rows == 1


def test_an_unreadable_device_list_is_a_collector_error_and_nvml_is_shut_down(use_scenario, make_collector) -> None:
    class CountFails(PynvmlClient):
        def device_count(self) -> int:
            raise NvmlCallError("nvmlDeviceGetCount", 999, "Unknown Error")

    fake = use_scenario(scenario_from_capture(A100))
    with pytest.raises(CollectorError, match="cannot list the GPUs.*nvmlDeviceGetCount: Unknown Error"):
        make_collector(client=CountFails()).collect()
    assert fake.call_count("nvmlShutdown") == 1


def test_close_frees_the_event_set_and_shuts_nvml_down_once(use_scenario, make_collector) -> None:
    fake = use_scenario(scenario_from_capture(A100))
    collector = make_collector()
    collector.collect()
    collector.close()
    collector.close()
    assert fake.call_count("nvmlEventSetFree") == 1
    assert fake.call_count("nvmlShutdown") == 1


def test_close_still_shuts_nvml_down_when_freeing_the_event_set_fails(use_scenario, make_collector) -> None:
    class FreeFails(PynvmlClient):
        def event_set_free(self, event_set: object) -> None:
            raise NvmlCallError("nvmlEventSetFree", 999, "Unknown Error")

    fake = use_scenario(scenario_from_capture(A100))
    collector = make_collector(client=FreeFails())
    collector.collect()
    collector.close()
    assert fake.call_count("nvmlShutdown") == 1


def _real_nvml_present() -> bool:
    """Whether nvmlInit works with this machine's own library, tried in a clean process."""
    probe = "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError:\n    raise SystemExit(1)\n"
    env = {k: v for k, v in os.environ.items() if k != "FAKE_NVML_CONFIG"}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


def test_no_nvml_library_is_one_clear_collector_error() -> None:
    if _real_nvml_present():
        pytest.skip("this machine has a working libnvidia-ml.so.1")
    script = (
        "from ingest.collect.base import CollectorError\n"
        "from ingest.collect.nvml_collector import NvmlCollector\n"
        "try:\n"
        "    NvmlCollector('c', 'n1').collect()\n"
        "except CollectorError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.count("\n") == 1
    assert "libnvidia-ml.so.1 was not found" in result.stdout and "n1" in result.stdout


# ---- the metric mapping (data) ----


def test_every_telemetry_metric_has_an_nvml_source() -> None:
    assert {s.column for s in nvml_sources()} == set(metric_columns())


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ("temp_gpu_f,temperature,NVML_TEMPERATURE_GPU,1,false,", "column 'temp_gpu_f' is not a telemetry"),
        ("temp_gpu_c,thermometer,NVML_TEMPERATURE_GPU,1,false,", "getter 'thermometer'"),
        ("util_gpu_pct,utilization,decoder,1,false,", "utilization argument 'decoder'"),
        ("ecc_sbe_volatile_total,field,3,1,false,", "needs an NVML_* constant"),
        ("power_w,field,NVML_FI_DEV_POWER_INSTANT,0,false,", "divisor '0'"),
        ("power_w,field,NVML_FI_DEV_POWER_INSTANT,1000,maybe,", "zero_is_missing 'maybe'"),
    ],
)
def test_a_bad_mapping_row_names_file_line_and_field(row: str, expected: str) -> None:
    text = (
        "column,getter,argument,divisor,zero_is_missing,note\ntemp_gpu_c,temperature,NVML_TEMPERATURE_GPU,1,false,\n"
        + row
    )
    with pytest.raises(ValueError, match=r"my.csv line 3: ") as caught:
        parse_nvml_sources(text, "my.csv")
    assert expected in str(caught.value)


def test_a_field_this_nvidia_ml_py_lacks_is_skipped_not_fatal(use_scenario, make_collector) -> None:
    use_scenario(scenario_from_capture(A100))
    text = (
        "column,getter,argument,divisor,zero_is_missing,note\n"
        "power_w,field,NVML_FI_DEV_POWER_FROM_THE_FUTURE,1000,false,\n"
        "power_w,field,NVML_FI_DEV_POWER_INSTANT,1000,false,\n"
    )
    row = rows(make_collector(sources=parse_nvml_sources(text, "t.csv")).collect()["telemetry"])[0]
    assert row["power_w"] == pytest.approx(49.68)
    assert row["temp_gpu_c"] is None  # not in this mapping


# ---- a real GPU ----


@pytest.mark.gpu
def test_collects_every_gpu_of_this_machine() -> None:
    if not _real_nvml_present():
        pytest.skip("no NVIDIA GPU: nvmlInit fails with this machine's libnvidia-ml.so.1")
    # In its own process: this one may have loaded the fake library under the same name.
    script = (
        "import json\n"
        "from ingest.collect.nvml_collector import NvmlCollector\n"
        "c = NvmlCollector('real', 'this-node')\n"
        "outs = [c.collect(), c.collect()]\n"
        "c.close()\n"
        "import pynvml\n"
        "pynvml.nvmlInit()\n"
        "print(json.dumps({'count': pynvml.nvmlDeviceGetCount(),\n"
        "    'rows': [o['telemetry'].num_rows for o in outs],\n"
        "    'first': outs[1]['telemetry'].slice(0, 1).to_pylist()[0]}, default=str))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FAKE_NVML_CONFIG"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["rows"] == [report["count"], report["count"]]
    first = report["first"]
    assert first["gpu_uuid"].startswith(("GPU-", "MIG-"))
    assert first["pci_bus_id"].count(":") == 2 and first["driver"]
    assert 0 < first["temp_gpu_c"] < 120
    assert first["power_w"] is not None and first["power_w"] > 0
    assert first["fb_used_mib"] is not None and first["sm_clock_mhz"] is not None
    if shutil.which("nvidia-smi"):
        # the same memory figure as nvidia-smi: without the driver's reservation (480 MiB on an H100)
        query = ["nvidia-smi", f"--id={first['gpu_uuid']}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        smi_used = float(subprocess.run(query, capture_output=True, text=True, check=True).stdout)
        assert abs(first["fb_used_mib"] - smi_used) < 256, (first["fb_used_mib"], smi_used)
