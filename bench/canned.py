"""The canned upstream: every POST to /v1/chat/completions gets the same chat.completion at once.

nginx serves it when installed (``bench.stack.start_canned``): the upstream then costs next to
nothing, so what a proxy in front of it costs shows. This asyncio.Protocol + httptools server is
the fallback when nginx is missing (slower than nginx, but it parses and answers nothing else).

    python -m bench.canned --port 8300
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import cast

import httptools
import orjson

from bench.workload import CHAT_PATH, MODEL

# A real non-streaming answer, ~400 B: one choice with index 0 and usage, so n-proxy can stitch
# n of them into one n-choice answer. No ' $ or \ in it: nginx's `return` quotes it as text.
BODY = orjson.dumps(
    {
        "id": "chatcmpl-bench5f0c2a9e41d7b3c8a6e0f1d2",
        "object": "chat.completion",
        "created": 1733000000,
        "model": MODEL,
        "system_fingerprint": "fp_bench_canned",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "This answer comes back through the proxy unchanged; it stands in"
                    " for a short reply.",
                },
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 14, "completion_tokens": 17, "total_tokens": 31},
    }
)
HEALTH_PATH = "/health"
MAX_BUFFERED = 1 << 20  # a request that big is not one this bench sends: close the connection


def _response(status: str, content_type: bytes, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n".encode()
    return head + b"Content-Type: " + content_type + b"\r\n\r\n" + body


_ANSWERS = {
    (b"POST", CHAT_PATH.encode()): _response("200 OK", b"application/json", BODY),
    (b"GET", HEALTH_PATH.encode()): _response("200 OK", b"text/plain", b"ok\n"),
}
_NOT_FOUND = _response("404 Not Found", b"text/plain", b"not found\n")


class CannedProtocol(asyncio.Protocol):
    """Keep-alive HTTP/1.1, answers in request order (pipelining works), bodies ignored."""

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
            self._close()
            return
        if self.pending > MAX_BUFFERED:
            self._close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        answer = _ANSWERS.get((method, self.url.split(b"?", 1)[0]), _NOT_FOUND)
        self.url = b""
        self.pending = 0
        if self.transport is not None:
            self.transport.write(answer)
            if not self.parser.should_keep_alive():
                self._close()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(CannedProtocol, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.canned", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port))


if __name__ == "__main__":
    main()
