"""The pages' sign-in cookie: a session value derived from the token, never the token itself.

The value is `EXPIRES.MAC`: the Unix time it stops opening the pages, and the HMAC-SHA256 of
that time keyed with the token that signed in. The server, which knows its tokens, checks it
against each; a copy of the cookie (a browser profile, a proxy's log) opens the pages until it
expires and nothing else: it is not a bearer token of the API, an admin token signed in with
does not open the admin endpoints through it, and changing the tokens ends every session.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

COOKIE = "gpufail_session"
LIFETIME_S = 12 * 3600
"""How long a sign-in lasts."""
_PURPOSE = b"gpufail pages session\x00"


def _mac(token: str, expires: int) -> str:
    return hmac.new(token.encode(), _PURPOSE + str(expires).encode(), hashlib.sha256).hexdigest()


def session_value(token: str, now: float, lifetime_s: int = LIFETIME_S) -> str:
    """The cookie value of a sign-in with `token` at `now` (Unix seconds)."""
    expires = int(now) + lifetime_s
    return f"{expires}.{_mac(token, expires)}"


def session_ok(value: str, tokens: Iterable[str | None], now: float) -> bool:
    """Whether `value` is an unexpired session of one of `tokens` (compared in constant time
    against each, so the time taken does not tell which)."""
    expires, _, mac = value.partition(".")
    if not expires.isdigit() or len(expires) > 12 or int(expires) <= now:
        return False
    matched = False
    for token in tokens:
        if token:
            matched |= hmac.compare_digest(mac.encode(), _mac(token, int(expires)).encode())
    return matched
