"""Running the proxy and admin listeners, and draining them gracefully on SIGTERM or SIGINT.

Drain: readiness fails at once; new connections are still served for ``drain_grace_seconds``
(load balancers take a moment to notice); in-flight requests then get up to ``drain_seconds`` in
all, after which fan-out streams are cut cleanly (one error event and ``[DONE]``).

Each client connection is a ``ClientConnection``: aiohttp's own handler plus a cap on open
connections (``max_connections``), a deadline for request headers (``client_timeouts.headers``)
and OpenAI error bodies on the error pages aiohttp writes itself (``ErrorPages``, the admin
listener's connections too), a request its parser refuses counted and logged short.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import resource
import signal
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, cast

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from proxy.admin import build_admin_app
from proxy.app import SERVER, build_app
from proxy.backlog import listen_backlog
from proxy.clienterrors import ClientErrors, kind_of, lacks_version
from proxy.config import Config
from proxy.errors import InvalidRequest, ProxyError, RequestTimeout, error_body, status_type
from proxy.log import log_event
from proxy.metrics import Metrics
from proxy.runtime import Runtime
from proxy.tracing import tracing_from_env

_CUT_GRACE = 1.0  # seconds for cut streams to write their last event before sockets close
_FLUSH_SECONDS = 5.0  # spans batched at shutdown get what is left of the drain, up to this
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
        self._admin = web.AppRunner(
            build_admin_app(self.runtime), access_log=None, shutdown_timeout=_CUT_GRACE
        )
        self._proxy_site: _Site | None = None
        self._drain_ends: float | None = None  # loop time by which the drain is to be over
        self.proxy_port = 0
        self.admin_port = 0

    async def start(self) -> None:
        await self._proxy.setup()
        _raise_fd_limit(self.config)
        listen = self.config.listen
        errors = self.runtime.client_errors  # one count and log budget for both listeners
        gate = Gate(self.config, self.runtime.metrics, errors)
        connection = functools.partial(ClientConnection, gate)
        self._proxy_site = _Site(self._proxy, listen.host, listen.port, connection, self.reuse_port)
        await self._proxy_site.start()
        self.proxy_port = _port(self._proxy)
        if self.config.admin is not None:
            await self._admin.setup()
            admin = self.config.admin
            pages = functools.partial(ErrorPages, errors)
            await _Site(self._admin, admin.host, admin.port, pages).start()
            self.admin_port = _port(self._admin)

    async def drain(self) -> None:
        runtime = self.runtime
        runtime.draining = True
        loop = asyncio.get_running_loop()
        self._drain_ends = loop.time() + self.config.drain_seconds
        grace = min(self.config.drain_grace_seconds, self.config.drain_seconds)
        log_event("draining", in_flight=runtime.in_flight, drain_seconds=self.config.drain_seconds)
        await asyncio.sleep(grace)
        if self._proxy_site is not None:
            await self._proxy_site.stop()
        try:
            async with asyncio.timeout_at(self._drain_ends):
                await runtime.wait_idle()
        except TimeoutError:
            log_event("drain time is up; cutting streams", in_flight=runtime.in_flight)
            runtime.cut_streams("the proxy is shutting down")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CUT_GRACE):
                    await runtime.wait_idle()

    async def close(self) -> None:
        """Every listener closed, then the spans sent: within what is left of the drain (at
        least a second, at most ``_FLUSH_SECONDS``), so that the process exits within about
        ``drain_seconds`` of SIGTERM whatever the trace collector does."""
        await self._proxy.cleanup()
        await self._admin.cleanup()
        if self.runtime.tracing is not None:
            left = _FLUSH_SECONDS
            if self._drain_ends is not None:
                left = self._drain_ends - asyncio.get_running_loop().time()
            await self.runtime.tracing.close(min(max(left, _CUT_GRACE), _FLUSH_SECONDS))


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
    """Counts the listener's open connections against ``max_connections``, and what the
    connections' clients get wrong."""

    def __init__(self, config: Config, metrics: Metrics, errors: ClientErrors) -> None:
        self.limit = config.max_connections
        self.header_seconds = config.client_timeouts.headers
        self.metrics = metrics
        self.errors = errors
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


def _page(status: int, error: ProxyError) -> bytes:
    """A whole answer, written before any request is parsed: aiohttp's writer is not there."""
    body = error.body()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        f"Server: {SERVER}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


_TIMEOUT_PAGE = _page(408, RequestTimeout("request headers not received in time"))
_HTTP09_PAGE = _page(400, InvalidRequest("malformed request line: no HTTP version"))
_FIRST_LINE = 8190  # bytes of a connection's first line looked at: aiohttp's max_line_size
_MESSAGE = 300  # characters of the parser's message in a 400's body


class ErrorPages(RequestHandler):
    """aiohttp's handler with OpenAI error bodies on the error pages it writes itself; a
    request its parser refused is the client's fault (``proxy.clienterrors``): counted and
    logged short, where aiohttp logs a traceback at error level."""

    __slots__ = ("_errors", "_first_line")

    def __init__(self, errors: ClientErrors, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._errors = errors
        self._first_line: bytes | None = b""  # the connection's first line so far; None: seen

    def data_received(self, data: bytes) -> None:
        if self._first_line is not None and self._http09(data):
            return
        super().data_received(data)

    def _http09(self, data: bytes) -> bool:
        """Whether the connection's first line, once whole, is HTTP/0.9's (``GET /`` and a
        line end): answered 400 at once. aiohttp's parser would take it for the start of a
        head and wait for more lines until the header deadline."""
        assert self._first_line is not None
        end = data.find(b"\n")
        if end < 0:
            self._first_line += data
            if len(self._first_line) > _FIRST_LINE:
                self._first_line = None  # too long for a request line: the parser's to refuse
            return False
        line = self._first_line + data[:end]
        self._first_line = None
        if not lacks_version(line) or self.transport is None:
            return False
        self._errors.record("request_line", "HTTP/0.9", _peer(self.transport))
        self.transport.write(_HTTP09_PAGE)
        self.force_close()
        return True

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, HttpProcessingError):
            if request.writer.output_size > 0:  # as aiohttp's own: too late for an answer
                raise ConnectionError("a response was sent already")
            self._errors.record(kind_of(exc), type(exc).__name__, request.remote)
            status, message = 400, message or exc.message
        else:  # a handler that raised: a bug, logged with its traceback
            super().handle_error(request, status, exc, message)  # raises if too late
        text = message[:_MESSAGE] if status < 500 and message else HTTPStatus(status).phrase
        response = web.Response(
            status=status,
            body=orjson.dumps(error_body(text, status_type(status))),
            content_type="application/json",
            headers={"Server": SERVER},
        )
        response.force_close()
        return response


class ClientConnection(ErrorPages):
    """One client connection: aiohttp's handler, refused past the cap, cut if headers trickle.

    The header clock runs from the connection's first byte, and again from the first byte of
    each later request on a kept-alive connection, until aiohttp has parsed the headers. An
    idle kept-alive connection is aiohttp's ``keepalive_timeout``'s to close.
    """

    __slots__ = ("_admitted", "_gate", "_header_timer")

    def __init__(self, gate: Gate, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(gate.errors, manager, **kwargs)
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
            if self._request_in_progress and self._messages:
                self._fail_body()
        elif self._header_timer is None and not self._force_close:
            self._arm()  # the first bytes of the next request on a kept-alive connection

    def _fail_body(self) -> None:
        """A request is being handled and the parser refused what came next: bad chunked
        framing in its body, say. aiohttp queues the error as the next request's and leaves
        the body waiting until its deadline; the body's read fails with it at once instead."""
        refused = getattr(self._messages[-1][0], "exc", None)  # aiohttp's _ErrInfo
        request = self._current_request
        if isinstance(refused, HttpProcessingError) and request is not None:
            request.content.set_exception(refused)

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


def _peer(transport: asyncio.BaseTransport) -> str | None:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


class _Site(web.BaseSite):
    """A TCP listener whose connections ``connection(server, **options)`` makes."""

    __slots__ = ("_connection", "_host", "_port", "_reuse_port")

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        connection: Callable[..., RequestHandler],
        reuse_port: bool = False,
    ) -> None:
        super().__init__(runner, backlog=listen_backlog())
        self._host = host
        self._port = port
        self._connection = connection
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
        connection = self._connection
        self._server = await loop.create_server(
            lambda: connection(server, **options),
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
