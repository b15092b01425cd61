"""Lines of a byte stream, each cut to a maximum length while it is read.

A crash can leave a kernel log with one line of hundreds of megabytes (a run of NUL bytes),
and a 10 MB `.gz` can hold a 2 GB line: splitting the stream first and cutting the line after
would build it whole. Here a line never holds more than `max_bytes` at any moment; the bytes
past that are counted and dropped as they stream by. Both the batch importer
(`ingest.kernel_log_import`) and the live collector (`ingest.collect.log_sources`) read through
this, so the two cut the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO

# Longest line kept: the parser keeps at most 4,096 characters of a message
# (`kernel_log_parser.MAX_MESSAGE_CHARS`, up to 4 bytes each in UTF-8) after a prefix of a few
# dozen; a longer line loses only bytes the parser would have cut anyway.
MAX_LINE_BYTES = 20_000
CHUNK_BYTES = 1 << 20


class CappedLines:
    """Iterating gives the lines of `fh` (without their newline), each cut to `max_bytes`.

    - `offset`: the position just after the last line given (its newline included), counted
      from `start`; a caller that stops early resumes there.
    - `cut`: lines given cut short.
    - `incomplete_last`: give a last line that has no newline (a finished file); otherwise
      it is left unread, as a line still being written.
    """

    def __init__(
        self,
        fh: IO[bytes],
        *,
        start: int = 0,
        max_bytes: int = MAX_LINE_BYTES,
        incomplete_last: bool = True,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes {max_bytes}: expected at least 1")
        self._fh = fh
        self._max = max_bytes
        self._incomplete_last = incomplete_last
        self._chunk = chunk_bytes
        self.offset = start
        self.cut = 0

    def __iter__(self) -> Iterator[bytes]:
        limit = self._max
        head = b""  # the kept start of the line being read
        length = 0  # its whole length so far
        while chunk := self._fh.read(self._chunk):
            parts = chunk.split(b"\n")
            tail = parts.pop()
            if parts:
                first = parts[0]
                whole = length + len(first)
                if length:
                    first = head + first[: max(0, limit - len(head))]
                if whole > limit:
                    self.cut += 1
                    first = first[:limit]
                self.offset += whole + 1
                yield first
                for raw in parts[1:]:
                    self.offset += len(raw) + 1
                    if len(raw) > limit:
                        self.cut += 1
                        raw = raw[:limit]
                    yield raw
                head, length = tail[:limit], len(tail)
            else:
                if len(head) < limit:
                    head += tail[: limit - len(head)]
                length += len(tail)
        if length and self._incomplete_last:
            if length > limit:
                self.cut += 1
            self.offset += length
            yield head
