import pyarrow as pa
import pytest

from ingest.schema import (
    SCHEMA_VERSION,
    metric_catalogue,
    metric_columns,
    normalise_pci_bus_id,
    schema_for,
    telemetry_schema,
)

UNITS = ("_c", "_w", "_pct", "_mhz", "_mib", "_total", "_pending", "_failure", "_reasons")


def test_every_metric_column_names_its_unit_and_has_a_known_kind():
    for metric in metric_catalogue():
        assert metric.column.endswith(UNITS), metric.column
        assert metric.kind in ("gauge", "counter", "flag", "bitmask")
        # Counters are cumulative: their names say so, and they are integers.
        assert (metric.kind == "counter") == metric.column.endswith("_total"), metric.column
        if metric.kind == "counter":
            assert metric.arrow_type == pa.int64()


def test_telemetry_schema_has_identity_then_every_catalogued_metric():
    schema = telemetry_schema()
    assert schema.names[:5] == ["ts", "cluster", "node", "gpu_index", "gpu_uuid"]
    assert schema.field("ts").type == pa.timestamp("us", tz="UTC")
    assert set(metric_columns()) <= set(schema.names)
    assert set(metric_columns("counter")) >= {
        "ecc_dbe_volatile_total",
        "pcie_replay_total",
        "remapped_rows_uncorrectable_total",
    }
    assert schema.metadata[b"gpufail.schema_version"] == str(SCHEMA_VERSION).encode()


def test_xid_events_schema_matches_the_architecture():
    names = schema_for("xid_events").names
    for column in (
        "ts",
        "node",
        "pci_bus_id",
        "gpu_index",
        "gpu_uuid",
        "xid",
        "pid",
        "process",
        "message",
        "source",
        "repeat_count",
    ):
        assert column in names


def test_unknown_dataset_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown dataset 'telemetri'.*telemetry"):
        schema_for("telemetri")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:3B:00.0", "0000:3b:00"),
        ("0000:b3:00.0", "0000:b3:00"),
        ("PCI:0000:0b:00", "0000:0b:00"),
        ("0001:6c:00", "0001:6c:00"),
    ],
)
def test_pci_bus_ids_from_nvml_and_the_kernel_log_normalise_alike(raw, expected):
    assert normalise_pci_bus_id(raw) == expected


@pytest.mark.parametrize("raw", ["3b:00", "zz:3b:00.0", ""])
def test_malformed_pci_bus_id_is_refused(raw):
    with pytest.raises(ValueError, match="PCI bus id"):
        normalise_pci_bus_id(raw)
