"""Read timeouts for `gpufail serve`: a request's headers, then its body, must arrive in time.

uvicorn times out only idle keep-alive connections: a client that sends its headers or body a
byte at a time (slowloris) holds a connection, and with a few hundred of them the server's
sockets, for as long as it likes. Here each request's headers must be complete within
`header_timeout` of its first byte (or of the connection, for one that sends nothing), and its
body within `body_timeout` of its headers; otherwise the client gets a 408 (when no response
has started) and the connection is closed. The timers sit on uvicorn's httptools protocol,
whose parser callbacks mark where a request's headers and body end.

The same protocol caps a request's head (request line and headers) at `MAX_HEAD_BYTES`: the
parser would otherwise buffer a header line of any length, so a client could make the server
hold as much memory as it cares to send. A longer head gets a 431 and the connection is
closed, counted on the bytes as they arrive (a header line that never ends) and on the head
as parsed (one that arrived in a single read).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_LOG = logging.getLogger("uvicorn.error")

MAX_HEAD_BYTES = 32 * 1024
"""The most a request's line and headers may take: browsers and proxies send a few KiB; 32 KiB
leaves room for large cookies and tracing headers."""


LINGER_S = 2.0
"""How long a refused connection stays open to drain what the client still sends."""


class _HeadTooLarge(Exception):
    pass


def _head_too_large_response() -> bytes:
    body = f"request head (line and headers) over {MAX_HEAD_BYTES} bytes; expected at most that\n".encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


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
        self._in_head = True
        self._head_bytes = 0
        self._refused = False

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
        self._in_head = False
        head = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if head > MAX_HEAD_BYTES:
            raise _HeadTooLarge  # the parser stops; uvicorn answers through send_400_response
        self._arm("body", self.body_timeout)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes = True, 0
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # what a refused client still sends is read and dropped (see _refuse_head)
        counting = self._in_head
        if counting:
            self._head_bytes += len(data)
        super().data_received(data)
        # Only bytes still in the head count: a read that ended the head may carry the body.
        if counting and self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self._refuse_head()

    def send_400_response(self, msg: str) -> None:
        if isinstance(self._parser_error_cause(), _HeadTooLarge):
            self._refuse_head()
            return
        super().send_400_response(msg)

    def _parser_error_cause(self) -> BaseException | None:
        error = sys.exc_info()[1]
        return None if error is None else error.__context__

    def _refuse_head(self) -> None:
        # Closing a socket with unread bytes resets the connection, and the reset can overtake
        # the answer: the answer goes with a FIN, what still comes is read and dropped, and the
        # socket is closed a little later.
        self._disarm()
        self._refused = True
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        _LOG.warning("%s: request head over %d bytes; refused (431), connection closed", client, MAX_HEAD_BYTES)
        self.transport.write(_head_too_large_response())
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

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
