"""The bench's own upstreams, costing next to nothing: paced SSE streams (``--step``: one timer, one
chunk to every stream per step, each stamped with its send time) or one canned chat.completion."""

import argparse
import asyncio
import contextlib
import re
import time
from typing import cast

import httptools
import orjson

from bench.workload import CHAT_PATH, MODEL, run_async

# A real non-streaming answer: one choice with index 0 and usage, so n-proxy can stitch n of them
# into one n-choice answer. No ' $ or \ in it: nginx's `return` quotes it as text.
_REPLY = "This answer comes back through the proxy unchanged; it stands in for a short reply."
BODY = orjson.dumps({
    "id": "chatcmpl-bench5f0c2a9e41d7b3c8a6e0f1d2", "object": "chat.completion",
    "created": 1733000000, "model": MODEL, "system_fingerprint": "fp_bench_canned",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": _REPLY},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 14, "completion_tokens": 17, "total_tokens": 31},
})  # fmt: skip
HEALTH_PATH = "/health"
MAX_BUFFERED = 1 << 20  # a request that big is not one this bench sends: close the connection
MAX_STREAM = 100_000  # steps: bounds every stream even if asked for more
_MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_CHUNK = (
    b'data: {"id":"chatcmpl-pacer","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench-model","system_fingerprint":"fp_pacer","choices":[{"index":0,'
)
_PREFIX = _CHUNK + b'"delta":{"content":" token"},"logprobs":null,"finish_reason":null}],"ts":'
_FINISH = _CHUNK + b'"delta":{},"logprobs":null,"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'


def _response(status: str, content_type: bytes, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n".encode()
    return head + b"Content-Type: " + content_type + b"\r\n\r\n" + body


_CANNED = _response("200 OK", b"application/json", BODY)
_HEALTHY = _response("200 OK", b"text/plain", b"ok\n")
_NOT_FOUND = _response("404 Not Found", b"text/plain", b"not found\n")


def _framed(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def chunk(at: float) -> bytes:
    """One paced chunk, stamped with its send time ``at``."""
    return _PREFIX + b"%.6f}\n\n" % at


class Pacer:
    """The one timer: every ``step`` seconds, one chunk to every open stream."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.streams: list[tuple[asyncio.Transport, list[int]]] = []  # and the steps left
        self._loop = asyncio.get_running_loop()
        self._next = self._loop.time() + step
        self._loop.call_at(self._next, self._tick)

    def _tick(self) -> None:
        framed = _framed(chunk(time.monotonic()))
        alive = []
        for transport, left in self.streams:
            if transport.is_closing():
                continue
            transport.write(framed)
            left[0] -= 1
            if left[0] > 0:
                alive.append((transport, left))
            else:
                transport.write(_framed(_FINISH) + b"0\r\n\r\n")
        self.streams = alive
        self._next += self.step
        now = self._loop.time()
        if self._next < now:  # fell behind: skip steps rather than burst
            self._next = now + self.step
        self._loop.call_at(self._next, self._tick)


class Upstream(asyncio.Protocol):
    """Keep-alive HTTP/1.1, answers in request order (pipelining works); a paced stream when
    there is a ``pacer``, else the canned answer."""

    def __init__(self, pacer: Pacer | None) -> None:
        self.pacer = pacer
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = self.body = b""
        self.pending = 0  # bytes fed since the last complete request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.pending += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.pending = MAX_BUFFERED + 1
        if self.pending > MAX_BUFFERED and self.transport is not None:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        if len(self.body) < 65536:
            self.body += body

    def on_message_complete(self) -> None:
        path, post = self.url.split(b"?", 1)[0], self.parser.get_method() == b"POST"
        body, self.url, self.body, self.pending = self.body, b"", b"", 0
        if self.transport is None or self.transport.is_closing():
            return
        if self.pacer is not None and post:
            found = _MAX_TOKENS.search(body)
            steps = min(int(found.group(1)) if found else 1000, MAX_STREAM)
            self.transport.write(_SSE_HEAD)
            self.pacer.streams.append((self.transport, [max(steps, 1)]))
        elif path == HEALTH_PATH.encode():
            self.transport.write(_HEALTHY)
        else:
            self.transport.write(_CANNED if post and path == CHAT_PATH.encode() else _NOT_FOUND)
        if not self.parser.should_keep_alive():
            self.transport.close()


async def serve(port: int, step: float | None) -> None:
    pacer = Pacer(step) if step else None
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Upstream(pacer), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pacer", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=float, help="seconds between chunks of a stream")
    what.add_argument("--canned", action="store_true", help="the canned answer, no streams")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        run_async(serve(args.port, args.step))


if __name__ == "__main__":
    main()
