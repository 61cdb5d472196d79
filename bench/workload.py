"""The request bodies every scenario sends, what a correct answer to them looks like, and reading
an SSE answer as a client does: timed through aiohttp (``read_stream``), or raw off the socket
for the scenarios that hold hundreds of streams (``RawStream``). Events are counted on the raw
bytes, so either reader stays cheap next to the servers it measures."""

import asyncio
import contextlib
import math
import re
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import aiohttp
import orjson

CHAT_PATH = "/v1/chat/completions"
MODEL = "demo-model"
SEED = 1000
# Every contender gets the same headers. LiteLLM's proxy refuses to start without a master key,
# so it has this one; it guards nothing but a server on 127.0.0.1 for the length of a run.
BENCH_KEY = "sk-bench-loopback-only"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {BENCH_KEY}"}


@dataclass(frozen=True)
class Request:
    path: str
    body: bytes  # a JSON body, POSTed


def chat_body(
    n: int = 1, *, stream: bool = False, max_tokens: int = 16, seed: int | None = SEED,
    x_demo: dict[str, Any] | None = None, model: str = MODEL,
) -> dict[str, Any]:  # fmt: skip
    """A chat request; ``ignore_eos`` makes every choice exactly ``max_tokens`` long."""
    message = {"role": "user", "content": "Benchmark the proxy, please."}
    body = {"model": model, "messages": [message], "max_tokens": max_tokens, "ignore_eos": True}
    optional = {
        "n": n if n != 1 else None,
        "stream": stream or None,
        "seed": seed,
        "x_demo": x_demo,
    }
    return body | {k: v for k, v in optional.items() if v is not None}


def chat_request(n: int = 1, **options: Any) -> Request:
    return Request(CHAT_PATH, orjson.dumps(chat_body(n, **options)))


def stream_events(n: int, max_tokens: int) -> int:
    """SSE data events in a chat stream from the demo backend, ``[DONE]`` included.

    Each choice opens with a role chunk, sends one chunk per token and one with its
    finish_reason; the stitched stream has the same events and one ``[DONE]``.
    """
    return n * (max_tokens + 2) + 1


_EVENT = b"data: "
# A chat chunk that carries generated text (the opening role chunk has "content":"").
TOKEN_EVENT = re.compile(rb'"content":"[^"]')
T = TypeVar("T")


def whole_events(buffer: bytes) -> tuple[bytes, bytes]:
    """The whole SSE events at the start of ``buffer``, and the rest (an event not yet ended)."""
    cut = buffer.rfind(b"\n\n") + 2  # 1 when there is none
    return (buffer[:cut], buffer[cut:]) if cut > 1 else (b"", buffer)


@dataclass(frozen=True)
class StreamTiming:
    """Seconds from the request's start; ``nan`` for a moment that never came."""

    status: int
    headers_at: float
    first_byte_at: float
    first_token_at: float  # when the event carrying it had arrived whole
    end_at: float
    events: int


async def read_stream(
    session: aiohttp.ClientSession, url: str, body: bytes, started: float | None = None
) -> StreamTiming:
    """POST ``body`` and read the answer to its end; times are relative to ``started``."""
    t0 = time.perf_counter() if started is None else started
    first_byte = first_token = float("nan")
    events, rest = 0, b""
    async with session.post(url, data=body, headers=HEADERS) as response:
        headers_at = time.perf_counter() - t0
        async for data in response.content.iter_any():
            now = time.perf_counter() - t0
            if math.isnan(first_byte):
                first_byte = now
            block, rest = whole_events(rest + data)
            events += block.count(_EVENT)
            if math.isnan(first_token) and TOKEN_EVENT.search(block):
                first_token = now
        end = time.perf_counter() - t0
    return StreamTiming(response.status, headers_at, first_byte, first_token, end, events)


def raw_post(request: Request, *, close: bool = False) -> bytes:
    """``request`` as the bytes of a POST, for the clients that write it to a socket themselves."""
    head = f"POST {request.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(request.body)}\r\n" + ("Connection: close\r\n" if close else "")
    return (head + "\r\n").encode() + request.body


OnEvents = Callable[[float, bytes], None]
_IGNORE: OnEvents = lambda now, block: None  # noqa: E731
OPEN_BATCH = 100  # connections opened at once: a listen backlog is not the thing measured
MAX_HEAD = 65536


class RawStream(asyncio.Protocol):
    """One request on a connection of its own, its SSE answer read raw: ``status`` from the head
    (0 until then), then ``on_events(now, block)`` with each run of whole events (``now``:
    time.monotonic()). ``flowing`` is done at the first run, or when none will come (``error``
    then says why); ``ended`` when the connection closes; ``events`` counts them."""

    def __init__(self, request: bytes, on_events: OnEvents = _IGNORE) -> None:
        loop = asyncio.get_running_loop()
        self.request, self.on_events = request, on_events
        self.flowing: asyncio.Future[None] = loop.create_future()
        self.ended: asyncio.Future[None] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.status = self.events = 0
        self.error = self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        self._flowing(b"closed before the first event")
        self.ended.set_result(None)

    def data_received(self, data: bytes) -> None:
        now, buffer = time.monotonic(), self._buffer + data
        if not self.status:
            head, sep, buffer = buffer.partition(b"\r\n\r\n")
            if not sep:
                self._buffer = head[-MAX_HEAD:]
                return
            self.status = int(head[9:12]) if head[9:12].isdigit() else -1  # "HTTP/1.1 200"
            if self.status != 200:
                self._flowing(head[:200])
        block, self._buffer = whole_events(buffer) if self.status == 200 else (b"", b"")
        if not block:
            return
        self.events += block.count(_EVENT)
        self._flowing(b"")
        self.on_events(now, block)

    def _flowing(self, error: bytes) -> None:
        if not self.flowing.done():
            self.error = error
            self.flowing.set_result(None)


async def open_raw(
    port: int, request: bytes, count: int = 1, on_events: OnEvents = _IGNORE, rcvbuf: int = 0
) -> list[RawStream]:
    """``count`` RawStreams to 127.0.0.1:``port``, opened OPEN_BATCH at a time; ``rcvbuf``: each
    socket's receive buffer, set before it connects (0: the kernel's default)."""
    loop, streams = asyncio.get_running_loop(), []

    async def connect(stream: RawStream) -> None:
        sock = socket.socket()
        try:
            if rcvbuf:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.create_connection(lambda: stream, sock=sock)
        except BaseException:
            sock.close()
            raise

    for start in range(0, count, OPEN_BATCH):
        batch = [RawStream(request, on_events) for _ in range(min(OPEN_BATCH, count - start))]
        await asyncio.gather(*(connect(stream) for stream in batch))
        streams += batch
    return streams


def client(seconds: float, limit: int = 0, force_close: bool = False) -> aiohttp.ClientSession:
    """A client session: ``limit`` connections (0: any number), each request ``seconds`` at most."""
    connector = aiohttp.TCPConnector(limit=limit, force_close=force_close)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=seconds))


def on_uvloop() -> None:
    """Every event loop made from here on is uvloop's when it is installed: the bench's servers
    and clients run on it, as n-proxy does."""
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run an in-process client (or a server of the bench's own), on uvloop when installed."""
    on_uvloop()
    return asyncio.run(coro)
