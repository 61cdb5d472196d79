"""The admin listener: ``/livez``, ``/readyz`` and ``/metrics``, apart from the proxied traffic."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.request.runtime import Runtime

ADMIN_RUNTIME = web.AppKey("admin_runtime", Runtime)


def build_admin_app(runtime: Runtime) -> web.Application:
    app = web.Application()
    app[ADMIN_RUNTIME] = runtime
    app.router.add_get("/livez", _livez)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.on_response_prepare.append(_server_header)
    return app


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "n-proxy"


async def _livez(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    runtime = request.app[ADMIN_RUNTIME]
    body = {
        "ready": runtime.ready,
        "draining": runtime.draining,
        "upstreams": runtime.healthy,
        "replicas": runtime.replicas,
        "in_flight": runtime.in_flight,
    }
    return web.json_response(body, status=200 if runtime.ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[ADMIN_RUNTIME].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
