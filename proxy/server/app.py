"""The proxy's aiohttp application: the one handler on every path, the upstreams started and
stopped with the app, the request record's observers, and the demo notice's header.

What serves a config is a ``Generation`` (``proxy.server.generations``): the config, its
``Upstreams`` and the handler bound to them, built here; a reload makes a new one current.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Sequence

from aiohttp import web

from proxy.config import Config
from proxy.observe import (
    MULTIPROCESS,
    Census,
    ClientErrors,
    Metrics,
    Observer,
    Observers,
    RequestLine,
    RequestMetrics,
    Tracing,
    UpstreamCensus,
)
from proxy.request import Handler, InFlight, server_header
from proxy.server.connection import EveryPath
from proxy.server.generations import Generation, Generations
from proxy.server.memory import Trimmer
from proxy.upstream import Resolver, Upstreams

DEMO_HEADER = "X-N-Proxy-Demo"
_SAMPLE_SECONDS = 1.0  # --workers: how often each worker writes its queue depths for /metrics

# What an app serves with, for the process, the admin listener and tests to read.
GENERATIONS = web.AppKey("generations", Generations)
IN_FLIGHT = web.AppKey("in_flight", InFlight)


def build_app(
    config: Config,
    *,
    metrics: Metrics | None = None,
    in_flight: InFlight | None = None,
    client_errors: ClientErrors | None = None,
    tracing: Tracing | None = None,
    resolver: Resolver | None = None,
    notice: str | None = None,
) -> web.Application:
    """``resolver`` replaces the system's DNS lookups for ``discovery.dns`` (tests inject one);
    ``notice`` goes out as ``X-N-Proxy-Demo`` on every response (the demo mode's warning);
    ``tracing`` (None: off) gets every request's and upstream request's span."""
    app = web.Application(
        client_max_size=config.max_body_bytes,
        # auto_decompress off: a pass-through forwards the client's bytes as they came; the
        # fan-out paths inflate gzip/deflate themselves, within max_body_bytes
        # (proxy.core.encoding).
        handler_args={"max_field_size": 65536, "auto_decompress": False},
    )
    served_metrics = metrics = metrics if metrics is not None else Metrics()
    in_flight = in_flight or InFlight()
    client_errors = client_errors or ClientErrors(metrics)
    trimmer = Trimmer()
    large = trimmer.watch()

    def build(config: Config, earlier: Sequence[Upstreams]) -> Generation:
        served_metrics.known(config)
        upstreams = Upstreams(config, served_metrics, resolver, earlier)
        watching: list[Observer] = [RequestMetrics(served_metrics, config), RequestLine()]
        if tracing is not None:
            watching.insert(0, tracing)  # a span begins before the others see the request
        observers = Observers(watching, large=large)
        handler = Handler(config, upstreams, observers, in_flight, client_errors, served_metrics)
        return Generation(config, upstreams, handler)

    generations = Generations(build, config)
    app[GENERATIONS] = generations
    app[IN_FLIGHT] = in_flight
    metrics.census = functools.partial(take_census, in_flight, generations)
    app.on_response_prepare.append(server_header)
    if notice is not None:
        app.on_response_prepare.append(functools.partial(_notice_header, notice))
    app.cleanup_ctx.append(functools.partial(_serve, generations=generations, trimmer=trimmer))
    every = EveryPath("/", direct=generations.dispatch)
    app.router.register_resource(every)
    every.add_route("*", generations.handle)
    return app


async def _notice_header(notice: str, request: web.Request, response: web.StreamResponse) -> None:
    response.headers[DEMO_HEADER] = notice  # replaces any copy a pass-through brought along


async def _serve(
    app: web.Application, generations: Generations, trimmer: Trimmer
) -> AsyncIterator[None]:
    upstreams = generations.upstreams
    await upstreams.start()
    sampler = asyncio.create_task(_sample(upstreams.metrics)) if MULTIPROCESS else None
    yield
    trimmer.close()
    if sampler is not None:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    await generations.close()


def take_census(in_flight: InFlight, generations: Generations) -> Census:
    """The counts as they are now, over every generation still serving, by upstream name. The
    generations that name an upstream share its line and replicas: each is counted once. Each
    generation's upstream requests in flight are its own."""
    counted: dict[str, UpstreamCensus] = {}
    shared: set[int] = set()  # the ids of the lines and replicas counted already
    connections = idle = tabs = 0
    for generation in generations:
        upstreams = generation.upstreams
        if id(upstreams.tabs) not in shared:  # one for every config since the first
            shared.add(id(upstreams.tabs))
            tabs += upstreams.tabs.held()
        connections += len(upstreams.connections.in_use)
        idle += upstreams.connections.idle_connections()
        for upstream in upstreams.config.upstreams:
            state = upstreams.state(upstream)
            name = upstream.name
            seen = counted.get(name) or UpstreamCensus(name, 0, 0, 0, {})
            held, queued, outstanding = seen.slots_held, seen.queued, seen.outstanding
            if id(state.slots) not in shared:
                shared.add(id(state.slots))
                held, queued = held + state.slots.in_use, queued + state.slots.queued
            for replica in state.replicas:
                if id(replica) not in shared:
                    shared.add(id(replica))
                    outstanding[replica.url] = outstanding.get(replica.url, 0) + replica.outstanding
            exchanges = seen.exchanges + state.exchanges
            counted[name] = UpstreamCensus(name, held, queued, exchanges, outstanding)
    return Census(
        requests=in_flight.requests,
        children=in_flight.fanouts.children,
        streams=len(in_flight.fanouts.streams),
        connections=connections,
        idle=idle,
        upstreams=tuple(counted.values()),
        tabs=tabs,
    )


async def _sample(metrics: Metrics) -> None:
    while True:
        metrics.sample()
        await asyncio.sleep(_SAMPLE_SECONDS)
