"""Reads of whole chunks skip the parser: from where it stands between two chunks, such a read
leaves it standing there again, so the connection hands the read on itself (written on as it
came, to a relay whose client is chunked too). Checked against httptools, byte by byte, over
chunked bodies cut into reads at random places."""

from __future__ import annotations

import asyncio
import random
import zlib

import httptools
import pytest

from proxy.http.chunks import chunk_payload, chunk_pieces, whole_chunks
from proxy.http.connection import UpstreamConnection
from proxy.http.response import COMPLETE, FramedSink, UpstreamResponse

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
CASES = 300  # random bodies, each cut into reads at random places
LIMIT = 1 << 20


class Parsed:
    """What httptools makes of a response: its body pieces and whether the message ended."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.complete = False

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


def parse(answer: bytes) -> Parsed:
    parsed = Parsed()
    httptools.HttpResponseParser(parsed).feed_data(answer)
    return parsed


def chunk(data: bytes, size_line: bytes | None = None) -> bytes:
    return (size_line if size_line is not None else b"%x" % len(data)) + b"\r\n" + data + b"\r\n"


@pytest.mark.parametrize(
    "data",
    [
        chunk(b"hello"),
        chunk(b"data: {}\n\n") + chunk(b"x" * 300),
        chunk(b"\r\n0\r\n\r\n"),  # framing bytes inside a chunk's data are data
        chunk(b"0123456789", b"A"),  # upper-case hex
        chunk(b"abc", b"00000003"),  # leading zeros, up to eight digits
    ],
)
def test_whole_chunks_are_counted_and_cut_as_the_parser_cuts_them(data: bytes) -> None:
    parsed = parse(HEAD + data + b"0\r\n\r\n")
    assert parsed.complete
    assert whole_chunks(data) == len(b"".join(parsed.pieces))
    pieces: list[bytes] = []
    chunk_pieces(data, pieces.append)
    assert pieces == parsed.pieces
    assert chunk_payload(data) == b"".join(parsed.pieces)  # a fan-out child's read, in one


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"5\r\nhello",  # the chunk's CRLF is still to come
        b"5\r\nhello\r",
        b"5\r\nhel",
        b"5\r\n",
        b"5",
        chunk(b"hello") + b"3\r\nab",  # whole, then a part
        chunk(b"hello") + b"3",
        b"0\r\n\r\n",  # the last chunk: the parser ends the message
        chunk(b"hello") + b"0\r\n\r\n",
        b'5;name="v"\r\nhello\r\n',  # an extension
        b"5 \r\nhello\r\n",
        b"5\nhello\r\n",  # LF alone
        b"5\r\nhelloXY",  # no CRLF after the data
        b"5\r\nhello\n\r",
        chunk(b"abc", b"000000003"),  # nine digits
        chunk(b"abc", b"+3"),
        chunk(b"abc", b"0x3"),
        b"ZZ\r\nmore\r\n",
        b"\r\n",
        b"fffffffff\r\n",
    ],
)
def test_anything_else_is_left_to_the_parser(data: bytes) -> None:
    assert whole_chunks(data) == 0


class Transport:
    """The socket's side of a connection, for driving ``data_received`` by hand."""

    def __init__(self) -> None:
        self.reading = True
        self.aborted = False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.aborted

    def write(self, data: bytes) -> None:
        pass


def a_body(rng: random.Random) -> tuple[list[bytes], bytes]:
    """A chunked body as some server may send it (sizes in either case and with leading zeros,
    the odd extension, maybe trailers), chunk by chunk, and the bytes it carries."""
    chunks, body = [], b""
    for _ in range(rng.randint(1, 12)):
        data = bytes(rng.choice(b"ab\r\n0:") for _ in range(rng.randint(1, 300)))
        size = b"%x" % len(data)
        if rng.random() < 0.2:
            size = size.upper()
        if rng.random() < 0.1:
            size = b"0" * rng.randint(1, 3) + size
        if rng.random() < 0.05:
            size += b";ext=1"
        chunks.append(chunk(data, size))
        body += data
    chunks.append(b"0\r\nX-Trailer: t\r\n\r\n" if rng.random() < 0.2 else b"0\r\n\r\n")
    return chunks, body


def reads(rng: random.Random, chunks: list[bytes]) -> list[bytes]:
    """The head and ``chunks`` cut at a few random places, or at chunk ends only, some reads
    holding several (as a server writes them and the kernel coalesces them)."""
    answer = HEAD + b"".join(chunks)
    if rng.random() < 0.5:
        cuts = sorted(rng.sample(range(1, len(answer)), min(rng.randint(0, 6), len(answer) - 1)))
    else:
        ends = [len(HEAD)]
        for piece in chunks[:-1]:
            ends.append(ends[-1] + len(piece))
        cuts = [end for end in ends if rng.random() < 0.7]
    out, at = [], 0
    for cut in [*cuts, len(answer)]:
        if cut > at:
            out.append(answer[at:cut])
            at = cut
    return out


def connected(inflate: bool = False) -> tuple[UpstreamConnection, UpstreamResponse]:
    loop = asyncio.get_running_loop()
    connection = UpstreamConnection(loop, ("127.0.0.1", 1, None))
    connection.connection_made(Transport())  # type: ignore[arg-type]
    response = UpstreamResponse(connection, "GET", LIMIT, inflate)
    connection.begin(response)
    return connection, response


class Relayed(FramedSink):
    """What a relay to a chunked client writes, framed as the client gets it, and the reads it
    wrote on as they came."""

    def __init__(self) -> None:
        self.client: list[bytes] = []
        self.as_they_came: list[bytes] = []

    def write(self, data: bytes) -> bool:
        self.client.append(b"%x\r\n%b\r\n" % (len(data), data))
        return False

    def write_framed(self, data: bytes, size: int) -> bool:
        assert size == len(b"".join(parse(HEAD + data + b"0\r\n\r\n").pieces))  # its body bytes
        self.client.append(data)
        self.as_they_came.append(data)
        return False


async def relay(cut: list[bytes]) -> tuple[Relayed, UpstreamResponse]:
    """``cut`` read by a connection, relayed as a pass-through relays: once the head is in."""
    connection, response = connected(inflate=True)
    relayed = Relayed()
    reads = iter(cut)
    for data in reads:
        connection.data_received(data)
        if response.head.done():
            break

    async def drain() -> None:
        raise AssertionError("never full")

    task = asyncio.ensure_future(response.relay(relayed.write, lambda: False, drain, relayed))
    await asyncio.sleep(0)  # the relay has begun
    for data in reads:
        connection.data_received(data)
    async with asyncio.timeout(30):
        await task
    return relayed, response


async def test_every_body_cut_anywhere_reaches_the_client_as_the_parser_reads_it() -> None:
    rng = random.Random(20261203)
    skipped = 0
    for _ in range(CASES):
        chunks, body = a_body(rng)
        cut = reads(rng, chunks)
        relayed, response = await relay(cut)
        assert response.state == COMPLETE, (cut, response.error)
        parsed = parse(HEAD + b"".join(relayed.client) + b"0\r\n\r\n")  # write_eof's chunk
        assert parsed.complete, cut
        assert b"".join(parsed.pieces) == body, cut
        skipped += len(relayed.as_they_came)
        # Iterated (a fan-out's JSON child): the same body.
        connection, response = connected()
        for data in cut:
            connection.data_received(data)
        assert response.state == COMPLETE
        assert await response.read(LIMIT) == body
    assert skipped > CASES  # the parser was skipped, often: the point of it


async def test_a_server_that_writes_chunk_by_chunk_is_written_on_read_for_read() -> None:
    pieces = [b"data: %d\n\n" % i for i in range(5)]
    relayed, response = await relay([HEAD, *(chunk(p) for p in pieces), b"0\r\n\r\n"])
    assert response.state == COMPLETE
    assert relayed.as_they_came == [chunk(p) for p in pieces]
    assert relayed.client == relayed.as_they_came


async def test_after_a_read_that_ends_inside_a_chunk_the_parser_reads_on() -> None:
    cut = [HEAD, b"5\r\nhel", b"lo\r\n", chunk(b"abc"), b"3\r\nxyz\r\n0\r\n\r\n"]
    relayed, response = await relay(cut)
    assert response.state == COMPLETE
    # "lo\r\n" ends where a chunk does: the next read is whole chunks, the last is not.
    assert relayed.as_they_came == [chunk(b"abc")]
    assert relayed.client == [b"3\r\nhel\r\n", b"2\r\nlo\r\n", chunk(b"abc"), b"3\r\nxyz\r\n"]


# Chunk data that reads as whole chunks too when read from the wrong place: 0x21 bytes which,
# one byte too far on, read as "1\r\nx\r\n" then "1a\r\n" and 26 bytes; and 0xc bytes that
# do from their first.
TRAP = b"x\r\n1a\r\n" + b"y" * 26
TRAP_AFTER_SIZE = b"1\r\nx\r\n3\r\nabc"
ENDS = {
    "inside-a-size-line-after-the-head": [HEAD + b"2", b"1\r\n" + TRAP + b"\r\n"],
    "inside-a-size-line-after-a-chunk": [HEAD + chunk(b"hi") + b"2", b"1\r\n" + TRAP + b"\r\n"],
    "after-a-size-line": [HEAD + b"c\r\n", TRAP_AFTER_SIZE + b"\r\n"],
    "inside-a-chunk's-data": [HEAD + b"f\r\n1\r\n", TRAP_AFTER_SIZE + b"\r\n"],
}


@pytest.mark.parametrize("cut", ENDS.values(), ids=ENDS.keys())
async def test_a_read_that_ends_between_two_chunks_only_looks_so_is_no_boundary(
    cut: list[bytes],
) -> None:
    assert len(TRAP) == 0x21
    assert len(TRAP_AFTER_SIZE) == 0xC
    cut = [*cut, b"0\r\n\r\n"]
    relayed, response = await relay(cut)
    assert response.state == COMPLETE
    parsed = parse(HEAD + b"".join(relayed.client) + b"0\r\n\r\n")
    assert b"".join(parsed.pieces) == b"".join(parse(b"".join(cut)).pieces)
    assert relayed.as_they_came == []


async def test_a_body_of_known_length_that_looks_like_chunks_is_the_parsers() -> None:
    body = chunk(b"hello") + chunk(b"world")
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
    relayed, response = await relay([head, body])
    assert response.state == COMPLETE
    assert relayed.as_they_came == []
    assert relayed.client == [b"%x\r\n%b\r\n" % (len(body), body)]


async def test_a_compressed_chunked_body_is_inflated_not_written_on() -> None:
    head = HEAD[:-2] + b"Content-Encoding: deflate\r\n\r\n"
    relayed, response = await relay([head, chunk(zlib.compress(b"hello world")), b"0\r\n\r\n"])
    assert response.state == COMPLETE
    assert relayed.as_they_came == []
    assert b"".join(relayed.client) == chunk(b"hello world")
