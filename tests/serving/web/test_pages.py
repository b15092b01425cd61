"""The operator's pages over HTTP against a real `gpufail serve` (no browser): what each page
says against the JSON API and the store, the read-token rule and the sign-in cookie, refusals
of bad parameters, and a part of a page that cannot be read."""

from __future__ import annotations

import re
import shutil
from datetime import datetime, timedelta
from html import unescape

import httpx
import pytest

from ingest.store import Store
from serving.policy import PolicyState
from serving.publish import read_audit
from tests.serving.api_server import ADMIN_TOKEN, N_GPUS, READ_TOKEN, wait_for
from tests.serving.web.web_fleet import DRAINED_NODE, FAILED, serve

pytestmark = pytest.mark.slow


def attrs(html: str, selector_id: str, name: str) -> list[str]:
    """The values of attribute `name` on the rows of the table with id `selector_id`."""
    table = re.search(rf'<table[^>]*id="{selector_id}".*?</table>', html, re.S)
    assert table is not None, f"no table #{selector_id}"
    return [unescape(v) for v in re.findall(rf'<tr [^>]*\b{name}="([^"]*)"', table.group(0))]


def error_text(html: str) -> str:
    found = re.search(r'id="error">(.*?)</p>', html, re.S)
    assert found is not None
    return unescape(found.group(1))


@pytest.fixture(scope="module")
def client(web_server):
    with web_server.client() as c:
        yield c


# -- what the pages say ------------------------------------------------------------------------


def test_the_fleet_page_lists_the_apis_gpus_risks_and_tiers_in_rank_order(client):
    api = client.get("/v1/gpus/at-risk", params={"top": N_GPUS, "top_features": 3}).json()
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert attrs(html, "at-risk", "data-gpu") == [g["gpu_uuid"] for g in api["gpus"]]
    assert [float(r) for r in attrs(html, "at-risk", "data-risk")] == [g["risk"] for g in api["gpus"]]
    assert attrs(html, "at-risk", "data-tier") == [g["tier"] for g in api["gpus"]]
    for g in api["gpus"][:3]:
        for feature in g["top_features"]:
            assert f">{feature['feature']} <b>" in html
    model = client.get("/v1/model").json()
    assert f'<code id="model-version">{model["version"]}</code>' in html
    assert 'id="no-metrics"' in html  # a model folder carries no evaluation


def test_the_fleet_page_counts_gpus_and_nodes_by_tier_as_the_api_tiers_them(client):
    gpus = client.get("/v1/gpus/at-risk", params={"top": N_GPUS, "top_features": 0}).json()["gpus"]
    html = client.get("/").text
    nodes = {g["node"] for g in gpus}
    node_tiers = [client.get(f"/v1/nodes/{n}").json()["node_tier"] for n in sorted(nodes)]
    for tier in ("none", "watch", "avoid", "drain_after_job", "drain_now"):
        row = re.search(rf'<tr data-tier="{tier}">(.*?)</tr>', html, re.S).group(1)
        shown_gpus = re.search(r'<td class="gpus">(?:<a [^>]*>)?([\d,]+)', row).group(1)
        shown_nodes = re.search(r'<td class="nodes">([\d,]+)', row).group(1)
        assert int(shown_gpus) == sum(g["tier"] == tier for g in gpus), tier
        assert int(shown_nodes) == node_tiers.count(tier), tier


def test_the_fleet_page_filters_and_sorts_on_the_server(client):
    gpus = client.get("/v1/gpus/at-risk", params={"top": N_GPUS, "top_features": 3}).json()["gpus"]
    node = gpus[0]["node"]
    html = client.get("/", params={"q": node.upper()}).text  # case-insensitive
    assert attrs(html, "at-risk", "data-gpu") == [g["gpu_uuid"] for g in gpus if g["node"] == node]
    html = client.get("/", params={"tier": "watch"}).text
    ranked = ("none", "watch", "avoid", "drain_after_job", "drain_now")
    expected = [g["gpu_uuid"] for g in gpus if ranked.index(g["tier"]) >= 1]
    assert attrs(html, "at-risk", "data-gpu") == expected
    html = client.get("/", params={"sort": "node", "limit": 5}).text
    by_node = sorted(gpus, key=lambda g: (g["cluster"], g["node"], g["gpu_index"]))
    assert attrs(html, "at-risk", "data-gpu") == [g["gpu_uuid"] for g in by_node[:5]]
    assert f'showing <b id="n-shown">5</b> (<span id="page-range">1–5</span>) of {N_GPUS} matching GPUs' in html
    # The rest a page at a time, in the same order, by the page's own link.
    seen = attrs(html, "at-risk", "data-gpu")
    while (link := re.search(r'<a href="/\?([^"]+)" id="page-next"', html)) is not None:
        html = client.get("/?" + unescape(link.group(1))).text
        assert 'id="page-previous"' in html
        seen += attrs(html, "at-risk", "data-gpu")
    assert seen == [g["gpu_uuid"] for g in by_node]
    html = client.get("/", params={"sort": "gpu_uuid", "order": "desc"}).text
    assert attrs(html, "at-risk", "data-gpu") == sorted((g["gpu_uuid"] for g in gpus), reverse=True)
    feature = gpus[0]["top_features"][0]["feature"]
    html = client.get("/", params={"q": feature}).text
    shown = attrs(html, "at-risk", "data-gpu")
    assert gpus[0]["gpu_uuid"] in shown
    assert set(shown) == {g["gpu_uuid"] for g in gpus if any(f["feature"] == feature for f in g["top_features"])}


def test_the_fleet_page_shows_a_page_of_the_riskiest_gpus_first(client):
    gpus = client.get("/v1/gpus/at-risk", params={"top": N_GPUS, "top_features": 0}).json()["gpus"]
    html = client.get("/", params={"limit": 10}).text
    assert attrs(html, "at-risk", "data-gpu") == [g["gpu_uuid"] for g in gpus[:10]]
    assert 'id="page-previous"' not in html and 'id="page-next"' in html
    beyond = client.get("/", params={"limit": 10, "page": 9}).text
    assert attrs(beyond, "at-risk", "data-gpu") == [] and "No GPU on page 9" in beyond
    # The risk bar's legend is above the table, and says the bar is linear.
    assert html.index('id="risk-legend"') < html.index('id="at-risk"') and "linear" in html


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"sort": "colour"}, "query parameter sort: expected one of risk, node_risk, tier, node, gpu_index"),
        (
            {"tier": "panic"},
            "query parameter tier: expected one of none, watch, avoid, drain_after_job, drain_now, got 'panic'",
        ),
        ({"order": "up"}, "query parameter order: expected asc or desc, got 'up'"),
        ({"limit": "0"}, "query parameter limit: expected a whole number from 1 to 5000, got '0'"),
        ({"limit": "many"}, "query parameter limit: expected a whole number from 1 to 5000, got 'many'"),
    ],
)
def test_a_bad_parameter_is_refused_naming_it(client, query, message):
    r = client.get("/", params=query)
    assert r.status_code == 400
    assert message in error_text(r.text)


def test_the_node_page_shows_the_nodes_gpus_as_the_api_and_its_store_history(client, web_server):
    node = FAILED[0][0]
    api = client.get(f"/v1/nodes/{node}").json()
    r = client.get(f"/nodes/{node}")
    assert r.status_code == 200
    html = r.text
    by_index = sorted(api["gpus"], key=lambda g: g["gpu_index"])
    assert attrs(html, "node-gpus", "data-gpu") == [g["gpu_uuid"] for g in by_index]
    assert [float(v) for v in attrs(html, "node-gpus", "data-risk")] == [g["risk"] for g in by_index]
    assert attrs(html, "node-gpus", "data-tier") == [g["tier"] for g in by_index]
    assert f'data-risk="{api["node_risk"]!r}"' in html
    # One line per GPU in the risk chart (each GPU has a predictions snapshot at every grid time).
    risk_chart = re.search(r'id="risk-history">(.*?)</section>', html, re.S).group(1)
    assert risk_chart.count('<g class="series"') == len(api["gpus"])
    assert 'class="feature-chart"' in html and 'class="telemetry-chart"' in html
    store = Store.open(str(web_server.data))
    events = store.read("xid_events").to_pandas()
    events = events[events["node"] == node].sort_values("ts", ascending=False, kind="stable")
    assert attrs(html, "xid-table", "data-xid") == [str(x) for x in events["xid"]]
    failures = re.findall(r'<tr data-xid="(\d+)"[^>]* class="failure"', html)
    assert failures == [str(x) for n, _, x, _ in FAILED if n == node]
    audit = read_audit(store.path("actions"), fs=store.fs)
    mine = audit[(audit["node"] == node) & (audit["action"] != "keep")].sort_values(
        "time", ascending=False, kind="stable"
    )
    assert attrs(html, "audit", "data-action") == list(mine["action"])
    assert "breaker_held" in set(mine["action"])  # the fixture's breaker holds this node back


def test_the_actions_page_shows_the_breaker_and_the_audit_of_the_store(client, web_server):
    store = Store.open(str(web_server.data))
    state = PolicyState.from_json(store.read_state("publish-log"))
    audit = read_audit(store.path("actions"), fs=store.fs)
    html = client.get("/actions", params={"days": 30}).text
    assert state.breaker.tripped
    assert 'id="breaker-publish-log" data-state="publish-log" data-open="true"' in html
    assert unescape(state.breaker.reason) in unescape(html)
    for action, count in audit["action"].value_counts().items():
        assert f'data-action="{action}" data-count="{count}"' in html
    shown = attrs(html, "audit", "data-action")
    assert shown == list(audit[audit["action"] != "keep"].sort_values("time", ascending=False, kind="stable")["action"])
    skipped = client.get("/actions", params={"days": 30, "action": "skip"}).text
    assert set(attrs(skipped, "audit", "data-node")) == {DRAINED_NODE}
    assert "not touched: drained by an operator" in skipped


def test_unknown_nodes_and_assets_are_404(client):
    r = client.get("/nodes/no-such-node")
    assert r.status_code == 404
    assert "node 'no-such-node': not in the latest features (3 nodes)" in error_text(r.text)
    assert client.get("/static/nope.js").status_code == 404
    css = client.get("/static/web.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")


def test_pages_forbid_foreign_content_and_caching(client):
    r = client.get("/")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["cache-control"] == "no-store"
    assert re.findall(r'(?:src|href|action)="(?:[a-z]+:)?//', r.text) == []  # every asset is served here


def test_pages_are_not_in_the_openapi_document(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert not {"/", "/nodes/{node}", "/actions", "/login", "/logout"} & set(paths)


# -- the read-token rule -----------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/nodes/node00001", "/actions"])
def test_with_protected_reads_a_page_asks_for_the_token(token_server, path):
    with token_server.client() as anonymous:
        r = anonymous.get(path)
    assert r.status_code == 401
    assert 'name="token"' in r.text and f'name="next" value="{path}"' in r.text
    assert "node00001" not in r.text.replace(f'value="{path}"', "")  # nothing of the fleet
    with token_server.client(READ_TOKEN) as reader:
        assert reader.get(path).status_code == 200
    with token_server.client(ADMIN_TOKEN) as admin:
        assert admin.get(path).status_code == 200
    with token_server.client("wrong-4e1c") as wrong:
        assert wrong.get(path).status_code == 401


def test_signing_in_sets_a_strict_cookie_that_opens_the_pages_only(token_server):
    with httpx.Client(base_url=token_server.url, timeout=60) as browser_like:
        refused = browser_like.post("/login", data={"token": "wrong-9b7d", "next": "/actions"})
        assert refused.status_code == 401 and "token: not a read or admin token of this server" in error_text(
            refused.text
        )
        missing = browser_like.post("/login", data={"next": "/"})
        assert missing.status_code == 401 and "token: missing" in error_text(missing.text)
        r = browser_like.post("/login", data={"token": READ_TOKEN, "next": "/actions?days=7"})
        assert r.status_code == 303 and r.headers["location"] == "/actions?days=7"
        cookie = r.headers["set-cookie"]
        assert (
            "gpufail_session=" in cookie
            and "HttpOnly" in cookie
            and "SameSite=strict" in cookie.replace("Strict", "strict")
        )
        assert browser_like.get("/actions").status_code == 200
        assert browser_like.get("/v1/gpus/at-risk").status_code == 401  # the API wants the header
        out = browser_like.post("/logout")
        assert out.status_code == 303
        assert browser_like.get("/").status_code == 401
    assert READ_TOKEN not in token_server.logs() and "wrong-9b7d" not in token_server.logs()


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "/\\evil.example"])
def test_sign_in_returns_only_to_this_server(token_server, target):
    with httpx.Client(base_url=token_server.url, timeout=60) as c:
        r = c.post("/login", data={"token": READ_TOKEN, "next": target})
    assert r.status_code == 303 and r.headers["location"] == "/"


# -- a part that cannot be read ----------------------------------------------------------------


def test_an_unreadable_publish_state_is_named_and_the_rest_of_the_page_shows(web_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(web_data[0], data)
    (data / "_state" / "publish-slurm.json").write_text("{not json")
    srv = serve(tmp_path, data, web_data[1])
    try:
        with srv.client() as c:
            r = c.get("/actions", params={"days": 30})
            node = c.get("/nodes/node00001")
    finally:
        srv.stop()
    assert r.status_code == 200
    assert 'id="breaker-publish-slurm"' in r.text and "JSONDecodeError" in r.text
    assert 'id="breaker-publish-log" data-state="publish-log" data-open="true"' in r.text
    assert attrs(r.text, "audit", "data-action")  # the audit still shows
    assert node.status_code == 200 and 'id="published-publish-log"' in node.text


def test_right_after_a_dry_run_the_actions_page_shows_what_it_would_have_done(web_data, tmp_path):
    # The documented first step: `gpufail publish --dry-run` on a root never published to. It
    # commits its audit through the state's journal, leaving a state file with no policy state.
    from collections import Counter

    from tests.cli import gpufail

    data = tmp_path / "data"
    shutil.copytree(web_data[0], data)
    shutil.rmtree(data / "actions")
    (data / "_state" / "publish-log.json").unlink()
    done = gpufail("publish", "--to", "log", "--dry-run", "--data", str(data), "--quiet")
    assert done.returncode == 0, done.stderr
    audit = read_audit(str(data / "actions"))
    assert (audit["mode"] == "dry-run").all() and len(audit)
    srv = serve(tmp_path, data, web_data[1])
    try:
        with srv.client() as c:
            pages = {path: c.get(path) for path in ("/actions", "/", "/nodes/node00001", "/nodes/nowhere")}
            metrics = c.get("/metrics").text
    finally:
        srv.stop()
    # The scrape reads the same state as nothing applied yet, and says so without a warning.
    assert 'gpufail_breaker_open{state="publish-log"} 0.0' in metrics
    assert "not a gpufail policy state" not in srv.logs()
    html = pages["/actions"].text
    assert pages["/actions"].status_code == 200
    assert "unreadable" not in html and "not a gpufail policy state" not in html
    card = re.search(r'<div class="dry-run" id="dry-run-log">(.*?)</div>', html, re.S)
    assert card is not None, html
    tiers = Counter(t for t in audit["tier"] if t != "none")
    shown = dict(re.findall(r'<span class="tier t-(\w+)">[^<]*</span> (\d+)', card.group(1).split("·")[0]))
    assert {t: int(n) for t, n in shown.items()} == dict(tiers)
    assert "The last dry run (" in card.group(1)
    # No page tells where the data root lies on the server (nor any other absolute path of it).
    for path, page in pages.items():
        assert str(tmp_path) not in page.text and str(tmp_path.resolve()) not in page.text, path


def test_unreadable_snapshots_leave_the_rest_of_the_fleet_page(web_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(web_data[0], data)
    days = sorted((data / "predictions").iterdir())
    broken = days[-1] / "part-broken.parquet"
    broken.write_bytes(b"not parquet")  # there when the server starts
    srv = serve(tmp_path, data, web_data[1])
    try:
        with srv.client() as c:
            first = c.get("/")
            broken.unlink()  # repaired: the counts are computed on the next view
            repaired = c.get("/")
            (days[-1] / "part-broken-too.parquet").write_bytes(b"not parquet")  # a new bad file

            def refresh_failed() -> str | None:
                html = c.get("/").text
                return html if "could not be counted" in html else None

            stale = wait_for(refresh_failed, 60, "the background refresh to fail")
    finally:
        srv.stop()
    assert first.status_code == 200
    assert "alarms and failures could not be read:" in unescape(first.text)
    assert len(attrs(first.text, "at-risk", "data-gpu")) == N_GPUS  # the snapshot still shows
    assert "could not be read" not in repaired.text and '<g class="bars"' in repaired.text
    assert '<g class="bars"' in stale  # the previous counts, with the reason they are not newer
    assert 'id="history-stale">The newest snapshots could not be counted (' in stale


def test_history_windows_end_at_the_served_features_for_old_data(client):
    html = client.get("/nodes/node00001").text
    ts = client.get("/readyz").json()["features_ts"]
    end = (datetime.fromisoformat(ts) + timedelta(hours=1)).strftime("%Y-%m-%d %H:%M")
    assert f"to {end}Z" in html
