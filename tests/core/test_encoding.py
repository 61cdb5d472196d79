"""Request Content-Encoding: literal bytes in, plain bytes or an error out."""

from __future__ import annotations

import gzip
import zlib

import pytest

from proxy.core.encoding import content_codings, inflate
from proxy.core.errors import BodyTooLarge, InvalidRequest, UnsupportedEncoding

BODY = b'{"model": "m", "n": 2, "messages": []}'


@pytest.mark.parametrize(
    ("header", "codings"),
    [
        (None, []),
        ("", []),
        ("identity", []),
        ("gzip", ["gzip"]),
        ("GZIP , identity", ["gzip"]),
        ("deflate, gzip", ["deflate", "gzip"]),
        ("br", ["br"]),
    ],
)
def test_content_codings_in_the_order_applied(header: str | None, codings: list[str]) -> None:
    assert content_codings(header) == codings


@pytest.mark.parametrize(
    ("raw", "codings"),
    [
        (gzip.compress(BODY), ["gzip"]),
        (gzip.compress(BODY), ["x-gzip"]),
        (zlib.compress(BODY), ["deflate"]),
        (zlib.compress(BODY, wbits=-15), ["deflate"]),  # raw DEFLATE, as many clients send
        (gzip.compress(BODY[:10]) + gzip.compress(BODY[10:]), ["gzip"]),  # two members
        (gzip.compress(zlib.compress(BODY)), ["deflate", "gzip"]),
        (BODY, []),
    ],
)
def test_inflate_undoes_every_coding(raw: bytes, codings: list[str]) -> None:
    assert inflate(raw, codings, 1 << 20) == BODY


def test_inflate_accepts_a_body_of_exactly_the_limit() -> None:
    assert inflate(gzip.compress(BODY), ["gzip"], len(BODY)) == BODY


def test_inflate_stops_one_step_past_the_limit() -> None:
    with pytest.raises(BodyTooLarge):
        inflate(gzip.compress(BODY), ["gzip"], len(BODY) - 1)


def test_a_bomb_is_never_expanded_whole() -> None:
    bomb = gzip.compress(b"0" * (64 << 20))
    with pytest.raises(BodyTooLarge) as info:
        inflate(bomb, ["gzip"], 1 << 20)
    assert info.value.status == 413


@pytest.mark.parametrize("codings", [["br"], ["zstd"], ["compress"], ["gzip", "br"]])
def test_unknown_codings_are_415(codings: list[str]) -> None:
    with pytest.raises(UnsupportedEncoding) as info:
        inflate(gzip.compress(BODY), codings, 1 << 20)
    assert info.value.status == 415


@pytest.mark.parametrize(
    ("raw", "coding"),
    [
        (b"not gzip at all", "gzip"),
        (gzip.compress(BODY)[:-9], "gzip"),  # truncated
        (gzip.compress(BODY) + b"junk", "gzip"),
        (zlib.compress(BODY) + b"junk", "deflate"),
        (b"\x78\x9c garbage", "deflate"),
    ],
)
def test_a_body_that_is_not_its_coding_is_400(raw: bytes, coding: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        inflate(raw, [coding], 1 << 20)
    assert info.value.status == 400
