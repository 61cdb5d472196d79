"""The admin listener: ``/livez``, ``/readyz`` and ``/metrics``, apart from the proxied traffic."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.observe import Metrics
from proxy.request import SERVER, InFlight
from proxy.server.generations import Generations
from proxy.upstream import Upstreams


@dataclass(frozen=True)
class Watched:
    """What the admin listener reports on: the proxy app's requests, upstreams and metrics."""

    in_flight: InFlight
    generations: Generations
    metrics: Metrics

    @property
    def upstreams(self) -> Upstreams:
        """The current config's: a reload makes /readyz report on the new upstreams."""
        return self.generations.upstreams

    @property
    def ready(self) -> bool:
        return not self.in_flight.draining and self.upstreams.ready


WATCHED = web.AppKey("watched", Watched)


def build_admin_app(
    in_flight: InFlight, generations: Generations, metrics: Metrics
) -> web.Application:
    app = web.Application()
    app[WATCHED] = Watched(in_flight, generations, metrics)
    app.router.add_get("/livez", _livez)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.on_response_prepare.append(_server_header)
    return app


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER


async def _livez(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    watched = request.app[WATCHED]
    ready = watched.ready
    body = {
        "ready": ready,
        "draining": watched.in_flight.draining,
        "upstreams": watched.upstreams.checked_health,
        "replicas": watched.upstreams.checked_replicas,
        "in_flight": watched.in_flight.requests,
    }
    return web.json_response(body, status=200 if ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[WATCHED].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
