"""The demo backend's aiohttp app: its routes, typed state, and serving it on a loopback port."""

from __future__ import annotations

from functools import partial

from aiohttp import web

from proxy.devserver.config import DEFAULT_CONFIG, DEV_CONFIG, DevConfig
from proxy.devserver.generation import handle_generation
from proxy.devserver.routes import debug_state, echo, embeddings, health, metrics, models
from proxy.devserver.state import DEV_STATE, DevState
from proxy.server import listen_backlog


def build_app(config: DevConfig = DEFAULT_CONFIG) -> web.Application:
    # Large bodies must reach /echo intact when the proxy's own limit is what is under test.
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[DEV_CONFIG] = config
    app[DEV_STATE] = DevState()
    app.router.add_post("/v1/chat/completions", partial(handle_generation, kind="chat"))
    app.router.add_post("/v1/completions", partial(handle_generation, kind="completions"))
    # vLLM's token-in/token-out endpoint (its --enable-scale-out), n = 1 as its Rust frontend.
    app.router.add_post("/inference/v1/generate", partial(handle_generation, kind="generate"))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/debug/state", debug_state)
    app.router.add_route("*", "/echo/{tail:.*}", echo)
    return app


async def start_devserver(
    config: DevConfig = DEFAULT_CONFIG, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int, DevState]:
    """Serve on `host` (a free port when `port` is 0); the caller owns `runner.cleanup()`."""
    app = build_app(config)
    # A short shutdown grace: cleanup must not wait on deliberately endless fault handlers.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=listen_backlog())
    try:
        await site.start()
    except OSError:
        await runner.cleanup()  # the caller gets no runner to clean up
        raise
    return runner, int(runner.addresses[0][1]), app[DEV_STATE]
