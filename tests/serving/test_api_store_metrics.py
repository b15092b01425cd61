"""`GET /metrics` of a real `gpufail serve`: what the alerting rules read about the jobs sharing
its data root (the publish policy's state, the nightly job's state, recent failure XIDs), and
a store file that cannot be read leaving only its own series out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufail.nightly import STATE as NIGHTLY_STATE_OF_THE_JOB
from ingest.store import Store
from serving.api_metrics import NIGHTLY_STATE
from serving.policy import BreakerState, NodeState, PolicyState
from tests.conftest import make_rows
from tests.serving.api_server import serve_test_fleet

pytestmark = pytest.mark.slow


def samples(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_state_of_publishing_nightly_and_failures_is_exported(tmp_path):
    now = datetime.now(UTC)
    server = serve_test_fleet(tmp_path)
    try:
        store = Store.open(str(tmp_path / "data"))
        policy = PolicyState(
            nodes={
                "c/n1": NodeState(tier="drain_now", applied="drain_now"),
                "c/n2": NodeState(tier="drain_after_job", applied="drain_after_job"),
                "c/n3": NodeState(tier="avoid", applied="none"),  # not yet told to the scheduler
            },
            breaker=BreakerState(
                tripped_at=now - timedelta(hours=1),
                reason="test",
                raised=((now - timedelta(hours=2), "c/n1"), (now - timedelta(hours=30), "c/n9")),
            ),
        )
        store.write_state("publish-kubernetes", policy.to_json())
        store.write_state(
            NIGHTLY_STATE,
            {"day": "2026-03-04", "steps": {}, "started_at": "2026-03-05T02:30:00+00:00", "failed": {"step": "train"}},
        )
        recent = [now - timedelta(hours=h) for h in (1, 2, 3, 30)]
        store.write(
            "xid_events",
            make_rows(
                "xid_events",
                recent,
                node="n1",
                pci_bus_id="0000:18:00.0",
                gpu_uuid=["GPU-a", "GPU-a", "GPU-b", "GPU-c"],  # GPU-c's is older than a day
                xid=[79, 48, 13, 79],  # 13 is not a failure XID
            ),
        )
        got = samples(server)
        state = (("state", "publish-kubernetes"),)
        assert got[("gpufail_published_nodes", (*state, ("tier", "drain_now")))] == 1
        assert got[("gpufail_published_nodes", (*state, ("tier", "drain_after_job")))] == 1
        assert ("gpufail_published_nodes", (*state, ("tier", "avoid"))) not in got
        assert got[("gpufail_breaker_open", state)] == 1
        assert got[("gpufail_breaker_raised_nodes", state)] == 1  # the other raise left the 24 h window
        assert got[("gpufail_breaker_limit_nodes", state)] == 2  # max(2, 5% of the fleet's nodes)
        assert (
            got[("gpufail_nightly_last_started_timestamp_seconds", ())]
            == datetime(2026, 3, 5, 2, 30, tzinfo=UTC).timestamp()
        )
        assert ("gpufail_nightly_last_completed_timestamp_seconds", ()) not in got
        assert got[("gpufail_nightly_failed", (("step", "train"),))] == 1
        assert got[("gpufail_failed_gpus_24h", ())] == 1

        # A corrupt policy state: its series are left out, the rest (and the scrape) stay.
        (tmp_path / "data" / "_state" / "publish-kubernetes.json").write_text("{not json")
        store.write_state(
            NIGHTLY_STATE,
            {
                "day": "2026-03-05",
                "steps": {},
                "started_at": "2026-03-06T02:30:00+00:00",
                "completed_at": "2026-03-06T02:40:00+00:00",
            },
        )
        got = samples(server)
        assert not [key for key in got if key[0].startswith(("gpufail_published_nodes", "gpufail_breaker_"))]
        assert (
            got[("gpufail_nightly_last_completed_timestamp_seconds", ())]
            == datetime(2026, 3, 6, 2, 40, tzinfo=UTC).timestamp()
        )
        assert not [key for key in got if key[0] == "gpufail_nightly_failed"]
        assert got[("gpufail_ready", ())] == 1
        assert "publish policy state not exported" in server.logs()
    finally:
        server.stop()


def test_the_nightly_state_name_is_the_jobs():
    assert NIGHTLY_STATE == NIGHTLY_STATE_OF_THE_JOB
