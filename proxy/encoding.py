"""Request ``Content-Encoding`` on fan-out paths: gzip and deflate undone within a bound. Pure.

The proxy reads a fan-out body to plan its children, so it must see the JSON; children then get
plain JSON. Inflation is incremental and stops one byte past the limit: a bomb never expands.
"""

from __future__ import annotations

import zlib

from proxy.errors import BodyTooLarge, InvalidRequest, UnsupportedEncoding

_GZIP = 16 + zlib.MAX_WBITS
_WBITS = {"gzip": _GZIP, "x-gzip": _GZIP, "deflate": zlib.MAX_WBITS}


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
        if coding not in _WBITS:
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
