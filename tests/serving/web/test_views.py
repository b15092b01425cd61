"""What the pages compute before rendering: the at-risk table's query, filter and sort, the
rows' markup (escaped, cached per snapshot), the store reads of the node and actions pages,
and the breaker's view; plus a node name two clusters share."""

from __future__ import annotations

import itertools
import json
import re
from datetime import UTC, datetime, timedelta
from functools import cache
from html import unescape

import pandas as pd
import pytest

from ingest.errors import InputError
from ingest.store import Store
from serving.api_state import score_fleet
from serving.policy import TIERS, BreakerState, NodeState, PolicyConfig, PolicyState, Tier
from serving.publish import AuditRow, append_audit
from serving.web import html, reads, views
from tests.serving.api_server import fleet, trained_model

POLICY = PolicyConfig(
    tiers=(Tier("watch", 0.2, 0.1), Tier("avoid", 0.35, 0.25), Tier("drain_after_job", 0.5, 0.35)),
    breaker_max_nodes=2,
    breaker_max_fraction=0.0,
)
T0 = datetime(2026, 3, 4, tzinfo=UTC)


def latest() -> pd.DataFrame:
    features = fleet()[2].to_pandas()
    return features[features["ts"] == features["ts"].max()].reset_index(drop=True)


@cache
def scored():
    return score_fleet(trained_model(), latest(), POLICY, 5)


# -- the at-risk query -------------------------------------------------------------------------


def test_the_query_defaults_and_refusals():
    q = views.AtRiskQuery.parse({})
    assert (q.sort, q.order, q.limit, q.tier, q.q) == ("risk", "desc", views.DEFAULT_ROWS, "", "")
    assert views.AtRiskQuery.parse({"sort": "node"}).order == "asc"
    assert views.AtRiskQuery.parse({"sort": "node_risk"}).order == "desc"
    assert views.AtRiskQuery.parse({"q": "  node7  "}).q == "node7"
    with pytest.raises(InputError, match=r"query parameter limit: expected a whole number from 1 to 5000, got '5001'"):
        views.AtRiskQuery.parse({"limit": "5001"})
    with pytest.raises(InputError, match="query parameter sort"):
        views.AtRiskQuery.parse({"sort": "risk; drop"})


def test_query_parameters_leave_out_the_defaults():
    q = views.AtRiskQuery.parse({"q": "n1", "tier": "watch"})
    assert q.params() == {"q": "n1", "tier": "watch"}
    assert q.params(sort="node", order="asc") == {"q": "n1", "tier": "watch", "sort": "node", "order": "asc"}
    assert views.AtRiskQuery().params(limit=100) == {"limit": "100"}


def test_filter_sort_and_limit_over_the_fleet():
    f = scored()
    everything, n = views.at_risk(f, views.AtRiskQuery())
    assert everything == list(range(len(f.records))) and n == len(f.records)
    by_tier, _ = views.at_risk(f, views.AtRiskQuery.parse({"sort": "tier"}))
    ranks = [TIERS.index(f.records[i]["tier"]) for i in by_tier]
    assert ranks == sorted(ranks, reverse=True)
    for a, b in itertools.pairwise(by_tier):  # ties keep fleet rank order
        if f.records[a]["tier"] == f.records[b]["tier"]:
            assert a < b
    asc, _ = views.at_risk(f, views.AtRiskQuery.parse({"sort": "risk", "order": "asc"}))
    assert [f.records[i]["risk"] for i in asc] == sorted(r["risk"] for r in f.records)
    node = f.records[0]["node"]
    mine, n = views.at_risk(f, views.AtRiskQuery.parse({"q": node, "limit": "3"}))
    assert n == sum(r["node"] == node for r in f.records) and len(mine) == min(3, n)
    assert all(f.records[i]["node"] == node for i in mine)
    nothing, n = views.at_risk(f, views.AtRiskQuery.parse({"cluster": "elsewhere"}))
    assert nothing == [] and n == 0


def test_the_table_shows_a_page_of_the_riskiest_and_the_rest_a_page_at_a_time():
    f = scored()
    assert views.AtRiskQuery().limit == 50  # not the whole fleet
    query = views.AtRiskQuery.parse({"limit": "10"})
    first, matched = views.at_risk(f, query)
    assert first == list(range(10)) and matched == len(f.records)  # the riskiest: the fleet's rank order
    pager = views.pager(query, len(first), matched)
    assert (pager.first, pager.last, pager.previous, pager.pages) == (1, 10, None, -(-matched // 10))
    assert pager.next == {"limit": "10", "page": "2"}
    second, _ = views.at_risk(f, views.AtRiskQuery.parse(pager.next))
    assert second == list(range(10, 20))
    last_page = views.AtRiskQuery.parse({"limit": "10", "page": str(pager.pages)})
    rest, _ = views.at_risk(f, last_page)
    end = views.pager(last_page, len(rest), matched)
    assert rest == list(range((pager.pages - 1) * 10, matched)) and end.next is None
    assert end.previous == {"limit": "10", "page": str(pager.pages - 1)}
    assert views.AtRiskQuery.parse({"limit": "10", "page": "2"}).params(page=1) == {"limit": "10"}
    with pytest.raises(InputError, match="query parameter page: expected a whole number"):
        views.AtRiskQuery.parse({"page": "0"})


# -- the rows' markup --------------------------------------------------------------------------


def test_a_row_escapes_every_name_and_links_the_node():
    rec = {
        "gpu_uuid": 'GPU-"><img src=x>',
        "cluster": "c&1",
        "node": "<script>alert(1)</script>",
        "gpu_index": 3,
        "risk": 0.5,
        "fleet_rank": 1,
        "tier": "drain_after_job",
        "node_risk": 0.75,
        "node_tier": "drain_after_job",
    }
    explanation = [{"feature": 'x"y<z>', "value": "<b>", "contribution": 0.2}]
    row = html.gpu_row(rec, explanation, with_cluster=True)
    assert "<script>" not in row and "<img" not in row and "<b><b>" not in row
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in row
    assert 'href="/nodes/%3Cscript%3Ealert%281%29%3C%2Fscript%3E?cluster=c%261"' in row
    assert 'data-risk="0.5"' in row and "<td>c&amp;1</td>" in row


def test_the_risk_bar_is_linear_so_a_small_risk_is_a_sliver():
    def width(risk: float) -> float:
        return float(str(html.risk_bar(risk)).rsplit('width="', 1)[1].split('"')[0])

    assert (width(1.0), width(0.5), width(0.25), width(0.0)) == (48.0, 24.0, 12.0, 0.0)
    assert width(0.007) == 0.3  # a log scale drew it as half a bar
    assert width(float("nan")) == 0.0 and width(1.5) == 48.0


def test_the_risk_legend_marks_each_tiers_threshold_on_the_bars_scale():
    legend = str(html.risk_legend(POLICY))
    marks = re.findall(r'<line x1="([\d.]+)"[^>]*stroke="([^"]+)"', legend)
    assert [(float(x), c) for x, c in marks] == [
        (pytest.approx(t.enter * 3 * html.RISK_BAR_WIDTH, abs=0.05), views.TIER_COLORS[t.name]) for t in POLICY.tiers
    ]
    assert "linear" in legend and 'id="risk-legend"' in legend


def test_rows_are_rendered_once_per_snapshot():
    f = scored()
    cache_ = html.RowCache()
    first = str(cache_.rows(f, [0, 1], False))
    assert str(cache_.rows(f, [1, 0], False)) == first.split("\n")[1] + "\n" + first.split("\n")[0] + "\n"
    cached = cache_._rows[(0, False)]
    assert cache_.rows(f, [0], False) and cache_._rows[(0, False)] is cached
    other = score_fleet(trained_model(), latest(), POLICY, 5)  # a reload: a new Fleet object
    cache_.rows(other, [0], False)
    assert cache_._rows[(0, False)] is not cached and set(cache_._rows) == {(0, False)}


# -- the node page's pieces --------------------------------------------------------------------


def test_features_map_to_the_telemetry_they_summarise():
    assert reads.source_metric("temp_gpu_c_max_24h") == "temp_gpu_c"
    assert reads.source_metric("ecc_dbe_volatile_total_increase_6h") == "ecc_dbe_volatile_total"
    assert reads.source_metric("power_w_node_delta_1h") == "power_w"
    assert reads.source_metric("power_limit_w_last") == "power_limit_w"  # the longest metric name wins
    assert reads.source_metric("clock_event_reasons_hw_slowdown_frac_7d") is None  # a bitmask
    assert reads.source_metric("xid_memory_count_24h") is None and reads.source_metric("gpu_age_h") is None
    assert views.feature_meaning("temp_gpu_c_max_24h").startswith("maximum sample of")
    assert views.feature_meaning("not_a_feature_at_all") == ""


def test_the_driving_features_push_the_risk_up_most():
    gpus = [
        {"top_features": [{"feature": "a", "contribution": 0.5}, {"feature": "b", "contribution": -2.0}]},
        {"top_features": [{"feature": "c", "contribution": 0.4}, {"feature": "a", "contribution": 0.1}]},
    ]
    assert views.driving_features(gpus) == ["a", "c"]
    assert views.driving_features(gpus, limit=1) == ["a"]


def test_windows_end_now_unless_the_features_are_old():
    now = datetime(2026, 3, 10, 12, tzinfo=UTC)
    assert views.reference_time(pd.Timestamp(now - timedelta(hours=5)), now) == now
    old = pd.Timestamp(now - timedelta(days=9))
    assert views.reference_time(old, now) == old.to_pydatetime() + timedelta(hours=1)
    assert views.reference_time(None, now) == now


# -- the store reads ---------------------------------------------------------------------------


def audit_row(minutes: int, node: str, action: str, *, mode: str = "live") -> AuditRow:
    return AuditRow(
        time=T0 + timedelta(minutes=minutes),
        cluster="c0",
        node=node,
        gpus=("GPU-1",),
        risk=0.4,
        previous_tier="none",
        tier="avoid" if action == "raise" else "none",
        action=action,
        reason=f"{action} {node}",
        top_features=("temp_gpu_c_mean_1h",),
        model_version="m",
        target="slurm",
        mode=mode,
        dry_run=mode != "live",
        result="ok",
    )


def test_the_audit_reads_its_window_newest_first_and_filters(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    rows = [audit_row(0, "n1", "keep"), audit_row(10, "n1", "raise"), audit_row(20, "n2", "skip", mode="shadow")]
    append_audit(rows, store.path("actions"), fs=store.fs)
    append_audit([audit_row(60 * 24 * 5, "n1", "lower")], store.path("actions"), fs=store.fs)
    (tmp_path / "data" / "actions" / "date=2026-03-04" / ".tmp-part-x.parquet").write_bytes(b"half written")
    window = reads.audit(store, T0, T0 + timedelta(days=1))
    assert window["action"].to_list() == ["skip", "raise", "keep"]
    assert reads.audit(store, T0, T0 + timedelta(days=1), node="n1")["action"].to_list() == ["raise", "keep"]
    assert reads.audit(store, T0, T0 + timedelta(days=9), actions=["lower", "skip"])["action"].to_list() == [
        "lower",
        "skip",
    ]
    assert reads.audit(store, T0, T0 + timedelta(days=1), columns=["action"]).columns == ["action"]
    assert views.action_counts(window) == {
        "raise": 1,
        "lower": 0,
        "breaker_held": 0,
        "cooldown_held": 0,
        "skip": 1,
        "keep": 1,
    }
    q = views.AuditQuery.parse({"mode": "shadow"})
    assert q.select(window)["node"].to_list() == ["n2"]
    assert views.AuditQuery.parse({})
    assert views.AuditQuery.parse({}).select(window)["action"].to_list() == ["skip", "raise"]
    assert views.AuditQuery.parse({"action": "all", "q": "N1"}).select(window)["action"].to_list() == ["raise", "keep"]
    assert reads.audit(Store.create(str(tmp_path / "empty")), T0, T0 + timedelta(days=1)).height == 0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"days": "365"}, "query parameter days: expected a whole number from 1 to 90, got '365'"),
        ({"action": "nuke"}, "query parameter action: expected all or one of raise, lower"),
        ({"mode": "yolo"}, "query parameter mode: expected live, shadow or dry-run, got 'yolo'"),
    ],
)
def test_audit_query_refusals(params, message):
    with pytest.raises(InputError, match=message):
        views.AuditQuery.parse(params)


def test_publish_states_and_the_breaker(tmp_path):
    store = Store.create(str(tmp_path / "data"))
    tripped = PolicyState(
        nodes={
            "c0/n1": NodeState(tier="avoid", since=T0, changed_at=T0, applied="avoid"),
            "c0/n2": NodeState(tier="watch", since=T0, changed_at=T0, applied="watch"),
            "c0/n3": NodeState(tier="drain_after_job", since=T0, changed_at=T0, applied="none"),
        },
        breaker=BreakerState(
            tripped_at=T0, reason="too many", raised=((T0 - timedelta(hours=30), "c0/n9"), (T0, "c0/n1"))
        ),
    )
    store.write_state("publish-slurm", tripped.to_json())
    store.write_state("publish-slurm-shadow", PolicyState().to_json())
    (tmp_path / "data" / "_state" / "publish-webhook.json").write_text(json.dumps({"nodes": "what"}))
    store.write_state("nightly", {"started_at": "2026-03-04T00:00:00+00:00"})  # not a publish state
    states = reads.publish_states(store)
    assert [s.name for s in states] == ["publish-slurm", "publish-slurm-shadow", "publish-webhook"]
    assert states[2].policy is None and "not a gpufail policy state" in states[2].error
    live, shadow, broken = views.breaker_views(states, POLICY, 40, T0 + timedelta(hours=1))
    assert (live.target, live.mode, live.tripped, live.reason) == ("slurm", "live", True, "too many")
    assert live.raised == 1  # the raise 30 h ago is outside the 24 h window
    assert live.limit == 2 and live.applied == {"watch": 1, "avoid": 1}
    assert live.acting_nodes == [("c0", "n1", "avoid", "2026-03-04 00:00Z")]  # n3 was not applied yet
    assert (shadow.target, shadow.mode, shadow.tripped) == ("slurm", "shadow", False)
    assert broken.error and broken.target == "webhook"
    assert views.breaker_views(states[:1], POLICY, None, T0)[0].limit is None
    assert views.published_tiers(states, "c0", "n3") == [
        {"state": "publish-slurm", "tier": "drain_after_job", "applied": "none", "since": "2026-03-04 00:00Z"}
    ]


# -- a node name two clusters share ------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Using `httpx`")
def test_a_node_name_in_two_clusters_needs_its_cluster(tmp_path):
    from starlette.testclient import TestClient

    from serving.api import create_app
    from serving.api_state import LatestFeatures, ServedModel, ServeOptions, Snapshot

    one = latest()
    two = one.assign(cluster="c1", gpu_uuid=one["gpu_uuid"] + "-c1")
    rows = pd.concat([one, two], ignore_index=True)
    both = score_fleet(trained_model(), rows, POLICY, 5)
    Store.create(str(tmp_path / "data"))
    options = ServeOptions(data_root=str(tmp_path / "data"), tiers=POLICY, features_max_age_s=0)
    served = ServedModel(trained_model(), "x", {"source": "path", "path": "x", "metrics": None}, datetime.now(UTC))

    class Nothing:
        def fingerprint(self):
            return None

        def load(self):
            raise AssertionError("not loaded in this test")

    app = create_app(options, Nothing(), start_polling=False)
    app.state.serving.snapshot = Snapshot(served, LatestFeatures(rows, "x", both.ts), both)
    client = TestClient(app)
    node = one["node"].iloc[0]
    r = client.get(f"/nodes/{node}")
    assert r.status_code == 400
    assert f"query parameter cluster: node '{node}' exists in clusters c0, c1; expected one of them" in unescape(r.text)
    page = client.get(f"/nodes/{node}", params={"cluster": "c1"})
    assert page.status_code == 200 and "-c1" in page.text and "cluster c1" in page.text
    assert client.get(f"/nodes/{node}", params={"cluster": "c9"}).status_code == 404
    fleet_page = client.get("/").text
    assert '<select name="cluster"' in fleet_page and "<td>c1</td>" in fleet_page


@pytest.mark.filterwarnings("ignore:Using `httpx`")
def test_the_alarm_history_is_computed_at_start_not_at_the_first_view(tmp_path, monkeypatch):
    from starlette.testclient import TestClient

    from models.train import save_model
    from serving import api as api_module
    from serving.api_state import ModelFolder, ServeOptions
    from serving.score import prediction_table
    from serving.web import history
    from tests.serving.api_server import wait_for, write_store
    from tests.serving.web.web_fleet import predictions

    data = write_store(tmp_path / "data")
    store = Store.open(str(data))
    snapshots = predictions()
    for ts, rows in list(snapshots.groupby("ts"))[-3:]:
        store.write_owned("predictions", ts.date(), prediction_table(rows))
    calls = []
    real = history.daily_counts
    monkeypatch.setattr(history, "daily_counts", lambda *a: calls.append(a) or real(*a))
    options = ServeOptions(data_root=str(data), tiers=POLICY, features_max_age_s=0)
    app = api_module.create_app(
        options, ModelFolder(save_model(trained_model(), tmp_path / "model")), start_polling=False
    )
    with TestClient(app) as client:
        wait_for(lambda: len(calls) == 1, 60, "the warm-up to count the alarms")
        page = client.get("/")
    assert page.status_code == 200 and len(calls) == 1 and '<g class="bars"' in page.text


@pytest.mark.filterwarnings("ignore:Using `httpx`")
def test_before_a_fleet_is_scored_the_pages_say_why(tmp_path):
    from starlette.testclient import TestClient

    from serving import api as api_module
    from serving.api_state import ModelFolder, ServeOptions

    Store.create(str(tmp_path / "data"))  # no features yet
    options = ServeOptions(data_root=str(tmp_path / "data"), tiers=POLICY, features_max_age_s=0)
    app = api_module.create_app(options, ModelFolder(tmp_path / "no-model"), start_polling=False)
    with TestClient(app) as client:
        fleet_page = client.get("/")
        node_page = client.get("/nodes/node00001")
        actions = client.get("/actions")
    assert fleet_page.status_code == 503 and node_page.status_code == 503
    text = unescape(fleet_page.text)
    assert "No scored fleet yet" in text and 'id="not-ready"' in text
    assert "no features dataset yet" in text and "no model at the source yet" in text
    assert actions.status_code == 200 and 'id="no-state"' in actions.text and 'id="no-audit"' in actions.text


def test_pages_show_no_absolute_path(tmp_path):
    root = str(tmp_path / "data")
    shown = views.without_paths(
        f"{root}/_state/publish-log.json: not JSON; model /srv/models/lgbm-3 unreadable; {root} is empty; "
        "see http://mlflow:5000/api/2.0/runs and _state/x.json",
        root,
    )
    assert shown == (
        "_state/publish-log.json: not JSON; model …/lgbm-3 unreadable; the data root is empty; "
        "see http://mlflow:5000/api/2.0/runs and _state/x.json"
    )
