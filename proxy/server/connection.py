"""One client connection on a listener: aiohttp's own handler plus a cap on open connections
(``max_connections``), a deadline for request headers (``client_timeouts.headers``), a prompt
400 for HTTP/0.9, and OpenAI error bodies on the error pages aiohttp writes itself
(``ErrorPages``, the admin listener's connections too); a request its parser refuses is counted
and logged short; the proxy app's one route called without aiohttp's router, and a connection's
requests handled in its own task, not in one more each. One of the four modules that use
aiohttp's private members (docs/architecture.md, house rules).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import warnings
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast

from aiohttp import hdrs, web
from aiohttp.helpers import ceil_timeout
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_writer import StreamWriter
from aiohttp.streams import StreamReader
from aiohttp.web_exceptions import HTTPException
from aiohttp.web_protocol import _PAYLOAD_ACCESS_ERROR, ERROR, RequestHandler, _ErrInfo
from aiohttp.web_urldispatcher import UrlMappingMatchInfo

from proxy.config import Config
from proxy.core import InvalidRequest, RequestTimeout
from proxy.observe import ClientErrors, Metrics, kind_of, lacks_version
from proxy.request import WholeAnswer, error_page, status_response
from proxy.server.backlog import listen_backlog


class ConnectionCap:
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


_TIMEOUT_PAGE = error_page(408, RequestTimeout("request headers not received in time"))
_HTTP09_PAGE = error_page(400, InvalidRequest("malformed request line: no HTTP version"))
_FIRST_LINE = 8190  # bytes of a connection's first line looked at: aiohttp's max_line_size
_MESSAGE = 300  # characters of the parser's message in a 400's body

# The digests of what ClientConnection.start and _handle_request copy from aiohttp (3.14.4's
# and 3.14.5's): its loop over a connection's requests, its step for one request, and the sets
# of the request and writer each request is given (``made_request``).
_COPIED: dict[tuple[type, str], str] = {
    (RequestHandler, "start"): "2e565fd40c8e04fb",
    (RequestHandler, "_handle_request"): "a88a34ee65a2714c",
    (web.Application, "_make_request"): "e59bd224e5f8dfe5",
    (web.BaseRequest, "__init__"): "dae5bbed7d90f1dd",
    (StreamWriter, "__init__"): "22bf627a5f2d9d9c",
}


def _copies_start() -> bool:
    """Whether the installed aiohttp's members that ``_COPIED`` names are the ones copied."""
    for (owner, name), digest in _COPIED.items():
        try:
            source = inspect.getsource(getattr(owner, name))
        except (OSError, TypeError):  # no source to compare: its own loop serves
            return False
        if hashlib.sha256(source.encode()).hexdigest()[:16] != digest:
            return False
    return True


COPIES_START = _copies_start()

_new = object.__new__
_MAKE_REQUEST = web.Application._make_request


def made_request(
    factory: Callable[..., web.BaseRequest],
    message: Any,
    payload: StreamReader,
    protocol: RequestHandler,
    task: asyncio.Task[None],
) -> web.BaseRequest:
    """``factory(message, payload, protocol, StreamWriter(protocol, loop), task)``. For the
    request factory of a plain ``web.Application`` (its ``_make_request``) and a target that is
    a path, as ``BaseRequest.__init__`` and ``StreamWriter.__init__`` set them, without their
    calls: each is a type's call into a Python ``__init__``, with keywords, where these sets run
    in the caller's frame. 2,000 instructions a request."""
    url = message.url
    if getattr(factory, "__func__", None) is not _MAKE_REQUEST or url.absolute:
        return factory(message, payload, protocol, StreamWriter(protocol, protocol._loop), task)
    app = factory.__self__  # type: ignore[attr-defined]
    writer = _new(StreamWriter)
    writer._protocol = protocol
    writer.loop = protocol._loop
    writer._on_chunk_sent = None
    writer._on_headers_sent = None
    writer._headers_buf = None
    writer._headers_written = False
    writer.on_body_write = None
    request = _new(web.Request)
    request._message = message
    request._protocol = protocol
    request._payload_writer = writer
    request._payload = payload
    request._headers = message.headers
    request._method = message.method
    request._version = message.version
    request._cache = {}
    request._rel_url = url
    request._state = {}
    request._task = task
    request._client_max_size = app._client_max_size
    request._client_max_fields = app._client_max_fields
    request._loop = app._loop
    request._transport_sslcontext = protocol.ssl_context
    request._transport_peername = protocol.peername
    request._transport_sockname = protocol.sockname
    return request


def _cancelling() -> bool:
    """Whether the running task is being cancelled, not only timed out. A function of its own,
    so that no frame a cancellation's traceback holds names the task: that would be a cycle only
    the (rarely run, see proxy.server.memory) collector breaks."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


_received = RequestHandler.data_received  # aiohttp's: parse, queue the requests parsed


class ErrorPages(RequestHandler):
    """aiohttp's handler with OpenAI error bodies on the error pages it writes itself; a
    request its parser refused is the client's fault (``proxy.observe.clienterrors``): counted and
    logged short, where aiohttp logs a traceback at error level."""

    __slots__ = ("_errors", "_first_line")

    def __init__(self, errors: ClientErrors, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._errors = errors
        self._first_line: bytes | None = b""  # the connection's first line so far; None: seen

    def data_received(self, data: bytes) -> None:
        if self._first_line is None or not self._http09(data):
            _received(self, data)

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
        return status_response(status, text)


class ClientConnection(ErrorPages):
    """One client connection: aiohttp's handler, refused past the cap, cut if headers trickle.

    The header clock runs from the connection's first byte, and again from the first byte of
    each later request on a kept-alive connection, until aiohttp has parsed the headers. An
    idle kept-alive connection is aiohttp's ``keepalive_timeout``'s to close.
    """

    __slots__ = ("_admitted", "_cap", "_header_timer")

    def __init__(self, cap: ConnectionCap, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(cap.errors, manager, **kwargs)
        self._cap = cap
        self._admitted = False
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._cap.admit():
            # Refused at accept: closed at once, nothing read, nothing logged.
            cast(asyncio.Transport, transport).abort()
            return
        self._admitted = True
        super().connection_made(transport)
        self._arm()

    def resume_reading(self, resume_parser: bool = True) -> None:
        """Only a connection whose reading is paused has any to resume. aiohttp's body reader
        asks at every read below its low-water mark, paused or not, and a resume parses again
        from no bytes: 8,000 instructions of a pass-through whose body came with its head."""
        if self._reading_paused:
            super().resume_reading(resume_parser)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._cap.leave()
        self._disarm()
        if exc is not None:
            # aiohttp sets the transport's error on the request's body. Its traceback holds the
            # frames of the write that met it (an answer's head, say), which hold the request:
            # a cycle only the (rarely run, see proxy.server.memory) collector would break.
            exc.__traceback__ = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # ErrorPages' own, in place: every read of every request runs this, and a frame and a
        # super() fewer is 1,000 instructions.
        if self._first_line is None or not self._http09(data):
            _received(self, data)
        if self._messages or self._request_in_progress:
            if self._header_timer is not None:  # headers complete: the body's deadline is
                self._disarm()  # proxy.request.handler's
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

    if COPIES_START:  # over another aiohttp, its own loop: a task for each request

        async def start(self) -> None:
            """aiohttp's loop over the connection's requests (``RequestHandler.start``, as of
            aiohttp 3.14.4), with each request handled in the connection's own task. aiohttp
            makes a task for every request, to give each its own copy of the context variables
            (its #3406); the proxy sets none, and a task made, scheduled, run and awaited is 3.5 %
            of a pass-through's instructions. A client that leaves cancels this task
            (``handler_cancellation``), as it cancelled the request's through it."""
            loop = self._loop
            manager = self._manager
            factory = self._request_factory
            assert manager is not None
            assert factory is not None
            while not self._force_close:
                if not self._messages:
                    try:
                        self._waiter = loop.create_future()
                        await self._waiter
                    finally:
                        self._waiter = None
                message, payload = self._messages.popleft()
                if self._parser is not None:  # None only once the connection is lost
                    self._parser.message_consumed()
                if self._buffer_paused and len(self._messages) <= self._msg_queue_resume_size:
                    self._resume_reading_if_drained()
                manager.requests_count += 1
                handler = self._request_handler
                if isinstance(message, _ErrInfo):
                    handler = self._make_error_handler(message)
                    message = ERROR
                assert handler is not None
                # The connection's task passed, never named in a local: a cancelled request's
                # traceback holds this frame, and a local naming the task would make a cycle
                # that only the (rarely run, see proxy.server.memory) collector breaks.
                request = made_request(
                    factory,
                    message,
                    payload,
                    self,
                    self._task_handler or asyncio.current_task(loop),  # type: ignore[arg-type]
                )
                began = loop.time() if self._logging_enabled else None  # for an access log
                try:
                    try:
                        response, reset = await self._handle_request(request, began, handler)
                    except ConnectionError:
                        break
                    if reset:
                        break
                    self._keepalive = bool(response._keep_alive)  # no property call
                    if not payload.is_eof():
                        await self._linger(payload)
                    payload.set_exception(_PAYLOAD_ACCESS_ERROR)
                except asyncio.CancelledError:
                    self.force_close()
                    raise
                except Exception as exc:
                    self.log_exception("Unhandled exception", exc_info=exc)
                    self.force_close()
                except BaseException:
                    self.force_close()
                    raise
                finally:
                    request._task = None  # type: ignore[assignment]  # no cycle through a traceback
                if not self._keepalive or self._close or self._force_close:
                    break
                close_time = loop.time() + self._keepalive_timeout
                self._next_keepalive_close_time = close_time
                if self._keepalive_handle is None:
                    self._keepalive_handle = loop.call_at(close_time, self._process_keepalive)
            if not self._force_close:
                self._task_handler = None
                if self.transport is not None:
                    self.transport.close()

        async def _handle_request(
            self,
            request: web.BaseRequest,
            start_time: float | None,
            request_handler: Handle,
        ) -> tuple[web.StreamResponse, bool]:
            """aiohttp's step for one request (``RequestHandler._handle_request``, as of aiohttp
            3.14.4), with a whole answer's end here: ``finish_response`` would release a
            multipart form's files (``request._finish``), have it prepared (which writes it
            whole, ``WholeAnswer``) and its end written (nothing left), then log its access; two
            coroutines and 3,000 instructions a pass-through."""
            self._request_in_progress = True
            try:
                try:
                    self._current_request = request
                    resp = await request_handler(request)
                finally:
                    self._current_request = None
            except HTTPException as exc:
                resp, reset = await self.finish_response(request, exc, start_time)
            except asyncio.CancelledError:
                raise
            except TimeoutError as exc:
                self.log_debug("Request handler timed out.", exc_info=exc)
                resp = self.handle_error(request, 504)
                resp, reset = await self.finish_response(request, resp, start_time)
            except Exception as exc:
                resp = self.handle_error(request, 500, exc)
                resp, reset = await self.finish_response(request, resp, start_time)
            else:
                if type(resp) is WholeAnswer and not self._upgraded and self.access_logger is None:
                    if request._post is not None:  # a form read: its files closed (_finish)
                        request._finish()
                    try:
                        await resp.prepare(request)
                        if not resp._eof_sent:  # an answer with no body: aiohttp's steps
                            await resp.write_eof()
                        reset = False
                    except ConnectionError:
                        reset = True
                else:
                    if getattr(resp, "__http_exception__", False):  # aiohttp's #2415
                        warnings.warn(
                            "returning HTTPException object is deprecated (#2415) and will be "
                            "removed, please raise the exception instead",
                            DeprecationWarning,
                            stacklevel=1,
                        )
                    resp, reset = await self.finish_response(request, resp, start_time)
            finally:
                self._request_in_progress = False
                if self._handler_waiter is not None:
                    self._handler_waiter.set_result(None)
            return resp, reset

        async def _linger(self, payload: StreamReader) -> None:
            """A body the handler left unread: read and dropped for up to ``lingering_time``, then
            the connection closed if any is left (aiohttp's lingering close)."""
            loop = self._loop
            now = loop.time()
            end = now + self._lingering_time
            if not self._force_close and self._lingering_time:
                try:
                    while not payload.is_eof() and now < end:
                        async with ceil_timeout(end - now):
                            await payload.readany()
                        now = loop.time()
                except (TimeoutError, asyncio.CancelledError):
                    if _cancelling():
                        raise
            if not payload.is_eof() and not self._force_close:
                self.close()

    def _arm(self) -> None:
        self._header_timer = self._loop.call_later(self._cap.header_seconds, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._messages or self._request_in_progress or self.transport is None:
            return
        self._cap.metrics.client_timeouts.labels("headers").inc()
        # No request is in progress, so nothing else writes to this connection.
        self.transport.write(_TIMEOUT_PAGE)
        self.force_close()


def _peer(transport: asyncio.BaseTransport) -> str | None:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


class Listener(web.BaseSite):
    """A TCP listener whose connections ``connection(server, **options)`` makes; the proxy
    app's requests reach its one route without the router (``direct_route``)."""

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
        runner = self._runner
        app = runner.app if isinstance(runner, web.AppRunner) else None
        direct = direct_route(app, server.request_handler)

        def made() -> RequestHandler:
            protocol = connection(server, **options)
            if direct is not None:
                protocol._request_handler = direct
            return protocol

        self._server = await loop.create_server(
            made,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            reuse_port=self._reuse_port or None,
        )


Handle = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
Direct = Callable[[web.Request], Awaitable[web.StreamResponse]]


def direct_route(app: web.Application | None, through_app: Handle) -> Handle | None:
    """The proxy app's one handler, called without aiohttp's router: when the app holds one
    ``EveryPath`` with one route and no middleware, every request's match is the same, so one
    frozen match is made here and given to each request (``request.app`` and the app's
    ``on_response_prepare`` read it). Routing each request costs 3 % of a pass-through's
    instructions. A request with ``Expect`` still goes ``through_app`` (its ``100 Continue``).
    Neither this nor the ``EveryPath``'s ``direct`` (else its route's handler) is a coroutine:
    aiohttp awaits what they return, two coroutines fewer a request. None for any other app (the
    admin listener's)."""
    if app is None or app.middlewares:
        return None
    resources = list(app.router.resources())
    if len(resources) != 1 or not isinstance(resources[0], EveryPath):
        return None
    (route,) = resources[0]
    match = UrlMappingMatchInfo({}, route)
    match.add_app(app)
    match.freeze()
    handler = resources[0].direct or route.handler

    def handle(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        # The headers where the request keeps them, as proxy.request.parsed reads them.
        if request._headers.get(hdrs.EXPECT):
            return through_app(request)
        # The app's request factory makes web.Requests (not cast(): a Python call a request).
        made: web.Request = request  # type: ignore[assignment]
        made._match_info = match
        return handler(made)

    return handle


class EveryPath(web.PlainResource):
    """Every request's path, whatever it holds: a ``/{tail:.*}`` pattern's ``.`` stops at a
    decoded line break (``%0A``), and a path no route matches gets aiohttp's plain-text 404,
    neither logged nor counted. Cheaper than a pattern, too: nothing to match. ``direct``: what
    the listener calls for each request in place of the route's handler, without awaiting it
    (``direct_route``)."""

    def __init__(self, path: str, *, direct: Direct | None = None) -> None:
        super().__init__(path)
        self.direct = direct

    def _match(self, path: str) -> dict[str, str]:
        return {}
