"""The operator's pages in a real headless Chromium against a real `gpufail serve`: each page's
content against the JSON API and the store, a sort and a filter clicked (in place by the
page's script when the table holds every matching GPU, by the server otherwise), signing in,
and a screenshot of each page (under the test's tmp folder; the latest also in
build/screenshots/)."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from ingest.store import Store
from serving.display import fmt_risk
from serving.policy import TIERS, PolicyState
from serving.publish import read_audit
from tests.serving.api_server import N_GPUS, READ_TOKEN
from tests.serving.web.browser import screenshot
from tests.serving.web.web_fleet import DRAINED_NODE, FAILED

pytestmark = pytest.mark.slow


def rows(browser, table: str) -> list:
    return [r for r in browser.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr") if r.is_displayed()]


def column(browser, table: str, name: str) -> list[str]:
    return [r.get_attribute(name) for r in rows(browser, table)]


def at_risk_api(server) -> list[dict]:
    with server.client() as c:
        return c.get("/v1/gpus/at-risk", params={"top": N_GPUS, "top_features": 3}).json()["gpus"]


def load(browser, url: str) -> None:
    browser.get(url)
    WebDriverWait(browser, 30).until(lambda b: b.execute_script("return document.readyState") == "complete")


def navigated(browser) -> bool:
    """Whether the page was reloaded since `mark` (the mark lives only as long as the document)."""
    return not browser.execute_script("return window.__mark === 1")


def mark(browser) -> None:
    browser.execute_script("window.__mark = 1")


def test_the_fleet_page_shows_what_the_api_serves(browser, web_server, tmp_path):
    api = at_risk_api(web_server)
    load(browser, web_server.url + "/")
    assert column(browser, "at-risk", "data-gpu") == [g["gpu_uuid"] for g in api]
    assert [float(r) for r in column(browser, "at-risk", "data-risk")] == [g["risk"] for g in api]
    assert column(browser, "at-risk", "data-tier") == [g["tier"] for g in api]
    for row, g in zip(rows(browser, "at-risk"), api, strict=True):
        cells = row.find_elements(By.TAG_NAME, "td")
        assert cells[1].text == g["node"] and cells[3].text == g["gpu_uuid"]
        assert cells[4].text == fmt_risk(g["risk"]) and cells[5].text == g["tier"].replace("_", " ")
        chips = [c.text.rsplit(" ", 1)[0] for c in cells[8].find_elements(By.CLASS_NAME, "feat")]
        assert chips == [f["feature"] for f in g["top_features"]]
    for tier in TIERS:
        shown = browser.find_element(By.CSS_SELECTOR, f"#tiers tr[data-tier='{tier}'] td.gpus").text
        assert int(shown) == sum(g["tier"] == tier for g in api)
    assert browser.find_element(By.ID, "readiness").text == "ready"
    assert browser.find_elements(By.CSS_SELECTOR, "#alarms svg.chart g.bars")
    screenshot(browser, tmp_path, "fleet")


def test_clicking_a_column_sorts_in_place_when_every_row_is_shown(browser, web_server, tmp_path):
    api = at_risk_api(web_server)
    load(browser, web_server.url + "/")
    assert browser.find_element(By.ID, "at-risk").get_attribute("data-complete") == "true"
    mark(browser)
    browser.find_element(By.CSS_SELECTOR, "th[data-sort='node'] a").click()
    by_node = sorted(api, key=lambda g: (g["cluster"], g["node"], g["gpu_index"]))
    assert column(browser, "at-risk", "data-gpu") == [g["gpu_uuid"] for g in by_node]
    assert not navigated(browser), "the script sorted without asking the server"
    assert "sort=node" in browser.current_url and "order=asc" in browser.current_url
    browser.find_element(By.CSS_SELECTOR, "th[data-sort='node'] a").click()
    assert column(browser, "at-risk", "data-gpu") == [g["gpu_uuid"] for g in reversed(by_node)]
    node_risk = browser.find_element(By.CSS_SELECTOR, "th[data-sort='node_risk'] a")
    node_risk.click()
    expected = sorted(api, key=lambda g: -g["node_risk"])  # stable: rank order among a node's GPUs
    assert column(browser, "at-risk", "data-gpu") == [g["gpu_uuid"] for g in expected]
    screenshot(browser, tmp_path, "fleet-sorted-by-node-risk")
    # The URL the script wrote gives the same order from the server.
    load(browser, browser.current_url)
    assert column(browser, "at-risk", "data-gpu") == [g["gpu_uuid"] for g in expected]


def test_clicking_a_column_asks_the_server_when_rows_are_cut(browser, web_server):
    api = at_risk_api(web_server)
    load(browser, web_server.url + "/?limit=5")
    assert browser.find_element(By.ID, "at-risk").get_attribute("data-complete") == "false"
    mark(browser)
    browser.find_element(By.CSS_SELECTOR, "th[data-sort='gpu_uuid'] a").click()
    WebDriverWait(browser, 30).until(lambda b: navigated(b))
    assert column(browser, "at-risk", "data-gpu") == sorted(g["gpu_uuid"] for g in api)[:5]
    assert "limit=5" in browser.current_url and "sort=gpu_uuid" in browser.current_url


def test_filtering_live_and_on_the_server(browser, web_server, tmp_path):
    api = at_risk_api(web_server)
    node = FAILED[0][0]
    mine = [g["gpu_uuid"] for g in api if g["node"] == node]
    load(browser, web_server.url + "/")
    mark(browser)
    box = browser.find_element(By.ID, "q")
    box.send_keys(node)
    assert column(browser, "at-risk", "data-gpu") == mine  # hidden by the script, in place
    assert browser.find_element(By.ID, "n-shown").text == str(len(mine))
    assert not navigated(browser)
    box.send_keys(Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda b: navigated(b))
    assert f"q={node}" in browser.current_url
    assert column(browser, "at-risk", "data-gpu") == mine  # now filtered by the server
    assert len(browser.find_elements(By.CSS_SELECTOR, "#at-risk tbody tr")) == len(mine)
    screenshot(browser, tmp_path, "fleet-filtered")
    load(browser, web_server.url + "/")
    mark(browser)
    Select(browser.find_element(By.ID, "tier")).select_by_value("drain_after_job")
    WebDriverWait(browser, 30).until(lambda b: navigated(b))
    strong = [g["gpu_uuid"] for g in api if TIERS.index(g["tier"]) >= TIERS.index("drain_after_job")]
    assert strong, "the fixture has GPUs at drain_after_job or above"
    assert column(browser, "at-risk", "data-gpu") == strong


def test_the_node_page(browser, web_server, tmp_path):
    node = FAILED[0][0]
    with web_server.client() as c:
        api = c.get(f"/v1/nodes/{node}").json()
    load(browser, web_server.url + "/")
    browser.find_element(By.CSS_SELECTOR, f"#at-risk tr[data-node='{node}'] a").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.ID, "node-gpus"))
    by_index = sorted(api["gpus"], key=lambda g: g["gpu_index"])
    assert column(browser, "node-gpus", "data-gpu") == [g["gpu_uuid"] for g in by_index]
    assert [float(r) for r in column(browser, "node-gpus", "data-risk")] == [g["risk"] for g in by_index]
    assert column(browser, "node-gpus", "data-tier") == [g["tier"] for g in by_index]
    assert float(browser.find_element(By.ID, "node-risk").get_attribute("data-risk")) == api["node_risk"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#risk-history svg g.series")) == len(api["gpus"])
    features = browser.find_elements(By.CSS_SELECTOR, "#drivers figure.feature-chart")
    assert features and all(f.find_elements(By.CSS_SELECTOR, "g.series polyline") for f in features)
    assert browser.find_elements(By.CSS_SELECTOR, "#drivers figure.telemetry-chart g.series polyline")
    store = Store.open(str(web_server.data))
    events = store.read("xid_events").to_pandas()
    events = events[events["node"] == node].sort_values("ts", ascending=False, kind="stable")
    assert column(browser, "xid-table", "data-xid") == [str(x) for x in events["xid"]]
    failures = browser.find_elements(By.CSS_SELECTOR, "#xid-table tr.failure")
    assert [f.get_attribute("data-gpu") for f in failures] == [g for n, g, _, _ in FAILED if n == node]
    audit = read_audit(store.path("actions"), fs=store.fs)
    mine = audit[(audit["node"] == node) & (audit["action"] != "keep")].sort_values(
        "time", ascending=False, kind="stable"
    )
    assert column(browser, "audit", "data-action") == list(mine["action"])
    latest = audit[audit["node"] == node].iloc[-1]
    assert latest["reason"] in browser.find_element(By.ID, "latest-decision").text
    screenshot(browser, tmp_path, "node")


def overflow(browser) -> int:
    """How many CSS pixels the page is wider than the window (0: no horizontal scrolling)."""
    return int(
        browser.execute_script(
            "return Math.max(document.documentElement.scrollWidth, document.body.scrollWidth) - window.innerWidth"
        )
    )


@pytest.mark.parametrize("width", [1280, 1400])
def test_the_pages_fit_the_width_of_a_laptop_screen(browser, web_server, tmp_path, width):
    node = FAILED[0][0]
    browser.set_window_size(width, 900)
    try:
        # A resize lands asynchronously in the headless browser.
        WebDriverWait(browser, 10).until(lambda b: b.execute_script("return window.innerWidth") == width)
        for name, path in (("node", f"/nodes/{node}"), ("fleet", "/"), ("actions", "/actions?days=30")):
            load(browser, web_server.url + path)
            assert overflow(browser) <= 0, f"{path} is {overflow(browser)} px wider than {width} px"
            browser.save_screenshot(str(tmp_path / f"{name}-{width}.png"))
    finally:
        browser.set_window_size(1600, 1000)


def test_the_actions_page(browser, web_server, tmp_path):
    store = Store.open(str(web_server.data))
    state = PolicyState.from_json(store.read_state("publish-log"))
    audit = read_audit(store.path("actions"), fs=store.fs)
    load(browser, web_server.url + "/")
    browser.find_element(By.LINK_TEXT, "Actions").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.ID, "breakers"))
    breaker = browser.find_element(By.ID, "breaker-publish-log")
    assert breaker.get_attribute("data-open") == ("true" if state.breaker.tripped else "false")
    assert "breaker open" in breaker.text and "gpufail publish --reset-breaker" in breaker.text
    counts = {
        a.get_attribute("data-action"): int(a.get_attribute("data-count"))
        for a in browser.find_elements(By.CSS_SELECTOR, "#action-counts a")
    }
    assert {k: v for k, v in counts.items() if v} == audit["action"].value_counts().to_dict()
    expected = audit[audit["action"] != "keep"].sort_values("time", ascending=False, kind="stable")
    assert column(browser, "audit", "data-action") == list(expected["action"])
    screenshot(browser, tmp_path, "actions")
    mark(browser)
    Select(browser.find_element(By.NAME, "action")).select_by_value("skip")
    WebDriverWait(browser, 30).until(lambda b: navigated(b))
    assert set(column(browser, "audit", "data-node")) == {DRAINED_NODE}
    assert set(column(browser, "audit", "data-action")) == {"skip"}


def test_signing_in_with_the_read_token(browser, token_server, tmp_path):
    browser.delete_all_cookies()
    load(browser, token_server.url + "/actions")
    assert browser.find_elements(By.ID, "token") and not browser.find_elements(By.ID, "audit")
    screenshot(browser, tmp_path, "sign-in")
    browser.find_element(By.ID, "token").send_keys("not-the-token")
    browser.find_element(By.ID, "sign-in").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.ID, "error"))
    assert "not a read or admin token" in browser.find_element(By.ID, "error").text
    browser.find_element(By.ID, "token").send_keys(READ_TOKEN)
    browser.find_element(By.ID, "sign-in").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.ID, "breakers"))
    assert browser.current_url.endswith("/actions")
    cookie = browser.get_cookie("gpufail_session")
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert browser.execute_script("return document.cookie") == ""  # not readable by scripts
    browser.find_element(By.CSS_SELECTOR, "form[action='/logout'] button").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.ID, "token"))
    browser.delete_all_cookies()
