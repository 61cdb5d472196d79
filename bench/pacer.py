"""A paced streaming upstream: one timer for every open stream, one ~240 B chunk to each per step.

What a busy vLLM looks like to a sidecar: hundreds of streams, each getting one small
``chat.completion.chunk`` per decode step. Each chunk carries ``"ts"``, the CLOCK_MONOTONIC
second it was written, so a client on the same machine can tell the latency each hop added.
Every request (any path, any body) is answered with ``max_tokens`` chunks (default 1,000), a
finishing chunk and ``[DONE]``, chunked, on a keep-alive connection.

    python -m bench.pacer --port 8100 --step 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import time
from typing import cast

import httptools

from bench.streams import run_async

_MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')
_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_PREFIX = (
    b'data: {"id":"chatcmpl-pacer","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench-model","system_fingerprint":"fp_pacer","choices":[{"index":0,'
    b'"delta":{"content":" token"},"logprobs":null,"finish_reason":null}],"ts":'
)
_FINISH = (
    b'data: {"id":"chatcmpl-pacer","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench-model","system_fingerprint":"fp_pacer","choices":[{"index":0,'
    b'"delta":{},"logprobs":null,"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)
_MAX_STREAM = 100_000  # steps: bounds every stream even if asked for more


def _framed(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def chunk(at: float) -> bytes:
    return _PREFIX + b"%.6f}\n\n" % at


class _Stream:
    __slots__ = ("conn", "left")

    def __init__(self, conn: _Conn, left: int) -> None:
        self.conn = conn
        self.left = left


class Pacer:
    """The one timer: every ``step`` seconds, one chunk to every open stream."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.streams: list[_Stream] = []
        self._loop = asyncio.get_running_loop()
        self._next = self._loop.time() + step
        self._loop.call_at(self._next, self._tick)

    def _tick(self) -> None:
        framed = _framed(chunk(time.monotonic()))
        alive = []
        for stream in self.streams:
            transport = stream.conn.transport
            if transport is None or transport.is_closing():
                continue
            transport.write(framed)
            stream.left -= 1
            if stream.left > 0:
                alive.append(stream)
            else:
                transport.write(_framed(_FINISH) + b"0\r\n\r\n")
        self.streams = alive
        self._next += self.step
        now = self._loop.time()
        if self._next < now:  # fell behind: skip steps rather than burst
            self._next = now + self.step
        self._loop.call_at(self._next, self._tick)


class _Conn(asyncio.Protocol):
    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.body = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_message_begin(self) -> None:
        self.body = b""

    def on_body(self, body: bytes) -> None:
        if len(self.body) < 65536:
            self.body += body

    def on_message_complete(self) -> None:
        if self.transport is None:
            return
        if self.parser.get_method() != b"POST":
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"
            )
            return
        found = _MAX_TOKENS.search(self.body)
        steps = min(int(found.group(1)) if found else 1000, _MAX_STREAM)
        self.transport.write(_HEAD)
        self.pacer.streams.append(_Stream(self, max(steps, 1)))


async def serve(port: int, step: float) -> None:
    pacer = Pacer(step)
    server = await asyncio.get_running_loop().create_server(
        lambda: _Conn(pacer), "127.0.0.1", port, backlog=4096
    )
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pacer", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step", type=float, default=0.05, help="seconds between chunks")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        run_async(serve(args.port, args.step))


if __name__ == "__main__":
    main()
