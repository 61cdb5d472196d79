"""Running the proxy and admin listeners, and draining them gracefully on SIGTERM or SIGINT.

Drain: readiness fails at once; new connections are still served for ``drain_grace_seconds``
(load balancers take a moment to notice); in-flight requests then get up to ``drain_seconds`` in
all, after which fan-out streams are cut cleanly (one error event and ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import resource
import signal
from collections.abc import Callable

from aiohttp import web

from proxy.config.models import Config
from proxy.observe.clienterrors import ClientErrors
from proxy.observe.log import log_event
from proxy.observe.metrics import Metrics
from proxy.observe.tracing import tracing_from_env
from proxy.request.handler import InFlight
from proxy.server.admin import build_admin_app
from proxy.server.app import UPSTREAMS, build_app
from proxy.server.connection import ClientConnection, ConnectionCap, ErrorPages, Listener

_CUT_GRACE = 1.0  # seconds for cut streams to write their last event before sockets close
_FLUSH_SECONDS = 5.0  # spans batched at shutdown get what is left of the drain, up to this
_SPARE_FDS = 256  # beyond client and upstream connections: admin, logs, DNS, health checks


class Server:
    def __init__(
        self, config: Config, *, reuse_port: bool = False, notice: str | None = None
    ) -> None:
        self.config = config
        self.reuse_port = reuse_port
        self.metrics = Metrics()
        self.tracing = tracing_from_env()
        self.in_flight = InFlight()
        self.client_errors = ClientErrors(self.metrics)  # one count and log budget for both
        app = build_app(
            config,
            metrics=self.metrics,
            in_flight=self.in_flight,
            client_errors=self.client_errors,
            tracing=self.tracing,
            notice=notice,
        )
        self.upstreams = app[UPSTREAMS]
        self._proxy = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=_CUT_GRACE
        )
        self._admin = web.AppRunner(
            build_admin_app(self.in_flight, self.upstreams, self.metrics),
            access_log=None,
            shutdown_timeout=_CUT_GRACE,
        )
        self._proxy_site: Listener | None = None
        self._drain_ends: float | None = None  # loop time by which the drain is to be over
        self.proxy_port = 0
        self.admin_port = 0

    async def start(self) -> None:
        await self._proxy.setup()
        _raise_fd_limit(self.config)
        listen = self.config.listen
        errors = self.client_errors
        cap = ConnectionCap(self.config, self.metrics, errors)
        connection = functools.partial(ClientConnection, cap)
        self._proxy_site = Listener(
            self._proxy, listen.host, listen.port, connection, self.reuse_port
        )
        await self._proxy_site.start()
        self.proxy_port = _port(self._proxy)
        if self.config.admin is not None:
            await self._admin.setup()
            admin = self.config.admin
            pages = functools.partial(ErrorPages, errors)
            await Listener(self._admin, admin.host, admin.port, pages).start()
            self.admin_port = _port(self._admin)

    async def drain(self) -> None:
        in_flight = self.in_flight
        in_flight.draining = True
        loop = asyncio.get_running_loop()
        self._drain_ends = loop.time() + self.config.drain_seconds
        grace = min(self.config.drain_grace_seconds, self.config.drain_seconds)
        log_event("draining", in_flight=in_flight.requests, drain_seconds=self.config.drain_seconds)
        await asyncio.sleep(grace)
        if self._proxy_site is not None:
            await self._proxy_site.stop()
        try:
            async with asyncio.timeout_at(self._drain_ends):
                await in_flight.wait_idle()
        except TimeoutError:
            log_event("drain time is up; cutting streams", in_flight=in_flight.requests)
            in_flight.fanouts.cut_streams("the proxy is shutting down")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CUT_GRACE):
                    await in_flight.wait_idle()

    async def close(self) -> None:
        """Every listener closed, then the spans sent: within what is left of the drain (at
        least a second, at most ``_FLUSH_SECONDS``), so that the process exits within about
        ``drain_seconds`` of SIGTERM whatever the trace collector does."""
        await self._proxy.cleanup()
        await self._admin.cleanup()
        if self.tracing is not None:
            left = _FLUSH_SECONDS
            if self._drain_ends is not None:
                left = self._drain_ends - asyncio.get_running_loop().time()
            await self.tracing.close(min(max(left, _CUT_GRACE), _FLUSH_SECONDS))


async def run(
    server: Server,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
    ready: Callable[[], None] | None = None,
) -> None:
    """Serve until one of ``signals``, then drain and stop.

    ``ready`` runs once the signals are ours: a banner printed before that would let a SIGTERM
    that follows it at once kill the process undrained (the default action).
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready()
    try:
        await stop.wait()
        await server.drain()
    finally:
        await server.close()


def install_uvloop() -> None:
    """uvloop when installed (the ``fast`` extra): a quicker event loop, same behaviour."""
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _port(runner: web.AppRunner) -> int:
    address = runner.addresses[0]
    return int(address[1])


def _raise_fd_limit(config: Config) -> None:
    """Room for every allowed connection: past the fd limit, accept() fails and floods the log."""
    needed = config.max_connections + sum(u.max_concurrency for u in config.upstreams) + _SPARE_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < needed:
        log_event(
            "the open-file limit is below max_connections plus upstream connections; "
            "lower max_connections or raise the limit",
            fd_limit=soft,
            needed=needed,
        )
