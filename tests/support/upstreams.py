"""A recording fake upstream: an aiohttp app on a loopback port that files every request it gets,
and one that holds its chat streams open until the test lets them end (``HoldingUpstream``).

It reads each request's body as it came (never inflated, any size: the proxy's limits are the
ones under test), answers the proxy's health checks "ok" without filing them, and answers
everything else with the ``answer`` it was given, or with ``respond`` in a subclass. For bytes
no aiohttp server would write, see ``rawupstream.RawUpstream``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web
from multidict import CIMultiDict

AnswerFn = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Seen:
    method: str
    path: str  # decoded, without the query
    target: str  # the request target as it arrived: raw path and query
    headers: CIMultiDict[str]
    body: bytes  # as it arrived
    peer_port: int  # the proxy's end of the connection it came on

    @property
    def request_id(self) -> str:
        return self.headers.get("X-Request-Id", "")


class RecordingUpstream:
    def __init__(self, answer: AnswerFn | None = None) -> None:
        self.seen: list[Seen] = []
        self.url = ""
        self._answer = answer
        self._runner: web.AppRunner | None = None

    async def start(self) -> RecordingUpstream:
        app = web.Application(client_max_size=1 << 40, handler_args={"auto_decompress": False})
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # A short shutdown grace: cleanup must not wait on a handler that streams without end.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=0.1, access_log=None
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def respond(self, request: web.Request) -> web.StreamResponse:
        """The answer to a filed request (its body is read already: ``await request.read()``)."""
        assert self._answer is not None, "give an answer, or override respond"
        return await self._answer(request)

    def with_request_id(self, rid: str) -> list[Seen]:
        return [s for s in self.seen if s.request_id == rid]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/health":
            return web.Response(text="ok")
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.seen.append(
            Seen(
                request.method,
                request.path,
                request.raw_path,
                CIMultiDict(request.headers),
                body,
                peer[1] if peer else 0,
            )
        )
        return await self.respond(request)


class HoldingUpstream(RecordingUpstream):
    """Chat streams that stay open until the test lets them end, and a count of how many run at
    once: each POST gets a 200 and a first chunk at once, then waits to be ``release``d before
    its last chunk and ``[DONE]``. ``active`` is the streams open now, ``peak`` the most ever
    open at once: what the upstream's own concurrency would be."""

    def __init__(self) -> None:
        super().__init__()
        self.active = 0
        self.peak = 0
        self._held: deque[asyncio.Event] = deque()  # the open streams' releases, oldest first
        self._open = False  # released for good: later streams end at once
        self._changed = asyncio.Event()

    def release(self, count: int | None = None) -> None:
        """Let the ``count`` oldest open streams end; None: every one, and every later one."""
        if count is None:
            self._open = True
        for _ in range(len(self._held) if count is None else count):
            self._held.popleft().set()

    async def wait_for(self, predicate: Callable[[], bool], within: float = 30.0) -> None:
        """Until ``predicate()`` holds, woken by each stream that opens or ends."""
        async with asyncio.timeout(within):
            while not predicate():
                await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def respond(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "")
        release = asyncio.Event()
        if self._open:
            release.set()
        else:
            self._held.append(release)
        self.active += 1
        self.peak = max(self.peak, self.active)
        self._notify()
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(_chunk(rid, {"role": "assistant", "content": "a"}, None))
            await release.wait()
            await response.write(_chunk(rid, {}, "stop") + b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            if release in self._held:  # the proxy left first
                self._held.remove(release)
            self.active -= 1
            self._notify()


def _chunk(rid: str, delta: dict[str, str], finish_reason: str | None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    chunk = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 1,
             "model": "m", "choices": [choice]}  # fmt: skip
    return b"data: " + orjson.dumps(chunk) + b"\n\n"
