"""``Content-Encoding`` undone within bounds: gzip and deflate, never a bomb's expansion. Pure.

Request bodies on fan-out paths are inflated whole (the proxy plans children from the JSON;
children then get plain JSON), stopping one byte past the limit. Child response bodies are
inflated in steps (``Inflater``), each no larger than the room the reader has.
"""

from __future__ import annotations

import zlib
from collections import deque

from proxy.core.errors import BodyTooLarge, InvalidRequest, UnsupportedEncoding

_GZIP = 16 + zlib.MAX_WBITS
_WBITS = {"gzip": _GZIP, "x-gzip": _GZIP, "deflate": zlib.MAX_WBITS}
# The codings undone here (``inflate``, ``Inflater``): the only ones children may answer in.
INFLATED = frozenset(_WBITS)


def content_codings(header: str | None) -> list[str]:
    """The codings named in a ``Content-Encoding`` header, in the order they were applied."""
    if header is None:
        return []
    tokens = (t.strip().lower() for t in header.split(","))
    return [t for t in tokens if t and t != "identity"]


def inflate(raw: bytes, codings: list[str], limit: int) -> bytes:
    """``raw`` with every coding undone, the last applied first (RFC 9110 §8.4).

    Unknown codings are 415, a body past ``limit`` bytes once inflated is 413, and a body
    that is not what its coding says is 400.
    """
    for coding in codings:
        if coding not in INFLATED:
            raise UnsupportedEncoding(
                f"Content-Encoding {coding!r} is not supported here; send gzip, deflate or identity"
            )
    for coding in reversed(codings):
        raw = _inflate_one(raw, coding, limit)
    return raw


def _inflate_one(raw: bytes, coding: str, limit: int) -> bytes:
    wbits = _WBITS[coding]
    if coding == "deflate" and not _zlib_header(raw):
        wbits = -zlib.MAX_WBITS  # many clients send raw DEFLATE under this name
    out = bytearray()
    data = raw
    try:
        while True:  # one pass per gzip member: concatenated members are one valid body
            inflater = zlib.decompressobj(wbits)
            while True:
                room = limit + 1 - len(out)  # never 0: that would mean "no limit" to zlib
                chunk = inflater.decompress(data, room)
                out += chunk
                if len(out) > limit:
                    raise BodyTooLarge(f"request body is larger than {limit} bytes once inflated")
                data = inflater.unconsumed_tail
                if inflater.eof or (not data and len(chunk) < room):
                    break
            if not inflater.eof:
                raise InvalidRequest(f"request body is a truncated {coding} stream")
            data = inflater.unused_data
            if not data or wbits != _GZIP:
                break
    except zlib.error as exc:
        raise InvalidRequest(f"request body is not valid {coding}: {exc}") from None
    if data:
        raise InvalidRequest(f"request body has bytes after its {coding} stream")
    return bytes(out)


def _zlib_header(raw: bytes) -> bool:
    """RFC 1950: CM = 8 and the first two bytes, big-endian, a multiple of 31."""
    return len(raw) >= 2 and raw[0] & 0x0F == 8 and (raw[0] << 8 | raw[1]) % 31 == 0


class Inflater:
    """A response body's gzip or deflate, undone at most ``room`` bytes at a time.

    Compressed input waits here until the reader asks for more: however far a body would
    expand, no more than one step of it exists at once.
    """

    def __init__(self, coding: str) -> None:
        self._gzip = coding in ("gzip", "x-gzip")
        # deflate: zlib-wrapped as RFC 9110 says, or gzip-wrapped as some servers send it
        self._wbits = _GZIP if self._gzip else 32 + zlib.MAX_WBITS
        self._decoder = zlib.decompressobj(self._wbits)
        self._input: deque[bytes] = deque()
        self._full = False  # the last step filled its room: zlib may hold more output

    @property
    def pending(self) -> bool:
        """Input not inflated yet, or output zlib may still hold."""
        return bool(self._input) or self._full

    def feed(self, data: bytes) -> None:
        if data:
            self._input.append(data)

    def read(self, room: int) -> bytes:
        """Up to ``room`` (> 0) inflated bytes; raises ``zlib.error`` on a corrupt body."""
        out: list[bytes] = []
        while room > 0 and self.pending:
            decoder = self._decoder
            if decoder.eof:  # input after the end of a stream: another gzip member, or junk
                if not self._gzip:
                    raise zlib.error("bytes after the end of the deflate stream")
                decoder = self._decoder = zlib.decompressobj(self._wbits)
            data = self._input.popleft() if self._input else b""
            chunk = decoder.decompress(data, room)
            if decoder.eof:
                self._full = False
                if decoder.unused_data:  # (unconsumed_tail may repeat it: not read)
                    self._input.appendleft(decoder.unused_data)
            else:
                if decoder.unconsumed_tail:
                    self._input.appendleft(decoder.unconsumed_tail)
                self._full = len(chunk) == room
            if chunk:
                out.append(chunk)
                room -= len(chunk)
        return out[0] if len(out) == 1 else b"".join(out)

    def close(self) -> bytes:
        """What zlib still holds once every input byte was read."""
        return self._decoder.flush()
