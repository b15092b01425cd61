"""Write deploy/kubernetes/base/prometheusrule.yaml: gpufail-alerts.yaml as the Prometheus
operator's PrometheusRule, its `groups` under `spec` as they are (comments kept).

    python3 deploy/prometheus/prometheusrule.py          # rewrite the manifest
    python3 deploy/prometheus/prometheusrule.py --check  # exit 1 if it is not up to date

Only the standard library: it runs wherever the repository is checked out."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
RULES = HERE / "gpufail-alerts.yaml"
MANIFEST = HERE.parent / "kubernetes" / "base" / "prometheusrule.yaml"
HEADER = """\
# Generated from deploy/prometheus/gpufail-alerts.yaml by deploy/prometheus/prometheusrule.py:
# edit the rules there and run the script again (a test fails while the two differ).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: gpufail
  labels: {app.kubernetes.io/name: gpufail}
spec:
"""


def manifest(rules: str) -> str:
    """The PrometheusRule for the text of an alert rules file (its `groups:` at the top level)."""
    lines = rules.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("groups:")), None)
    if start is None:
        raise ValueError(f"{RULES}: no top-level `groups:`; expected a Prometheus rules file")
    body = "".join(f"  {line}\n" if line.strip() else "\n" for line in lines[start:])
    return HEADER + body


def main(argv: list[str]) -> int:
    wanted = manifest(RULES.read_text())
    if argv == ["--check"]:
        if MANIFEST.exists() and MANIFEST.read_text() == wanted:
            return 0
        print(f"{MANIFEST} is not {RULES} as a PrometheusRule: run python3 {__file__}", file=sys.stderr)
        return 1
    MANIFEST.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
