"""A rig with leak accounting: the demo backend, a proxy in front of it and a client of its own.

What it gives that ``servers.Servers`` alone does not: a baseline of the process's tasks and open
file descriptors taken once everything is up, and ``assert_no_leaks``, which closes the client
and the proxy's idle connections and then demands that nothing is held, running or open past
that baseline and that the backend generates nothing more (the lifecycle check looks only at
what the proxy holds). Built by the ``make_rig`` fixture, which stubs the health probe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil
from aiohttp import web

from proxy.config.models import Timeouts
from proxy.devserver import DevState
from proxy.server.app import GENERATIONS, IN_FLIGHT
from tests.support.client import Answer, post
from tests.support.logs import LogCapture
from tests.support.servers import Backend, Servers, proxy_config, with_upstream

# Seconds a client waits: a hang becomes a failure, not a stuck suite, and a machine whose
# cores others hold is not a hang.
ANSWER_WITHIN = 30.0
LONG_WAIT = 30.0  # seconds: timeouts that must not fire
RELAXED = Timeouts(connect=LONG_WAIT, first_byte=LONG_WAIT, idle=LONG_WAIT)
RID = "t"  # the request id of every request a rig sends


def open_fds() -> int:
    return int(psutil.Process().num_fds())


@dataclass
class Rig:
    backend: Backend
    proxy_url: str
    app: web.Application
    client: aiohttp.ClientSession
    log: LogCapture
    tasks: set[asyncio.Task[Any]]
    fds: int

    @classmethod
    async def start(
        cls,
        servers: Servers,
        log: LogCapture,
        timeouts: Timeouts = RELAXED,
        upstream_url: str | None = None,
        max_concurrency: int = 64,
        max_queue: int = 256,
        stream_start: str = "first",
        **backend_options: Any,
    ) -> Rig:
        """``backend_options`` are the demo backend's; ``upstream_url`` puts another upstream
        in its place (the backend still runs)."""
        backend = await servers.backend(**backend_options)
        config = with_upstream(
            proxy_config(backend, stream_start=stream_start),
            timeouts=timeouts,
            max_concurrency=max_concurrency,
            max_queue=max_queue,
            **({"urls": (upstream_url,)} if upstream_url else {}),
        )
        proxy = await servers.proxy(config)
        client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return cls(backend, proxy.url, proxy.app, client, log, asyncio.all_tasks(), open_fds())

    @property
    def state(self) -> DevState:
        return self.backend.state

    async def post(self, url: str, body: dict[str, Any]) -> Answer:
        return await post(self.client, url, body, RID, within=ANSWER_WITHIN)

    async def assert_no_leaks(self, requests: int) -> None:
        """After ``requests`` proxied requests: nothing held, running or open past the baseline."""
        await self.log.wait_for(requests, ANSWER_WITHIN)
        assert self.app[IN_FLIGHT].requests == 0
        pool = self.app[GENERATIONS].upstreams
        assert not pool.connections.in_use  # one here is a leaked child
        # Idle keep-alive connections are not leaks: close them, then everything they ran must end.
        await self.client.close()
        await pool.connections.close()
        lingering = asyncio.all_tasks() - self.tasks - {asyncio.current_task()}
        if lingering:
            _, pending = await asyncio.wait(lingering, timeout=ANSWER_WITHIN)
            assert not pending, f"tasks still running: {pending}"
        assert not self.state.active
        assert open_fds() == self.fds


MakeRig = Callable[..., Awaitable[Rig]]
