"""A recording fake upstream: an aiohttp app on a loopback port that files every request it gets.

It reads each request's body as it came (never inflated, any size: the proxy's limits are the
ones under test), answers the proxy's health checks "ok" without filing them, and answers
everything else with the ``answer`` it was given, or with ``respond`` in a subclass. For bytes
no aiohttp server would write, see ``rawupstream.RawUpstream``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

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
