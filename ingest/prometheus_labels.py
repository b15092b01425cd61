"""Which labels of a Prometheus series name the GPU it belongs to (`[ingest.prometheus] labels`).

Kept apart from the mapping of readings (`ingest.prometheus_rows`) so that a command that has
nothing to import (a rerun) does not load it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ingest.schema import normalise_pci_bus_id

DEFAULT_LABELS: dict[str, str] = {
    "node": "Hostname",
    "gpu_uuid": "UUID",
    "gpu_index": "gpu",
    "pci_bus_id": "pci_bus_id",
    "gpu_model": "modelName",
    "driver": "DCGM_FI_DRIVER_VERSION",
}
"""gpufail's identity column -> the dcgm-exporter label that holds it; `[ingest.prometheus]
labels` replaces any of them (and may name a `cluster` label)."""
IDENTITY_FIELDS = (*DEFAULT_LABELS, "cluster")


GpuKey = tuple[str, str, int, str]
"""cluster, node, GPU index, UUID."""
Attributes = tuple[str | None, str | None, str | None]
"""pci_bus_id, gpu_model, driver."""


@dataclass(frozen=True)
class LabelMap:
    """Which label holds each identity column (`DEFAULT_LABELS`, with the user's changes)."""

    labels: dict[str, str]
    cluster: str
    """The cluster of series without a cluster label (or when none is mapped)."""

    @classmethod
    def of(cls, overrides: dict[str, str] | None, cluster: str) -> LabelMap:
        return cls({**DEFAULT_LABELS, **(overrides or {})}, cluster)

    def identity(self, labels: dict[str, str]) -> tuple[GpuKey, Attributes] | str:
        """The GPU a series belongs to, or why it names none."""
        names = self.labels
        node, uuid, raw_index = labels.get(names["node"]), labels.get(names["gpu_uuid"]), labels.get(names["gpu_index"])
        if not node:
            return f"no {names['node']} label"
        if not uuid:
            return f"no {names['gpu_uuid']} label"
        if raw_index is None or raw_index == "":
            return f"no {names['gpu_index']} label"
        try:
            index = int(raw_index)
        except ValueError:
            index = -1
        if not 0 <= index < 2**15:
            return f"{names['gpu_index']} label not a GPU index"
        raw_bus = labels.get(names["pci_bus_id"])
        try:
            bus = normalise_pci_bus_id(raw_bus) if raw_bus else None
        except ValueError:
            return f"{names['pci_bus_id']} label not a PCI bus id"
        cluster = labels.get(names["cluster"]) or self.cluster if "cluster" in names else self.cluster
        key = (cluster, node, index, uuid)
        return key, (bus, labels.get(names["gpu_model"]) or None, labels.get(names["driver"]) or None)
