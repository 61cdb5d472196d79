"""Chunked framing: whether a response's body is chunked at all, decided once from its head as
the parser decides it (``framing``); and, read without the parser, a read that is nothing but
whole chunks (``whole_chunks``), which goes on as it came or is cut into its pieces
(``chunk_pieces``). What passes here is a part of the chunked framing httptools' parser accepts
(tests/http/test_chunks.py checks the two against each other).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

BodyPiece = Callable[[bytes], None]  # takes one parsed piece of a body
_MAX_CHUNK_DIGITS: Final = 8  # a longer chunk size is the parser's to judge

# What a response's Transfer-Encoding makes of its body (``framing``).
UNFRAMED: Final = 0  # codings the proxy cannot relay as they are meant: the response is refused
CHUNKED: Final = 1  # chunked, and the parser reads it so
UNCODED: Final = 2  # identity only: its Content-Length frames it, or the connection's close


def framing(values: list[str]) -> int:
    """What the ``Transfer-Encoding`` field lines ``values`` (in order) make of a body.

    The codings of every line count, each list trimmed of spaces and tabs, case-insensitive
    (RFC 9112 §6.1). ``CHUNKED`` when ``chunked`` is the last and only once, every other coding
    ``identity`` (none); ``UNCODED`` for ``identity`` alone. Anything else is ``UNFRAMED``:
    ``gzip, chunked`` (a transfer coding the proxy does not undo), ``chunked, identity`` or a
    later ``Transfer-Encoding: identity`` line (httptools then reads the chunked bytes to the
    close, as RFC 9112 says), ``xchunked``, ``chunked;x=1``, an empty element, a byte that is
    not ASCII. ``CHUNKED`` is said only where httptools' llhttp frames the body as chunked too
    (the last line's last coding, with only spaces after it), so that the whole-chunk fast path
    never runs on a body the parser reads otherwise (tests/http/test_chunks.py holds the two
    to it).
    """
    if len(values) == 1 and values[0] == "chunked":
        return CHUNKED  # what every server sends: decided without a split
    codings: list[str] = []
    for value in values:
        if not value.isascii():  # str.lower() folds some non-ASCII letters into ASCII ones
            return UNFRAMED
        for element in value.split(","):
            codings.append(element.lstrip(" \t").rstrip(" ").lower())
    last = codings.pop()
    for coding in codings:
        if coding != "identity":
            return UNFRAMED
    if last == "chunked":
        return CHUNKED
    return UNCODED if last == "identity" else UNFRAMED


def whole_chunks(data: bytes) -> int:
    """The body bytes in ``data`` when it is nothing but whole chunks, each ``HEX CRLF data
    CRLF`` with no extension, none the last (zero-sized) chunk; else 0, and the parser reads
    it. What passes here is a part of the chunked framing the parser accepts."""
    end = len(data)
    at = 0
    total = 0
    while at < end:
        size = 0
        start = at
        while at < end and at - start <= _MAX_CHUNK_DIGITS:
            c = data[at]
            if 48 <= c <= 57:  # 0-9
                size = size * 16 + c - 48
            elif 97 <= c <= 102:  # a-f
                size = size * 16 + c - 87
            elif 65 <= c <= 70:  # A-F
                size = size * 16 + c - 55
            else:
                break
            at += 1
        if size == 0 or at - start > _MAX_CHUNK_DIGITS:
            return 0
        if at + 2 > end or data[at] != 13 or data[at + 1] != 10:
            return 0
        at += 2 + size
        if at + 2 > end or data[at] != 13 or data[at + 1] != 10:
            return 0
        at += 2
        total += size
    return total


def chunk_payload(data: bytes) -> bytes:
    """The chunks' data of ``data``, which ``whole_chunks`` passed, in one piece."""
    pieces: list[bytes] = []
    chunk_pieces(data, pieces.append)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def chunk_pieces(data: bytes, into: BodyPiece) -> None:
    """Each chunk's data of ``data``, which ``whole_chunks`` passed, to ``into``."""
    at = 0
    end = len(data)
    while at < end:
        size = 0
        c = data[at]
        while c != 13:
            size = size * 16 + (c - 48 if c <= 57 else (c | 32) - 87)
            at += 1
            c = data[at]
        at += 2
        into(data[at : at + size])
        at += size + 2
