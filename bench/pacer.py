"""The bench's own upstreams, costing next to nothing: the canned chat.completion (nginx's
``return`` serves it, or this module as a script where nginx is missing) and the paced SSE stream,
whose bytes are defined here and served by ``bench/native/pacer.c`` (``paced_argv``): one timer,
one chunk to every stream per step, each stamped with its send time."""

import argparse
import asyncio
import contextlib
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


_CANNED = _response("200 OK", b"application/json", BODY)
_HEALTHY = _response("200 OK", b"text/plain", b"ok\n")
_NOT_FOUND = _response("404 Not Found", b"text/plain", b"not found\n")


def chunk(at: float) -> bytes:
    """One paced chunk, stamped with its send time ``at`` (the native pacer writes these bytes)."""
    return _PREFIX + b"%.6f" % at + _SUFFIX


def paced_argv(step: float) -> list[str]:
    """The native pacer's command: a chunk to every stream every ``step`` seconds."""
    pieces = (_PREFIX, _SUFFIX, _FINISH)
    return [str(native.tool("pacer")), str(step), *(piece.decode() for piece in pieces)]


class Canned(asyncio.Protocol):
    """Keep-alive HTTP/1.1, answers in request order (pipelining works): the canned answer to a
    POST of a chat, ``ok`` on the health path, 404 elsewhere."""

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

    def on_message_complete(self) -> None:
        path, post = self.url.split(b"?", 1)[0], self.parser.get_method() == b"POST"
        self.url, self.pending = b"", 0
        if self.transport is None or self.transport.is_closing():
            return
        if path == HEALTH_PATH.encode():
            self.transport.write(_HEALTHY)
        else:
            self.transport.write(_CANNED if post and path == CHAT_PATH.encode() else _NOT_FOUND)
        if not self.parser.should_keep_alive():
            self.transport.close()


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Canned, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pacer", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    with contextlib.suppress(KeyboardInterrupt):
        run_async(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
