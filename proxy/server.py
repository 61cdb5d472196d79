"""Running the proxy and admin listeners, and draining them gracefully on SIGTERM or SIGINT.

Drain: readiness fails at once; new connections are still served for ``drain_grace_seconds``
(load balancers take a moment to notice); in-flight requests then get up to ``drain_seconds`` in
all, after which fan-out streams are cut cleanly (one error event and ``[DONE]``).

Each client connection is a ``ClientConnection``: aiohttp's own handler plus a cap on open
connections (``max_connections``), a deadline for request headers (``client_timeouts.headers``)
and OpenAI error bodies on the error pages aiohttp writes itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, cast

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from proxy.admin import build_admin_app
from proxy.app import SERVER, build_app
from proxy.config import Config
from proxy.errors import RequestTimeout, error_body, status_type
from proxy.log import log_event
from proxy.metrics import Metrics
from proxy.runtime import Runtime
from proxy.tracing import tracing_from_env

_CUT_GRACE = 1.0  # seconds for cut streams to write their last event before sockets close
_SPARE_FDS = 256  # beyond client and upstream connections: admin, logs, DNS, health checks


class Server:
    def __init__(
        self, config: Config, *, reuse_port: bool = False, notice: str | None = None
    ) -> None:
        self.config = config
        self.reuse_port = reuse_port
        self.runtime = Runtime(config, tracing=tracing_from_env())
        self._proxy = web.AppRunner(
            build_app(config, self.runtime, notice=notice),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=_CUT_GRACE,
        )
        self._admin = web.AppRunner(build_admin_app(self.runtime), access_log=None)
        self._proxy_site: _Site | None = None
        self.proxy_port = 0
        self.admin_port = 0

    async def start(self) -> None:
        await self._proxy.setup()
        _raise_fd_limit(self.config)
        listen = self.config.listen
        gate = Gate(self.config, self.runtime.metrics)
        self._proxy_site = _Site(self._proxy, listen.host, listen.port, gate, self.reuse_port)
        await self._proxy_site.start()
        self.proxy_port = _port(self._proxy)
        if self.config.admin is not None:
            await self._admin.setup()
            admin = self.config.admin
            await web.TCPSite(self._admin, admin.host, admin.port).start()
            self.admin_port = _port(self._admin)

    async def drain(self) -> None:
        runtime = self.runtime
        runtime.draining = True
        grace = min(self.config.drain_grace_seconds, self.config.drain_seconds)
        log_event("draining", in_flight=runtime.in_flight, drain_seconds=self.config.drain_seconds)
        await asyncio.sleep(grace)
        if self._proxy_site is not None:
            await self._proxy_site.stop()
        try:
            async with asyncio.timeout(self.config.drain_seconds - grace):
                await runtime.wait_idle()
        except TimeoutError:
            log_event("drain time is up; cutting streams", in_flight=runtime.in_flight)
            runtime.cut_streams("the proxy is shutting down")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CUT_GRACE):
                    await runtime.wait_idle()

    async def close(self) -> None:
        await self._proxy.cleanup()
        await self._admin.cleanup()
        if self.runtime.tracing is not None:
            await asyncio.to_thread(self.runtime.tracing.close)  # flushes: off the loop


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


class Gate:
    """Counts the listener's open connections against ``max_connections``."""

    def __init__(self, config: Config, metrics: Metrics) -> None:
        self.limit = config.max_connections
        self.header_seconds = config.client_timeouts.headers
        self.metrics = metrics
        self.open = 0

    def admit(self) -> bool:
        if self.open >= self.limit:
            self.metrics.connections_refused.inc()
            return False
        self.open += 1
        self.metrics.client_connections.inc()
        return True

    def leave(self) -> None:
        self.open -= 1
        self.metrics.client_connections.dec()


def _timeout_page() -> bytes:
    body = RequestTimeout("request headers not received in time").body()
    head = (
        "HTTP/1.1 408 Request Timeout\r\n"
        f"Server: {SERVER}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


_TIMEOUT_PAGE = _timeout_page()


class ClientConnection(RequestHandler):
    """One client connection: aiohttp's handler, refused past the cap, cut if headers trickle.

    The header clock runs from the connection's first byte, and again from the first byte of
    each later request on a kept-alive connection, until aiohttp has parsed the headers. An
    idle kept-alive connection is aiohttp's ``keepalive_timeout``'s to close.
    """

    __slots__ = ("_admitted", "_gate", "_header_timer")

    def __init__(self, gate: Gate, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._gate = gate
        self._admitted = False
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._gate.admit():
            # Refused at accept: closed at once, nothing read, nothing logged.
            cast(asyncio.Transport, transport).abort()
            return
        self._admitted = True
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._gate.leave()
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._messages or self._request_in_progress:
            self._disarm()  # headers complete: the body has its own deadline (proxy.app)
        elif self._header_timer is None and not self._force_close:
            self._arm()  # the first bytes of the next request on a kept-alive connection

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's own error pages (a malformed request line, bad headers) as OpenAI errors."""
        super().handle_error(request, status, exc, message)  # logs it; raises if too late
        text = message if status < 500 and message else HTTPStatus(status).phrase
        response = web.Response(
            status=status,
            body=orjson.dumps(error_body(text, status_type(status))),
            content_type="application/json",
            headers={"Server": SERVER},
        )
        response.force_close()
        return response

    def _arm(self) -> None:
        self._header_timer = self._loop.call_later(self._gate.header_seconds, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._messages or self._request_in_progress or self.transport is None:
            return
        self._gate.metrics.client_timeouts.labels("headers").inc()
        # No request is in progress, so nothing else writes to this connection.
        self.transport.write(_TIMEOUT_PAGE)
        self.force_close()


class _Site(web.BaseSite):
    """A TCP listener whose connections are ``ClientConnection``s sharing one ``Gate``."""

    __slots__ = ("_gate", "_host", "_port", "_reuse_port")

    def __init__(
        self, runner: web.AppRunner, host: str, port: int, gate: Gate, reuse_port: bool
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._gate = gate
        self._reuse_port = reuse_port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        # The handler arguments the app and runner set (timeouts, limits, auto_decompress).
        options = {"loop": loop, **server._kwargs}
        gate = self._gate
        self._server = await loop.create_server(
            lambda: ClientConnection(gate, server, **options),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            reuse_port=self._reuse_port or None,
        )


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
