"""The proxy's aiohttp application: the one handler on every path, the upstream service started
and stopped with the app, and its headers (``Server``, the demo notice).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from aiohttp import web

from proxy.config.models import Config
from proxy.observe.census import Census, UpstreamCensus
from proxy.observe.metrics import MULTIPROCESS, Metrics
from proxy.observe.tally import value_of
from proxy.request.handler import handle
from proxy.request.passthrough import UPSTREAM_SERVER
from proxy.request.responses import SERVER
from proxy.request.runtime import POOL, RUNTIME, TRIMMER, Runtime
from proxy.server.connection import EveryPath
from proxy.server.memory import Trimmer
from proxy.upstream.discovery import Resolver
from proxy.upstream.service import UpstreamPool

DEMO_HEADER = "X-N-Proxy-Demo"
_SAMPLE_SECONDS = 1.0  # --workers: how often each worker writes its queue depths for /metrics


def build_app(
    config: Config,
    runtime: Runtime | None = None,
    *,
    resolver: Resolver | None = None,
    notice: str | None = None,
) -> web.Application:
    """``resolver`` replaces the system's DNS lookups for ``discovery.dns`` (tests inject one);
    ``notice`` goes out as ``X-N-Proxy-Demo`` on every response (the demo mode's warning)."""
    app = web.Application(
        client_max_size=config.max_body_bytes,
        # auto_decompress off: a pass-through forwards the client's bytes as they came; the
        # fan-out paths inflate gzip/deflate themselves, within max_body_bytes
        # (proxy.core.encoding).
        handler_args={"max_field_size": 65536, "auto_decompress": False},
    )
    app[RUNTIME] = runtime or Runtime(config)
    app[TRIMMER] = trimmer = Trimmer()
    app.on_response_prepare.append(_server_header)
    if notice is not None:
        app.on_response_prepare.append(functools.partial(_notice_header, notice))
    app.cleanup_ctx.append(functools.partial(_pool, resolver=resolver, trimmer=trimmer))
    every = EveryPath("/")
    app.router.register_resource(every)
    every.add_route("*", handle)
    return app


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    if not request.get(UPSTREAM_SERVER, False):
        response.headers["Server"] = SERVER


async def _notice_header(notice: str, request: web.Request, response: web.StreamResponse) -> None:
    response.headers[DEMO_HEADER] = notice  # replaces any copy a pass-through brought along


async def _pool(
    app: web.Application, resolver: Resolver | None, trimmer: Trimmer
) -> AsyncIterator[None]:
    runtime = app[RUNTIME]
    pool = UpstreamPool(runtime.config, runtime.metrics, resolver)
    await pool.start(runtime.health_reported)
    app[POOL] = pool
    runtime.metrics.census = functools.partial(take_census, runtime, pool)
    sampler = asyncio.create_task(_sample(runtime.metrics)) if MULTIPROCESS else None
    yield
    trimmer.close()
    if sampler is not None:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    await pool.close()


def take_census(runtime: Runtime, pool: UpstreamPool | None) -> Census:
    """The counts as they are now; ``pool`` None before the app's start (nothing upstream)."""
    upstreams = []
    if pool is not None:
        for upstream in pool.config.upstreams:
            state = pool.state(upstream)
            upstreams.append(
                UpstreamCensus(
                    upstream.name,
                    state.slots.in_use,
                    state.slots.queued,
                    round(value_of(state.timings.in_flight)),
                    {replica.url: replica.outstanding for replica in state.replicas},
                )
            )
    return Census(
        requests=runtime.in_flight,
        children=runtime.children,
        streams=len(runtime.streams),
        connections=len(pool.connections.in_use) if pool is not None else 0,
        idle=pool.connections.idle_connections() if pool is not None else 0,
        upstreams=tuple(upstreams),
    )


async def _sample(metrics: Metrics) -> None:
    while True:
        metrics.sample()
        await asyncio.sleep(_SAMPLE_SECONDS)
