"""A client's HTTP/1.x request head, read for the fast completion path (`fast_path`). Pure.

`parse_head(buf, start)` reads the head that begins at `buf[start]`:

- None: it has not all arrived (no empty line yet, and under MAX_HEAD_BYTES);
- a `ClientHead`: a plain head the fast path serves itself;
- HAND_OFF: anything else, for aiohttp to answer as it always did (its own 400s for
  malformed HTTP, 100-continue, chunked bodies, upgrades, heads past MAX_HEAD_BYTES).

NOTE: the fast path accepts a strict subset of what aiohttp accepts, never more: a request
line `METHOD /target HTTP/1.0|1` with single spaces, CRLF line ends only, header names that
are tokens, values of visible characters, spaces and tabs (no folding), at most one
Content-Length of plain digits, and no Transfer-Encoding, Expect or Upgrade. A head outside
it is never half-read here: what could smuggle a second request past one parser reaches
only aiohttp's.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

# aiohttp's own bound on a request line or one header line is 8190 bytes: a bigger head is
# aiohttp's to refuse (431/400), never buffered here.
MAX_HEAD_BYTES: Final = 8192
# Content-Length digits past this are not a length any limit admits (aiohttp decides).
MAX_LENGTH_DIGITS: Final = 18

_REQUEST_LINE: Final = re.compile(rb"([A-Z]{1,16}) (/[\x21-\x7e]*) HTTP/1\.([01])")
# Every header line at once: a token, a colon, then visible ASCII, spaces and tabs (no
# obs-text, no control characters; the spaces around a value are not part of it).
_HEADER_LINES: Final = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t \x21-\x7e]*\r\n)*")
MAX_HEADERS: Final = 128  # aiohttp's bound
# Headers that make a request unusual: aiohttp's machinery handles those.
_HAND_OFF_NAMES: Final = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
# aiohttp refuses a second one of these (RFC 9110's singletons).
_SINGLETONS: Final = frozenset(
    {
        b"content-length",
        b"content-location",
        b"content-range",
        b"content-type",
        b"etag",
        b"host",
        b"max-forwards",
        b"server",
        b"user-agent",
    }
)


class _HandOff:
    __slots__ = ()

    def __repr__(self) -> str:
        return "HAND_OFF"


HAND_OFF: Final = _HandOff()


class ClientHead(NamedTuple):
    method: str
    target: str  # the path and query as sent
    minor: int  # HTTP/1.<minor>
    headers: tuple[tuple[bytes, bytes], ...]  # (name, value) as sent, in order
    content_length: int  # 0 when absent
    keep_alive: bool  # the connection may carry another request after this one
    end: int  # index in the buffer just past the head's empty line

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]


def parse_head(buf: bytes, start: int = 0) -> ClientHead | _HandOff | None:
    """The head at `buf[start:]` (see the module's docstring)."""
    end = buf.find(b"\r\n\r\n", start, start + MAX_HEAD_BYTES)
    if end < 0:
        return HAND_OFF if len(buf) - start >= MAX_HEAD_BYTES else None
    line_end = buf.find(b"\r\n", start)
    first = _REQUEST_LINE.fullmatch(buf, start, line_end)
    if first is None or _HEADER_LINES.fullmatch(buf, line_end + 2, end + 2) is None:
        return HAND_OFF
    lines = buf[line_end + 2 : end].split(b"\r\n") if end > line_end else []
    if len(lines) > MAX_HEADERS:
        return HAND_OFF
    headers = []
    seen: set[bytes] = set()
    length = 0
    connection = b""
    for line in lines:
        name, _, value = line.partition(b":")
        value = value.strip(b" \t")
        lower = name.lower()
        if lower in _SINGLETONS:
            if lower in seen:
                return HAND_OFF
            seen.add(lower)
            if lower == b"content-length":
                if not value.isdigit() or len(value) > MAX_LENGTH_DIGITS:
                    return HAND_OFF
                length = int(value)
        elif lower == b"connection":
            connection += b"," + value.lower()
        elif lower in _HAND_OFF_NAMES:
            return HAND_OFF
        headers.append((name, value))
    minor = int(first.group(3))
    if connection:
        tokens = {token.strip() for token in connection.split(b",")}
        if b"upgrade" in tokens:
            return HAND_OFF
        close = b"close" in tokens
        keep_alive = not close if minor else b"keep-alive" in tokens and not close
    else:
        keep_alive = minor == 1
    return ClientHead(
        first.group(1).decode("ascii"),
        first.group(2).decode("ascii"),
        minor,
        tuple(headers),
        length,
        keep_alive,
        end + 4,
    )
