"""Child bodies in gzip or deflate are inflated in bounded steps: a bomb never expands.

The pure ``Inflater`` with literal bytes, then a real bomb (3 MB of gzip, 3 GiB inflated) through
a streamed and a JSON fan-out, with the proxy's resident memory sampled all along.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import orjson
import psutil
import pytest

from proxy.config.models import single_upstream_config
from proxy.core.encoding import Inflater
from tests.support.rawhttp import parse_raw
from tests.support.rawupstream import RawUpstream, exchange
from tests.support.servers import start_proxy

CHAT = "/v1/chat/completions"
MiB = 1 << 20


def _bomb(blocks: int) -> bytes:
    """One gzip member inflating to ``blocks`` x 16 MiB of zeros (its trailer never reached):
    after a full flush, the compressor writes each block of zeros as the same bytes."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(16 * MiB)
    first = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    repeat = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    return first + repeat * (blocks - 1)


BOMB = _bomb(200)


def _drain(inflater: Inflater, room: int) -> list[bytes]:
    out = []
    for _ in range(100_000):  # bounded
        if not inflater.pending:
            break
        piece = inflater.read(room)
        assert len(piece) <= room
        out.append(piece)
    return out


@pytest.mark.parametrize("coding", ["gzip", "x-gzip", "deflate"])
@pytest.mark.parametrize("room", [1, 7, 4096])
def test_inflater_gives_at_most_room_bytes_per_read(coding: str, room: int) -> None:
    plain = b"data: token\n\n" * 500
    packed = gzip.compress(plain) if coding != "deflate" else zlib.compress(plain)
    inflater = Inflater(coding)
    for i in range(0, len(packed), 100):  # input in pieces, as reads bring it
        inflater.feed(packed[i : i + 100])
    out = _drain(inflater, room)
    assert b"".join(out) + inflater.close() == plain


def test_inflater_reads_concatenated_gzip_members() -> None:
    inflater = Inflater("gzip")
    inflater.feed(gzip.compress(b"one,") + gzip.compress(b"two"))
    assert b"".join(_drain(inflater, 3)) + inflater.close() == b"one,two"


@pytest.mark.parametrize(
    ("coding", "data"),
    [("gzip", b"not gzip at all"), ("deflate", zlib.compress(b"x") + b"trailing")],
)
def test_inflater_rejects_a_corrupt_body(coding: str, data: bytes) -> None:
    inflater = Inflater(coding)
    inflater.feed(data)
    with pytest.raises(zlib.error):
        _drain(inflater, 1024)


def test_inflater_holds_a_bomb_as_input_not_output() -> None:
    inflater = Inflater("gzip")
    inflater.feed(BOMB)
    assert len(inflater.read(64 * 1024)) == 64 * 1024
    assert inflater.pending


class Peak:
    """The process's resident memory, sampled every millisecond in a thread."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.start = self.process.memory_info().rss
        self.peak = self.start
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start


@contextmanager
def sampled() -> Iterator[Peak]:
    peak = Peak()
    thread = threading.Thread(target=peak.run, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        peak._stop.set()
        thread.join(5)


@pytest.fixture
async def bomb_port() -> AsyncIterator[int]:
    upstream = await RawUpstream().start()
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: %d\r\n\r\n"
    )
    upstream.scripts[CHAT] = head % (b"text/event-stream", len(BOMB)) + BOMB
    upstream.scripts[CHAT + "?json"] = head % (b"application/json", len(BOMB)) + BOMB
    config = single_upstream_config(upstream.url, max_response_bytes=2 * MiB)
    runner, url = await start_proxy(config)
    yield int(url.rsplit(":", 1)[1])
    await runner.cleanup()
    await upstream.stop()


def _post(path: str, body: dict[str, object]) -> bytes:
    raw = orjson.dumps(body)
    return (
        b"POST %s HTTP/1.1\r\nHost: p\r\nConnection: close\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(raw), raw)
    )


async def test_a_gzip_bomb_in_a_streamed_fanout_fails_the_stream_within_the_caps(
    bomb_port: int,
) -> None:
    body = {"model": "m", "messages": [], "n": 2, "stream": True}
    with sampled() as peak:
        raw = await exchange(bomb_port, _post(CHAT, body))
    status_line, _, text = parse_raw(raw)
    assert status_line.split()[1] == "200"
    assert b'"error"' in text
    assert text.rstrip().endswith(b"data: [DONE]")
    assert peak.growth < 48 * MiB, peak.growth


async def test_a_gzip_bomb_in_a_json_fanout_is_a_502_within_the_caps(bomb_port: int) -> None:
    body = {"model": "m", "messages": [], "n": 2}
    with sampled() as peak:
        raw = await exchange(bomb_port, _post(CHAT + "?json", body))
    status_line, _, text = parse_raw(raw)
    assert status_line.split()[1] == "502", text[:300]
    assert peak.growth < 48 * MiB, peak.growth
