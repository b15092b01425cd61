"""URLs as gpufail shows them: with what may be a credential masked.

Services put keys in URLs: a chat webhook in its path (`https://hooks.slack.com/services/T../B../KEY`),
an API gateway in its query (`?api_key=...`), basic authentication in its user part
(`https://user:password@host`). Every URL gpufail prints, logs, stores in the audit or shows on
a page goes through `masked_url` (or `redact_urls` for a message that holds some), which keeps
what identifies the service (scheme, host, port, the leading word-like path segments and the
query's keys) and masks the rest; `url_fingerprint` tells two masked URLs apart without
showing either.
"""

from __future__ import annotations

import hashlib
import re
from urllib.parse import parse_qsl, urlsplit, urlunsplit

MASK = "****"
_WORD_SEGMENT = re.compile(r"^(?:[a-z][a-z_.-]{0,23}|v\d{1,2}|\d{1,2}(?:\.\d{1,2})?)$")
"""A path segment kept as it is (`services`, `api`, `query_range`, `v1`, `2.0`): lowercase
letters alone, or a short version. Keys have digits, capitals or length; the first segment
that is not such a word, and all after it, is masked."""
_URL_IN_TEXT = re.compile(r"""\bhttps?://[^\s'"<>()\[\]]+""", re.IGNORECASE)
"""The URLs of services (webhooks, tracking servers) in a message; a data root's storage URL
(`s3://...`, `memory://...`) names the data, and is left as it is."""


def masked_url(url: str) -> str:
    """`url` with its password (a user part alone: the whole of it), query values, fragment and the path from its first segment
    that is not a plain word replaced by `MASK`; `MASK` alone when it does not parse."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return MASK
    if ":" in host:  # an IPv6 address keeps its brackets
        host = f"[{host}]"
    # user:password keeps the user; a user part alone is a token (https://TOKEN@host).
    user = f"{parts.username}:{MASK}@" if parts.password is not None else f"{MASK}@" if "@" in parts.netloc else ""
    netloc = user + host + (f":{port}" if port is not None else "")
    segments = parts.path.split("/")
    kept = []
    for i, segment in enumerate(segments):
        if i == 0 or not segment or _WORD_SEGMENT.match(segment):
            kept.append(segment)
        else:
            kept.append(MASK)
            break
    query = "&".join(f"{key}={MASK}" for key, _ in parse_qsl(parts.query, keep_blank_values=True))
    if parts.query and not query:
        query = MASK
    return urlunsplit((parts.scheme, netloc, "/".join(kept), query, MASK if parts.fragment else ""))


def url_fingerprint(url: str) -> str:
    """A short digest of the whole URL: the same for the same URL, and nothing of it readable."""
    return "sha256:" + hashlib.sha256(url.encode()).hexdigest()[:12]


def described_url(url: str) -> str:
    """`masked_url` and, when masking hid something, its `url_fingerprint`: how a message
    names a URL it was given."""
    shown = masked_url(url)
    return shown if shown == url else f"{shown} ({url_fingerprint(url)})"


def redact_urls(text: str) -> str:
    """`text` with every http(s) URL in it masked (`masked_url`)."""

    def mask(match: re.Match[str]) -> str:
        url = match.group(0)
        end = len(url.rstrip(".,;:!?"))  # the sentence's punctuation, not the URL's
        return masked_url(url[:end]) + url[end:]

    return _URL_IN_TEXT.sub(mask, text)
