"""Chunked framing read without the parser: a read that is nothing but whole chunks
(``whole_chunks``) goes on as it came, or is cut into its pieces (``chunk_pieces``). What passes
here is a part of the chunked framing httptools' parser accepts (tests/http/test_chunks.py
checks the two against each other).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

BodyPiece = Callable[[bytes], None]  # takes one parsed piece of a body
_MAX_CHUNK_DIGITS: Final = 8  # a longer chunk size is the parser's to judge


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
