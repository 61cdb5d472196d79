"""The bench's own upstreams, costing next to nothing: the canned chat.completion (nginx's
``return`` serves it, or this module as a script where nginx is missing) and the paced SSE stream,
whose bytes are defined here and served by ``bench/native/pacer.c`` (``paced_argv``): one timer,
one chunk to every stream per step, each stamped with its send time. ``--step S`` serves the same
paced stream from this module (``Paced``), the manystream scenario's Python pacer: a writer with
an interpreter's pace rather than C's. Each also lists the model on ``GET /v1/models``, which a
gateway that routes by model (smg) reads before it sends a worker anything."""

import argparse
import asyncio
import contextlib
import math
import time
from typing import cast

import httptools
import orjson

from bench import native
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
_CHUNK = (
    b'data: {"id":"chatcmpl-pacer","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench-model","system_fingerprint":"fp_pacer","choices":[{"index":0,'
)
_PREFIX = _CHUNK + b'"delta":{"content":" token"},"logprobs":null,"finish_reason":null}],"ts":'
_SUFFIX = b"}\n\n"
_FINISH = _CHUNK + b'"delta":{},"logprobs":null,"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'


def _response(status: str, content_type: bytes, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n".encode()
    return head + b"Content-Type: " + content_type + b"\r\n\r\n" + body


MODELS_PATH = "/v1/models"
MODELS = orjson.dumps({"object": "list", "data": [
    {"id": MODEL, "object": "model", "created": 1733000000, "owned_by": "bench"}]})  # fmt: skip
_CANNED = _response("200 OK", b"application/json", BODY)
_HEALTHY = _response("200 OK", b"text/plain", b"ok\n")
_MODELS = _response("200 OK", b"application/json", MODELS)
_NOT_FOUND = _response("404 Not Found", b"text/plain", b"not found\n")
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
DEFAULT_STREAM = 1000  # chunks in a stream whose request names no max_tokens (as pacer.c)
MAX_STREAM = 100_000
MAX_PENDING = 8 << 20  # answer bytes a socket did not take: more closes it (as pacer.c)


def chunk(at: float) -> bytes:
    """One paced chunk, stamped with its send time ``at`` (the native pacer writes these bytes)."""
    return _PREFIX + b"%.6f" % at + _SUFFIX


def framed(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def paced_argv(step: float) -> list[str]:
    """The native pacer's command: a chunk to every stream every ``step`` seconds."""
    pieces = (_PREFIX, _SUFFIX, _FINISH, MODELS)
    return [str(native.tool("pacer")), str(step), *(piece.decode() for piece in pieces)]


class _Requests(asyncio.Protocol):
    """Keep-alive HTTP/1.1 requests read with httptools, the URL gathered; a connection that
    sends more than ``MAX_BUFFERED`` bytes toward one request, or garbage, is closed."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
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


class Canned(_Requests):
    """Keep-alive HTTP/1.1, answers in request order (pipelining works): the canned answer to a
    POST of a chat, ``ok`` on the health path, 404 elsewhere."""

    def on_message_complete(self) -> None:
        path, post = self.url.split(b"?", 1)[0], self.parser.get_method() == b"POST"
        self.url, self.pending = b"", 0
        if self.transport is None or self.transport.is_closing():
            return
        if post and path == CHAT_PATH.encode():
            self.transport.write(_CANNED)
        else:
            self.transport.write(_side_route(path))
        if not self.parser.should_keep_alive():
            self.transport.close()


def _side_route(path: bytes) -> bytes:
    """The answer to anything but a chat POST: health, the model list, else 404."""
    return {HEALTH_PATH.encode(): _HEALTHY, MODELS_PATH.encode(): _MODELS}.get(path, _NOT_FOUND)


def max_tokens(body: bytes) -> int:
    """The chunks a POST asks for (pacer.c reads the same field)."""
    try:
        asked = orjson.loads(body).get("max_tokens", DEFAULT_STREAM)
    except (orjson.JSONDecodeError, AttributeError):
        return DEFAULT_STREAM
    return max(1, min(MAX_STREAM, int(asked))) if isinstance(asked, int) else DEFAULT_STREAM


class Pacer:
    """One timer for every open stream, as an engine's decode step: each step, every stream's
    whole chunk (one ``write`` each, the same stamped bytes for all), from the first stream
    to the last. A timer that fell behind skips steps rather than burst (as pacer.c)."""

    def __init__(self, step: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.step = step
        self.streams: dict[Paced, int] = {}  # chunks left in each open stream
        self.start = self.loop.time()
        self.steps = 1  # the step the timer is set for
        self.loop.call_at(self.start + step, self.tick)

    def tick(self) -> None:
        data = framed(chunk(time.monotonic()))
        last = framed(_FINISH) + b"0\r\n\r\n"
        for stream, left in list(self.streams.items()):
            stream.send(data)
            if left > 1:
                self.streams[stream] = left - 1
                continue
            del self.streams[stream]
            stream.send(last)
            stream.serve()  # a request pipelined behind the stream
        # The next step after now, counted from the start: a timer that fired a little early
        # (libuv's clock is in milliseconds) must not step twice.
        behind = math.floor((self.loop.time() - self.start) / self.step)
        self.steps = max(self.steps + 1, behind + 1)
        self.loop.call_at(self.start + self.step * self.steps, self.tick)


class Paced(_Requests):
    """Keep-alive HTTP/1.1, answers in request order: a chat POST with an SSE stream of its
    ``max_tokens`` chunks, written by the ``Pacer``; health, the model list, else 404."""

    def __init__(self, pacer: Pacer) -> None:
        super().__init__()
        self.pacer = pacer
        self.body = b""
        self.queued: list[tuple[bool, bytes, bytes, bool]] = []  # post, path, body, keep-alive

    def connection_lost(self, exc: Exception | None) -> None:
        self.pacer.streams.pop(self, None)
        self.transport = None

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        post, keep = self.parser.get_method() == b"POST", self.parser.should_keep_alive()
        self.queued.append((post, self.url.split(b"?", 1)[0], self.body, keep))
        self.url = self.body = b""
        self.pending = 0
        self.serve()

    def serve(self) -> None:
        """Answer the queued requests in order, until one starts a stream."""
        while self.queued and self not in self.pacer.streams and self.transport is not None:
            post, path, body, keep = self.queued.pop(0)
            if post and path == CHAT_PATH.encode():
                self.send(_SSE_HEAD)
                self.pacer.streams[self] = max_tokens(body)
                continue
            self.send(_side_route(path))
            if not keep and self.transport is not None:
                self.transport.close()

    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(data)
        if transport.get_write_buffer_size() > MAX_PENDING:  # a reader that stopped
            transport.abort()


async def serve(port: int, step: float | None = None) -> None:
    """The canned upstream, or with ``step`` the paced one."""
    loop = asyncio.get_running_loop()
    if step is None:
        server = await loop.create_server(Canned, "127.0.0.1", port, backlog=4096)
    else:
        pacer = Pacer(step)
        server = await loop.create_server(lambda: Paced(pacer), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pacer", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step", type=float, help="paced streams: seconds between chunks")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        run_async(serve(args.port, args.step))


if __name__ == "__main__":
    main()
