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
from proxy.observe.metrics import MULTIPROCESS, Metrics, value_of
from proxy.request.handler import handle
from proxy.request.passthrough import UPSTREAM_SERVER
from proxy.request.responses import SERVER
from proxy.request.runtime import RUNTIME, TRIMMER, UPSTREAMS, Runtime
from proxy.server.connection import EveryPath
from proxy.server.memory import Trimmer
from proxy.upstream.discovery import Resolver
from proxy.upstream.service import Upstreams

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
        # fan-out paths inflate gzip/deflate themselves, within max_body_bytes (proxy.encoding).
        handler_args={"max_field_size": 65536, "auto_decompress": False},
    )
    app[RUNTIME] = runtime or Runtime(config)
    app[TRIMMER] = trimmer = Trimmer()
    app.on_response_prepare.append(_server_header)
    if notice is not None:
        app.on_response_prepare.append(functools.partial(_notice_header, notice))
    app.cleanup_ctx.append(functools.partial(_upstreams, resolver=resolver, trimmer=trimmer))
    every = EveryPath("/")
    app.router.register_resource(every)
    every.add_route("*", handle)
    return app


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    if not request.get(UPSTREAM_SERVER, False):
        response.headers["Server"] = SERVER


async def _notice_header(notice: str, request: web.Request, response: web.StreamResponse) -> None:
    response.headers[DEMO_HEADER] = notice  # replaces any copy a pass-through brought along


async def _upstreams(
    app: web.Application, resolver: Resolver | None, trimmer: Trimmer
) -> AsyncIterator[None]:
    runtime = app[RUNTIME]
    upstreams = Upstreams(runtime.config, runtime.metrics, resolver)
    await upstreams.start(runtime.health_reported)
    app[UPSTREAMS] = upstreams
    runtime.metrics.census = functools.partial(take_census, runtime, upstreams)
    sampler = asyncio.create_task(_sample(runtime.metrics)) if MULTIPROCESS else None
    yield
    trimmer.close()
    if sampler is not None:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    await upstreams.close()


def take_census(runtime: Runtime, upstreams: Upstreams | None) -> Census:
    """The counts as they are now; ``upstreams`` None before the app's start (nothing upstream)."""
    counted = []
    if upstreams is not None:
        for upstream in upstreams.config.upstreams:
            state = upstreams.state(upstream)
            counted.append(
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
        connections=len(upstreams.connections.in_use) if upstreams is not None else 0,
        idle=upstreams.connections.idle_count() if upstreams is not None else 0,
        upstreams=tuple(counted),
    )


async def _sample(metrics: Metrics) -> None:
    while True:
        metrics.sample()
        await asyncio.sleep(_SAMPLE_SECONDS)
