"""Read timeouts for `gpufail serve`: a request's headers, then its body, must arrive in time.

uvicorn times out only idle keep-alive connections: a client that sends its headers or body a
byte at a time (slowloris) holds a connection, and with a few hundred of them the server's
sockets, for as long as it likes. Here each request's headers must be complete within
`header_timeout` of its first byte (or of the connection, for one that sends nothing), and its
body within `body_timeout` of its headers; otherwise the client gets a 408 (when no response
has started) and the connection is closed. The timers sit on uvicorn's httptools protocol,
whose parser callbacks mark where a request's headers and body end.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_LOG = logging.getLogger("uvicorn.error")


def _timeout_response(what: str, seconds: float) -> bytes:
    body = f"request {what} not received within {seconds:g} s ([serve] {what}_timeout)\n".encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class ReadTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's headers and body."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def _arm(self, what: str, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, what, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, what: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        _LOG.warning("%s: request %s not received within %g s; connection closed", client, what, seconds)
        cycle = self.cycle
        if what == "header" or cycle is None or not cycle.response_started:
            self.transport.write(_timeout_response(what, seconds))
        self.transport.close()

    # A connection's first request starts its header clock; each later one at its first byte
    # (uvicorn's keep-alive timeout covers the idle time between requests).
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("header", self.header_timeout)

    def on_message_begin(self) -> None:
        if self._deadline is None:  # the first request's clock runs from the connection
            self._arm("header", self.header_timeout)
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._arm("body", self.body_timeout)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def read_timeout_protocol(header_timeout: float, body_timeout: float) -> type[ReadTimeoutProtocol]:
    """The protocol class to give uvicorn (`http=`), with these deadlines in seconds."""
    return type(
        "ReadTimeoutProtocol",
        (ReadTimeoutProtocol,),
        {"header_timeout": header_timeout, "body_timeout": body_timeout},
    )
