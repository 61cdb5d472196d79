"""One framing decision: a response's Transfer-Encoding, every line of it, decides once per head
whether its body is chunked, as httptools' parser (llhttp) frames it; a coding the proxy cannot
relay as meant fails the response before a byte of its body is handed on. What llhttp does with
each head is recorded here from its own callbacks, beside what the proxy decides."""

from __future__ import annotations

import random
from collections import Counter

import httptools
import pytest

from proxy.http.chunks import CHUNKED, UNCODED, UNFRAMED, framing
from proxy.http.errors import BadResponse
from proxy.http.response import COMPLETE, FAILED
from tests.http.test_chunks import chunk, connected, relay

BODY = chunk(b"hello") + b"0\r\n\r\n"
KELVIN = "\u212a".encode()  # KELVIN SIGN: "chun\u212aed".lower() == "chunked" in Python


class Framed:
    """What llhttp hands on of a head's Transfer-Encoding lines, and how it reads the body."""

    def __init__(self) -> None:
        self.values: list[bytes] = []
        self.chunked = False
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"transfer-encoding":
            self.values.append(value)

    def on_chunk_header(self) -> None:
        self.chunked = True

    def on_message_complete(self) -> None:
        self.complete = True


def head(lines: list[bytes]) -> bytes:
    fields = b"".join(b"Transfer-Encoding: %b\r\n" % line for line in lines)
    return b"HTTP/1.1 200 OK\r\n" + fields + b"\r\n"


def parsed(lines: list[bytes]) -> tuple[list[str], str | None]:
    """The Transfer-Encoding values as the connection takes them (UTF-8, else surrogate
    escapes), and how llhttp frames the body: "chunked", "close" (read to the connection's
    end), or None when it refuses the head."""
    framed = Framed()
    try:
        httptools.HttpResponseParser(framed).feed_data(head(lines) + BODY)
    except httptools.HttpParserError:
        return [], None
    assert framed.complete is framed.chunked  # read to the close, the message never ends here
    values = [value.decode("utf-8", "surrogateescape") for value in framed.values]
    return values, "chunked" if framed.chunked else "close"


# The lines of a head's Transfer-Encoding: how llhttp frames the body, and what the proxy makes
# of it. The proxy says chunked only where llhttp reads chunked, and refuses where it could not
# relay the body as meant: codings it does not undo (gzip), chunked read to the close (not last),
# chunked twice, a coding no one registered, a parameter, an empty element, a letter not ASCII.
HEADS = {
    "chunked": ([b"chunked"], "chunked", CHUNKED),
    "Chunked": ([b"Chunked"], "chunked", CHUNKED),
    "chunked-then-spaces": ([b"chunked  "], "chunked", CHUNKED),
    "identity, chunked": ([b"identity, chunked"], "chunked", CHUNKED),
    "identity-line, chunked-line": ([b"identity", b"chunked"], "chunked", CHUNKED),
    "identity ,<tab>chunked": ([b"identity ,\tchunked"], "chunked", CHUNKED),
    "identity": ([b"identity"], "close", UNCODED),
    "chunked, identity": ([b"chunked, identity"], "close", UNFRAMED),
    "chunked-line, identity-line": ([b"chunked", b"identity"], "close", UNFRAMED),
    "xchunked": ([b"xchunked"], "close", UNFRAMED),
    "chunkedx": ([b"chunkedx"], "close", UNFRAMED),
    "gzip, chunked": ([b"gzip, chunked"], "chunked", UNFRAMED),
    "gzip-line, chunked-line": ([b"gzip", b"chunked"], "chunked", UNFRAMED),
    "gzip": ([b"gzip"], "close", UNFRAMED),
    "chunked, chunked": ([b"chunked, chunked"], "chunked", UNFRAMED),
    "chunked-line, chunked-line": ([b"chunked", b"chunked"], "chunked", UNFRAMED),
    "chunked;x=1": ([b"chunked;x=1"], "close", UNFRAMED),
    "chunked<tab>": ([b"chunked\t"], "close", UNFRAMED),
    "chunked, <empty>": ([b"chunked, "], "close", UNFRAMED),
    "<empty>, chunked": ([b", chunked"], "chunked", UNFRAMED),
    "chun<kelvin>ed": ([b"chun" + KELVIN + b"ed"], "close", UNFRAMED),
}


@pytest.mark.parametrize(("lines", "parser", "proxy"), HEADS.values(), ids=HEADS.keys())
def test_the_proxy_says_chunked_only_where_the_parser_reads_chunked(
    lines: list[bytes], parser: str, proxy: int
) -> None:
    values, framed = parsed(lines)
    assert framed == parser  # what llhttp does, recorded
    assert framing(values) == proxy


def test_a_head_with_content_length_and_transfer_encoding_is_refused_by_the_parser() -> None:
    # RFC 9112 §6.3: Transfer-Encoding wins, and a proxy must not forward both; llhttp 9 refuses
    # the head outright, in either order (a malformed response: 502).
    for lines in ([b"Content-Length: 5", b"Transfer-Encoding: chunked"],
                  [b"Transfer-Encoding: chunked", b"Content-Length: 5"],
                  [b"Content-Length: 5", b"Transfer-Encoding: identity"]):  # fmt: skip
        answer = b"HTTP/1.1 200 OK\r\n" + b"".join(line + b"\r\n" for line in lines) + b"\r\n"
        with pytest.raises(httptools.HttpParserError, match=r"Content-Length|Transfer-Encoding"):
            httptools.HttpResponseParser(Framed()).feed_data(answer + BODY)


def test_on_any_transfer_encoding_the_proxy_says_chunked_only_where_the_parser_does() -> None:
    rng = random.Random(20261205)
    words = [b"chunked", b"Chunked", b"CHUNKED", b"identity", b"Identity", b"gzip", b"chunk",
             b"xchunked", b"chun" + KELVIN + b"ed", b"chunked" + KELVIN, b";q=1", b"=",
             b'"']  # fmt: skip
    glue = [b",", b", ", b" ,", b" ", b"\t", b"", b",\t", b"  "]
    decided: Counter[int] = Counter()
    for _ in range(5000):
        lines = []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            parts = [rng.choice(words) for _ in range(rng.randint(1, 3))]
            line = rng.choice(glue).join(parts)
            lines.append(rng.choice((b"", b" ", b"\t")) + line + rng.choice((b"", b" ", b"\t")))
        values, framed = parsed(lines)
        if framed is None:
            continue  # llhttp refuses the head: a 502, whatever the proxy would say
        proxy = framing(values)
        decided[proxy] += 1
        if proxy == CHUNKED:
            assert framed == "chunked", lines
        elif proxy == UNCODED:
            assert framed == "close", lines
    assert min(decided[CHUNKED], decided[UNCODED], decided[UNFRAMED]) > 50, decided


# --- on a connection -----------------------------------------------------------------------------


async def test_a_coding_the_proxy_cannot_frame_fails_at_the_head_and_closes_the_connection() -> (
    None
):
    # The head: the fast path took "5\r\nhello\r\n" as a chunk while httptools read the
    # body to the close, and the client got "hello0\r\n\r\n" and then a reset.
    connection, response = connected()
    connection.data_received(head([b"chunked, identity"]))
    connection.data_received(chunk(b"hello"))
    assert response.state == FAILED
    assert isinstance(response.error, BadResponse)
    assert "Transfer-Encoding the proxy cannot frame: chunked, identity" in str(response.error)
    assert response.head.done()
    assert isinstance(response.head.exception(), BadResponse)
    assert connection.transport.aborted  # type: ignore[union-attr]
    assert list(response._chunks) == []  # not a byte of the body handed on


@pytest.mark.parametrize(
    "lines", [[b"identity, chunked"], [b"identity", b"chunked"], [b"CHUNKED  "]]
)
async def test_chunked_last_after_identity_is_chunked_and_takes_the_fast_path(
    lines: list[bytes],
) -> None:
    pieces = [chunk(b"hello"), chunk(b" world")]
    relayed, response = await relay([head(lines), *pieces, b"0\r\n\r\n"])
    assert response.state == COMPLETE
    assert relayed.as_they_came == pieces  # whole chunks from a boundary: on as they came
    assert relayed.client == pieces


async def test_identity_alone_is_read_to_the_close_as_it_came() -> None:
    connection, response = connected()
    connection.data_received(head([b"identity"]))
    connection.data_received(BODY)  # looks like chunks: it is the body itself
    connection.connection_lost(None)
    assert response.state == COMPLETE
    assert await response.read(1 << 20) == BODY


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
async def test_a_response_without_a_body_is_not_judged_on_its_transfer_encoding(
    status: bytes,
) -> None:
    connection, response = connected()
    connection.data_received(b"HTTP/1.1 %b\r\nTransfer-Encoding: gzip, chunked\r\n\r\n" % status)
    assert response.state == COMPLETE
