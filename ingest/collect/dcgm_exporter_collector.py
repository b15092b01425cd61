"""The dcgm-exporter collector: scrape one `/metrics` endpoint per call -> `telemetry` rows.

The scrape is fetched and parsed by the same code as `gpufail ingest dcgm-exporter`
(`ingest.dcgm_scrape`). Every way a scrape can fail (endpoint down, timeout, an HTML login
or error page, text that is not Prometheus exposition) is one `CollectorError` for this call;
the daemon records it and the next interval simply scrapes again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ingest.collect.base import Clock, Collected, CollectorError, SystemClock
from ingest.dcgm_scrape import fetch_scrape, parse_scrape_detailed
from ingest.errors import InputError

# dcgm-exporter answers in milliseconds; a scrape slower than this would delay every other
# collector of the tick, so it is abandoned and counted as a failure.
DEFAULT_TIMEOUT_S = 5.0


class DcgmExporterCollector:
    """Telemetry from a dcgm-exporter endpoint, stamped with the clock's time of the scrape."""

    name = "dcgm-exporter"

    def __init__(
        self,
        url: str,
        *,
        cluster: str,
        node: str,
        clock: Clock | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        fetch: Callable[[str, float], str] = fetch_scrape,
    ) -> None:
        self.url = url
        self.cluster = cluster
        # Our node name, not the scrape's `Hostname` label: in Kubernetes that label is often
        # the exporter pod's name, and the rows must join the kernel-log rows of this node.
        self.node = node
        self.clock = clock or SystemClock()
        self.timeout_s = timeout_s
        self._fetch = fetch
        self.blank_values = 0
        self.out_of_range: Counter[str] = Counter()
        """Per column, readings outside the metric's valid range, stored as missing."""

    def collect(self) -> Collected:
        now = self.clock.now()
        try:
            text = self._fetch(self.url, self.timeout_s)
            if text.lstrip()[:1] == "<":
                raise CollectorError(
                    f"dcgm-exporter collector: {self.url} returned HTML ({_first_line(text)!r}), "
                    "not Prometheus text; expected the exporter's /metrics endpoint"
                )
            parsed = parse_scrape_detailed(text, now=now, cluster=self.cluster, node=self.node, source=self.url)
        except InputError as exc:
            raise CollectorError(f"dcgm-exporter collector: {exc}") from None
        self.blank_values += parsed.blank_values
        self.out_of_range += parsed.out_of_range
        return {"telemetry": parsed.table}

    def close(self) -> None:
        pass


def _first_line(text: str) -> str:
    return text.lstrip().split("\n", 1)[0][:60]
