"""What serves a config: a ``Generation`` holds the config, its ``Upstreams`` and the ``Handler``
bound to them. A reload (``Generations.replace``) makes a new one current: a request keeps the
generation it began in to its end. Every upstream a live generation names has one line and one
set of replicas, whichever generations name it: the new generation takes them over, resized to
its limits, and the old ones' health checks, discovery and watchdog stop at the hand-over
(docs/operating.md#reload). An old generation's connection pool is closed once its last request
is over.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from aiohttp import web

from proxy.config import Config
from proxy.request import Handler, Requests
from proxy.upstream import Upstreams

# A new generation's first health round is awaited this long at most before it takes requests,
# so that a reload does not make /readyz fail while its checks are under way.
_FIRST_HEALTH_SECONDS = 5.0


@dataclass(eq=False)
class Generation:
    """One loaded config and what serves it; its handler counts the requests that began in it."""

    config: Config
    upstreams: Upstreams
    handler: Handler

    @property
    def begun(self) -> Requests:
        return self.handler.begun


# What serves a config, given the upstreams of the generations still alive (newest first), whose
# lines and replicas it takes over.
Build = Callable[[Config, Sequence[Upstreams]], Generation]


class Generations:
    """The current generation, and the older ones whose requests are still running."""

    def __init__(self, build: Build, config: Config) -> None:
        self._build = build
        self.current = build(config, ())
        self.retiring: list[Generation] = []
        self._retirements: set[asyncio.Task[None]] = set()

    @property
    def config(self) -> Config:
        return self.current.config

    @property
    def upstreams(self) -> Upstreams:
        """The current generation's: where new requests go."""
        return self.current.upstreams

    def __iter__(self) -> Iterator[Generation]:
        yield self.current
        yield from self.retiring

    def tasks(self) -> set[asyncio.Task[None]]:
        """Every generation's background loops, and the waits to close the old ones."""
        own: set[asyncio.Task[None]] = set(self._retirements)
        for generation in self:
            own |= set(generation.upstreams.loops)
        return own

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The route's handler, for a request the app routes (one with ``Expect``)."""
        return await self.dispatch(request)

    def dispatch(self, request: web.Request) -> Awaitable[web.StreamResponse]:
        """The current generation's handling of ``request``, which ends in the generation it
        began in (its handler counts it there). Not a coroutine itself: the listener awaits what
        it returns, one coroutine fewer a request (``proxy.server.connection.direct_route``)."""
        return self.current.handler.handle(request)

    async def replace(self, config: Config) -> None:
        """``config`` serves every request from now on, once its upstreams had a health round
        (or ``_FIRST_HEALTH_SECONDS``); the generation it replaces retires."""
        earlier = [self.current.upstreams, *(g.upstreams for g in reversed(self.retiring))]
        new = self._build(config, earlier)
        try:
            await new.upstreams.start()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_FIRST_HEALTH_SECONDS):
                    await new.upstreams.health_checked.wait()
        except BaseException:
            await new.upstreams.close()
            raise
        old, self.current = self.current, new
        new.upstreams.take_over(earlier)
        self.retiring.append(old)
        task = asyncio.create_task(self._retire(old))
        self._retirements.add(task)
        task.add_done_callback(self._retirements.discard)

    async def retired(self) -> None:
        """Until every old generation's last request ended and its upstreams were closed."""
        await asyncio.gather(*self._retirements)

    async def _retire(self, old: Generation) -> None:
        await old.begun.wait_idle()
        await old.upstreams.close()
        self.retiring.remove(old)
        # Its last requests may have named again a series the hand-over removed (a count of
        # retries, of answers...).
        self.current.upstreams.forget(old.upstreams)

    async def close(self) -> None:
        """Every generation's upstreams closed (at shutdown: no request is left)."""
        for task in list(self._retirements):
            task.cancel()
        await asyncio.gather(*self._retirements, return_exceptions=True)
        # Idempotent: one whose retirement was cut short is closed again. The retired stay
        # listed, so that a census after the shutdown still sees what they held.
        for generation in [*self.retiring, self.current]:
            await generation.upstreams.close()
