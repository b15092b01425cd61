"""The Prometheus alerting rules and the Grafana dashboard in deploy/: promtool checks and
unit-tests the rules, every alert has a unit test that fires it, and every metric an
expression reads is one the code exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from tests.deploy.exported import collector_metrics, metric_names, server_metrics
from tests.deploy.tools import require

DEPLOY = Path(__file__).parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "gpufail-alerts.yaml"
RULE_TESTS = DEPLOY / "prometheus" / "gpufail-alerts.test.yaml"
DASHBOARD = DEPLOY / "grafana" / "gpufail-dashboard.json"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require("promtool", "prometheus"), *args], capture_output=True, text=True, timeout=120, cwd=RULES.parent
    )


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_accepts_the_rules():
    checked = promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in checked.stdout


def test_the_rules_unit_tests_pass():
    tested = promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_promtool_test_rules_fails_when_an_alert_does_not_fire_as_expected(tmp_path):
    """The unit tests can fail: the same tests against rules whose thresholds never trip."""
    broken = RULES.read_text().replace("gpufail_breaker_open == 1", "gpufail_breaker_open == 2")
    (tmp_path / RULES.name).write_text(broken)
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    tested = subprocess.run(
        [require("promtool", "prometheus"), "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert tested.returncode != 0 and "GpufailBreakerOpen" in tested.stdout + tested.stderr


def test_every_alert_has_a_unit_test_in_which_it_fires():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case.get("exp_alerts")}
    assert {rule["alert"] for rule in alert_rules()} == fired


def test_every_metric_the_rules_and_the_dashboard_read_is_exported(tmp_path):
    exported = server_metrics(tmp_path) | collector_metrics()
    expressions = [rule["expr"] for rule in alert_rules()]
    expressions += [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    read = set().union(*(metric_names(e) for e in expressions))
    assert read, "no metric found in the expressions"
    assert sorted(read - exported) == []
    # Each exported family of the server's is on the dashboard (the histogram through _bucket).
    unused = {m for m in server_metrics(tmp_path) - read if not m.endswith(("_sum", "_count"))}
    assert unused == set()


def test_the_dashboard_is_a_grafana_dashboard():
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "serve_job", "collect_job"} <= variables
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    taken: set[tuple[int, int]] = set()
    for p in panels:
        pos = p["gridPos"]
        assert (
            all(isinstance(pos[k], int) for k in ("x", "y", "w", "h")) and pos["x"] >= 0 and pos["x"] + pos["w"] <= 24
        )
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & taken, f"panel {p['title']!r} overlaps another"
        taken |= cells
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat", "table", "gauge", "bargauge"}
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(set(refs)) == len(refs)
        for target in p["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval", "__interval", "__range"}
            assert used <= variables, f"{p['title']!r} uses undefined variables {used - variables}"
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("risk", "tier", "alarms vs failures", "collect", "model version"):
        assert topic in titles, topic


def heading_anchors(markdown: str) -> set[str]:
    """The anchors a Markdown renderer (GitHub's) gives the headings: lower case, punctuation
    other than hyphens dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_alert_links_its_section_of_the_deploy_guide():
    anchors = heading_anchors((DEPLOY / "README.md").read_text())
    for rule in alert_rules():
        page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert page == "deploy/README.md", rule["alert"]
        assert anchor in anchors, f"{rule['alert']}: no section #{anchor} in deploy/README.md"
    assert "gpufailcollectorsilent" not in heading_anchors("## Gpufail collector silent\n")
