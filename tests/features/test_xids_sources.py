"""An XID seen by both the NVML collector and the kernel log is one incident, not two."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import polars as pl

from features.xids import drop_cross_source_duplicates

T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)


def _events(rows: list[tuple[str, str, int, datetime]]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "source": [r[0] for r in rows],
            "node": ["n1"] * len(rows),
            "pci_bus_id": [r[1] for r in rows],
            "xid": [r[2] for r in rows],
            "ts": [r[3] for r in rows],
            "last_ts": [r[3] for r in rows],
        }
    )


def test_the_nvml_copy_of_a_kernel_log_xid_is_dropped_and_the_kernel_row_kept() -> None:
    events = _events(
        [
            ("kmsg", "0000:3b:00", 79, T0),
            ("nvml", "0000:3b:00", 79, T0 + timedelta(seconds=30)),  # read at the next collect
        ]
    )
    kept = drop_cross_source_duplicates(events)
    assert kept["source"].to_list() == ["kmsg"]


def test_nvml_rows_without_a_kernel_twin_are_kept() -> None:
    events = _events(
        [
            ("kmsg", "0000:3b:00", 79, T0),
            ("nvml", "0000:3b:00", 48, T0),  # another XID
            ("nvml", "0000:86:00", 79, T0),  # another GPU
            ("nvml", "0000:3b:00", 79, T0 + timedelta(hours=2)),  # a later incident
        ]
    )
    kept = drop_cross_source_duplicates(events)
    assert kept.height == 4


def test_two_kernel_log_sources_are_never_deduplicated_against_each_other() -> None:
    # kernel-log incidents are already folded by the parser; only NVML rows are candidates
    events = _events([("kmsg", "0000:3b:00", 13, T0), ("file:syslog", "0000:3b:00", 13, T0)])
    assert drop_cross_source_duplicates(events).height == 2


def test_a_frame_without_nvml_rows_is_returned_unchanged() -> None:
    events = _events([("kmsg", "0000:3b:00", 13, T0)])
    assert drop_cross_source_duplicates(events).equals(events)
