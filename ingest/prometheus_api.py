"""A client of the Prometheus HTTP API (`/api/v1/...`), as Thanos, Mimir and VictoriaMetrics
serve it too: the series of a selector, and the raw samples of a range.

Raw samples, not `query_range`: a range query evaluates the selector at every step, and each
evaluation takes the newest sample of the last 5 minutes (the lookback), so a missed scrape
comes back as a copy of the one before, stamped at a time no sample had. A range-vector
selector (`selector[60m]` at time t) answers every stored sample of (t - 60m, t] at its own
timestamp, with counter resets, NaNs and gaps as stored; the points-per-series limit of range
queries (11,000) is kept all the same (`POINTS_PER_SERIES`), so that no answer grows without
bound, on any of those servers.

Failures: a connection refused or reset, a timeout and a 5xx answer are retried (`RETRIES`
times, with a growing pause); a 4xx answer (a bad selector, a range the server refuses) is not,
and becomes one `InputError` with the server's own error text. Authentication comes from the
environment (`TOKEN_ENV`, or `USER_ENV` and `PASSWORD_ENV`), never from the command line, and no
message names a secret: URLs are printed without their user part.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from ingest.errors import GpufailError, InputError

TOKEN_ENV = "GPUFAIL_PROMETHEUS_TOKEN"
"""A bearer token sent as `Authorization: Bearer ...`."""
USER_ENV = "GPUFAIL_PROMETHEUS_USER"
PASSWORD_ENV = "GPUFAIL_PROMETHEUS_PASSWORD"
"""Basic auth, when no token is set."""

POINTS_PER_SERIES = 11_000
"""Prometheus refuses a range query of more points per series than this; no answer asked of
the server here holds more samples per series either."""
RETRIES = 3
"""Tries after the first for a timeout, a dropped connection or a 5xx answer."""
RETRY_PAUSE_S = 0.5
"""The pause before the first retry; it doubles with each."""


class PrometheusUnavailable(GpufailError):
    """The server did not answer usefully after every retry (down, too slow, 5xx)."""


@dataclass(frozen=True)
class Series:
    """One series of a matrix answer: its labels, and its samples' times (ms) and values."""

    labels: dict[str, str]
    times_ms: np.ndarray
    values: np.ndarray


@dataclass
class Answers:
    """What the server said besides data, over the queries of an import or a collection."""

    queries: int = 0
    retries: int = 0
    warnings: Counter[str] = field(default_factory=Counter)


class PrometheusClient:
    """Queries one server. Thread-safe: an import runs several queries at once."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        ca_file: str | None = None,
        retries: int = RETRIES,
        retry_pause_s: float = RETRY_PAUSE_S,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise InputError(
                f"--url {shown_url(url)!r}: expected the server's http(s) URL, e.g. http://prometheus:9090"
            )
        self.base = shown_url(url.rstrip("/"))
        self.shown = shown_url(self.base)
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_pause_s = retry_pause_s
        self.answers = Answers()
        self._lock = threading.Lock()
        self._headers = _auth_headers(os.environ if environ is None else environ, parsed)
        self._context: ssl.SSLContext | None = None
        if ca_file is not None:
            try:
                self._context = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise InputError(f"CA file {ca_file}: cannot be read ({exc}); expected PEM certificates") from None

    def series(self, match: str, start_ms: int, end_ms: int) -> list[dict[str, str]]:
        """The label sets of the series `match` selects that have samples in [start, end]."""
        body = self._get("/api/v1/series", {"match[]": match, "start": _seconds(start_ms), "end": _seconds(end_ms)})
        data = json.loads(body)["data"]
        return [dict(labels) for labels in data]

    def samples(self, selector: str, start_ms: int, end_ms: int) -> list[Series]:
        """Every stored sample of the series `selector` selects with start <= time < end."""
        # A range selector at time t holds the samples of (t - range, t] (both ends on older
        # servers): asked for [start, end - 1ms] and cut to the range here.
        last = end_ms - 1
        query = f"{selector}[{last - start_ms + 1}ms]"
        body = self._get("/api/v1/query", {"query": query, "time": _seconds(last)})
        return [_cut(s, start_ms, end_ms) for s in parse_matrix(body)]

    def newest(self, query: str, at_ms: int) -> list[tuple[dict[str, str], float]]:
        """An instant query's vector at `at_ms`: (labels, value) per series."""
        body = self._get("/api/v1/query", {"query": query, "time": _seconds(at_ms)})
        data = json.loads(body)["data"]
        if data.get("resultType") != "vector":
            raise InputError(
                f"prometheus {self.shown}: {query!r} answered a {data.get('resultType')}; expected a vector"
            )
        return [(dict(r["metric"]), float(r["value"][1])) for r in data["result"]]

    # -- HTTP ----------------------------------------------------------------------------------

    def _get(self, path: str, params: dict[str, str]) -> bytes:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        request = urllib.request.Request(url, headers={"Accept": "application/json", **self._headers})
        for attempt in range(self.retries + 1):
            problem = self._try(request, path)
            if isinstance(problem, bytes):
                return problem
            if attempt == self.retries:
                raise PrometheusUnavailable(
                    f"prometheus {self.shown}{path}: {problem} after {self.retries + 1} tries; expected a "
                    "reachable Prometheus HTTP API (is the server up, and the URL right?)"
                )
            with self._lock:
                self.answers.retries += 1
            time.sleep(self.retry_pause_s * 2**attempt)
        raise AssertionError("unreachable")

    def _try(self, request: urllib.request.Request, path: str) -> bytes | str:
        """The answer's body, or why it is worth another try."""
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._context) as response:
                body: bytes = response.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            if exc.code >= 500:
                return f"HTTP {exc.code} ({_error_text(text)})"
            raise InputError(
                f"prometheus {self.shown}{path}: HTTP {exc.code}: {_error_text(text)}{_hint(exc.code)}"
            ) from None
        except (TimeoutError, ConnectionError) as exc:
            return _reason(exc)
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ssl.SSLError):
                raise InputError(
                    f"prometheus {self.shown}: TLS failed ({exc.reason}); expected a certificate the CA file trusts"
                ) from None
            reason = exc.reason
            return _reason(reason if isinstance(reason, BaseException) else OSError(str(reason)))
        except OSError as exc:
            return _reason(exc)
        with self._lock:
            self.answers.queries += 1
            for warning in _warnings(body):
                self.answers.warnings[warning] += 1
        return body


def shown_url(url: str) -> str:
    """`url` without a user or password in it (`https://user:secret@host` -> `https://host`)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _auth_headers(environ: Mapping[str, str], url: urllib.parse.SplitResult) -> dict[str, str]:
    token = environ.get(TOKEN_ENV)
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = environ.get(USER_ENV), environ.get(PASSWORD_ENV)
    if user is None and url.username is not None:
        user, password = urllib.parse.unquote(url.username), urllib.parse.unquote(url.password or "")
    if user is not None:
        pair = f"{user}:{password or ''}".encode()
        return {"Authorization": f"Basic {base64.b64encode(pair).decode()}"}
    return {}


def _seconds(ms: int) -> str:
    return f"{ms // 1000}.{ms % 1000:03d}"


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return "timed out" if isinstance(exc, TimeoutError) or "timed out" in text else text


def _error_text(body: str) -> str:
    try:
        answer = json.loads(body)
        return f"{answer.get('errorType', 'error')}: {answer.get('error', '').strip()}"
    except (ValueError, AttributeError):
        return body.strip().splitlines()[0][:200] if body.strip() else "no message"


def _hint(code: int) -> str:
    if code in (401, 403):
        return f"; expected credentials the server accepts (${TOKEN_ENV}, or ${USER_ENV} and ${PASSWORD_ENV})"
    if code == 400 or code == 422:
        return "; expected a valid series selector and a range the server holds (see its retention)"
    return ""


_WARNINGS = re.compile(rb'"warnings":\s*(\[[^\]]*\])')


def _warnings(body: bytes) -> list[str]:
    """The answer's warnings (a partial answer: a store or shard did not reply)."""
    found = _WARNINGS.search(body[-65536:])
    if found is None:
        return []
    try:
        return [str(w) for w in json.loads(found[1])]
    except ValueError:
        return ["unreadable warnings"]


# -- matrix answers --------------------------------------------------------------------------

_CSV_READ = pacsv.ReadOptions(column_names=["t", "v"], use_threads=False, block_size=1 << 24)
_CSV_CONVERT = pacsv.ConvertOptions(
    column_types={"t": pa.float64(), "v": pa.float64()}, null_values=[], strings_can_be_null=False
)


def parse_matrix(body: bytes) -> list[Series]:
    """The series of a matrix answer (`/api/v1/query` of a range selector).

    An answer of millions of samples is read without a Python object per sample: each series'
    label object is decoded as JSON, and the `values` arrays of all series (only numbers,
    number strings, commas and brackets) become one CSV text that Arrow reads at C speed."""
    if not re.match(rb'\s*\{\s*"status"\s*:\s*"success"', body):
        raise InputError(f"prometheus answer: not a success ({body[:120]!r})")
    labels: list[dict[str, str]] = []
    chunks: list[bytes] = []
    counts: list[int] = []
    position = 0
    while (found := body.find(b'"metric":', position)) >= 0:
        values = body.find(b'"values":[', found)
        if values < 0:
            raise InputError("prometheus answer: a series without 'values'; expected a matrix (a range selector)")
        # A label value cannot hold `"values":[`: JSON escapes its quotes.
        labels_end = body.rfind(b"}", found, values)
        first = values + len(b'"values":[')
        close = body.find(b"]]", first)
        position = close + 2
        if close < 0 or body[first : first + 1] != b"[":
            continue  # an empty series (servers do not send one; a proxy might)
        labels.append(json.loads(body[found + len(b'"metric":') : labels_end + 1]))
        chunk = body[first + 1 : close].replace(b" ", b"")
        counts.append(chunk.count(b"],[") + 1)
        chunks.append(chunk)
    if not chunks:
        return []
    text = b"\n".join(chunks).replace(b"],[", b"\n").translate(None, b'"')
    table = pacsv.read_csv(io.BytesIO(text), read_options=_CSV_READ, convert_options=_CSV_CONVERT)
    times = np.round(table["t"].to_numpy() * 1000).astype(np.int64)
    values_all = table["v"].to_numpy()
    bounds = np.cumsum([0, *counts])
    return [
        Series(label_set, times[bounds[i] : bounds[i + 1]], values_all[bounds[i] : bounds[i + 1]])
        for i, label_set in enumerate(labels)
    ]


def _cut(series: Series, start_ms: int, end_ms: int) -> Series:
    keep = (series.times_ms >= start_ms) & (series.times_ms < end_ms)
    if keep.all():
        return series
    return Series(series.labels, series.times_ms[keep], series.values[keep])
