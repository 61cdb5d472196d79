"""The answers' classes: a whole answer written in one write (``WholeAnswer``), an answer relayed
as it comes (``Relayed``, ``ExactHead``). Also the answers the proxy writes itself: its own
errors and a failed child's, as OpenAI error bodies, with its ``Server`` header, and the error
pages of a client connection (a parser's refusal, the pages written before any request was
parsed). Not compiled: the classes subclass aiohttp's responses (docs/architecture.md, house
rules), and use its private members.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.compression_utils import MAX_SYNC_CHUNK_SIZE
from aiohttp.helpers import must_be_empty_body, rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion10, HttpVersion11
from aiohttp.http_writer import _serialize_headers
from multidict import CIMultiDict

from proxy.core import ChildFailed, ClientGone, Overloaded, ProxyError, error_body, status_type
from proxy.observe import RequestRecord
from proxy.request.parsed import keeps_alive, method_of, version_of

SERVER = "n-proxy"  # our Server header, instead of aiohttp's "Python/3.x aiohttp/x.y"


def child_failed_response(exc: ChildFailed) -> web.Response:
    """The failing child's own status and body (docs/behaviour.md#errors); an empty body gets an
    OpenAI one."""
    if exc.body.strip():
        return web.Response(
            status=exc.status, body=exc.body, content_type=exc.content_type or "application/json"
        )
    message = f"upstream answered {exc.status} with an empty body"
    body = error_body(message, status_type(exc.status), code=exc.status)
    return web.json_response(body, status=exc.status)


def error_response(exc: ProxyError, *, close: bool = False) -> web.Response:
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Overloaded) else None
    response = web.Response(
        status=exc.status, body=exc.body(), content_type="application/json", headers=headers
    )
    if close:
        response.force_close()
    return response


def error_page(status: int, error: ProxyError) -> bytes:
    """A whole answer, head and body, written before any request is parsed: aiohttp's writer
    is not there."""
    body = error.body()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        f"Server: {SERVER}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def status_response(status: int, message: str) -> web.Response:
    """An error page aiohttp writes itself (a request its parser refused, a handler's crash)
    with an OpenAI body; the connection is closed after it."""
    response = web.Response(
        status=status,
        body=orjson.dumps(error_body(message, status_type(status))),
        content_type="application/json",
        headers={"Server": SERVER},
    )
    response.force_close()
    return response


def name_server(response: web.StreamResponse) -> None:
    """Every answer the proxy writes carries its ``Server`` header instead of aiohttp's; a
    pass-through keeps the upstream's own, when it sent one."""
    if not (isinstance(response, (WholeAnswer, Relayed)) and response.keeps_server):
        response._headers[hdrs.SERVER] = SERVER  # not the property: a Python call


async def server_header(request: web.Request, response: web.StreamResponse) -> None:
    """``name_server`` as the app's ``on_response_prepare`` hook."""
    name_server(response)


_SERVER_HEADER_ONLY = (server_header,)


def _prepare_hooks(request: web.BaseRequest) -> tuple[object, ...]:
    """What ``request._prepare_hook`` runs: the ``on_response_prepare`` handlers of the
    request's apps; ``_SERVER_HEADER_ONLY`` itself when that is all (the proxy app's own), so a
    whole answer can set that header itself and skip the signal, three coroutines a request.
    The last match's are kept in ``_last_hooks``, which ``WholeAnswer.prepare`` reads before it
    calls this: the listener gives every request the same match
    (``proxy.server.connection.direct_route``), and a started app's signals are frozen."""
    global _last_hooks
    match = getattr(request, "_match_info", None)
    if match is None:
        return ()
    apps = match._apps
    if len(apps) == 1 and list(apps[0].on_response_prepare) == [server_header]:
        hooks = _SERVER_HEADER_ONLY  # the proxy's: one app, no sub-apps, its one hook
    else:
        hooks = tuple(hook for app in apps for hook in app.on_response_prepare)
    if all(app.frozen for app in apps):
        _last_hooks = (match, hooks)
    return hooks


_last_hooks: tuple[object, tuple[object, ...]] = (None, ())


class WholeAnswer(web.Response):
    """An answer with its whole body in hand: head and body leave in one write as aiohttp
    prepares it. aiohttp's own steps (prepare, then write_eof,
    each several coroutines deep) cost 5 % of a pass-through request's instructions. The head
    gets what those steps add (``Content-Length``, a ``Content-Type`` for a body without one,
    ``Date``, ``Server``, ``Connection`` as the request's keep-alive says), then the app's
    ``on_response_prepare``; aiohttp's serialiser writes it, refusing a control character. An
    answer that must have no body (to a HEAD or a CONNECT, a 1xx, 204 or 304) takes aiohttp's
    steps. tests/meta/test_layers.py checks the internals it sets."""

    _record: RequestRecord | None = None  # what ends once the answer is written
    # aiohttp's, which prepare reads and sets: declared for the build's type check, which runs
    # without aiohttp installed (tests/meta/test_build.py).
    _eof_sent: bool
    _keep_alive: bool | None
    _state: dict[Any, Any]
    _status: int
    _reason: str
    keeps_server = False  # a pass-through's, whose upstream sent its own (server_header)
    # aiohttp asks each answer with getattr(answer, "__http_exception__", False): on a class
    # without it, an AttributeError is made and caught on every request.
    __http_exception__ = False

    @classmethod
    def relayed(
        cls, status: int, reason: str | None, headers: CIMultiDict[str], body: bytes
    ) -> WholeAnswer:
        """A pass-through's answer, with the headers made for it (``response_headers``) taken as
        they are: ``web.Response.__init__`` would check arguments a pass-through never gives,
        then copy them. What it sets is set here (tests/meta/test_layers.py checks the names)."""
        answer = cls.__new__(cls)
        # web.StreamResponse.__init__'s and _set_status's sets, without their two calls.
        if reason is None:
            reason = _REASONS.get(status, "")
        elif "\r" in reason or "\n" in reason:
            raise ValueError("Reason cannot contain \\r or \\n")
        answer._state = {}
        answer._headers = headers
        answer._status = status
        answer._reason = reason
        answer._body = body
        answer._compressed_body = None
        answer._zlib_executor_size = MAX_SYNC_CHUNK_SIZE
        answer._zlib_executor = None
        return answer

    def ends(self, record: RequestRecord) -> bool:
        """Whether ``record`` is ended here, once head and body are written (or their write
        failed), rather than by the handler before: its log line and span off the client's wait
        (its metrics are counted before, ``RequestRecord.counted``). A coroutine's first steps
        run before any cancellation can reach it, so ``prepare``, which aiohttp calls right after
        the handler returns, ends it whatever happens."""
        if self._eof_sent or self._payload_writer is not None:  # prepared (see prepare)
            return False
        self._record = record
        return True

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        # Each property aiohttp's answer and request give is read here where they keep it (in
        # order: body, prepared, compression, status, headers, keep_alive, reason, transport,
        # writer): a property is a Python call, 500 instructions each on Python 3.11.
        try:
            body = self._body
            status = self._status
            if (
                self._eof_sent
                or self._payload_writer is not None
                or not isinstance(body, bytes)
                or self._cookies  # the property would make an empty jar
                or self._compression
                or must_be_empty_body(method_of(request), status)
            ):
                return await super().prepare(request)
            headers = self._headers
            headers[hdrs.CONTENT_LENGTH] = str(len(body))
            if body:
                headers.setdefault(hdrs.CONTENT_TYPE, "application/octet-stream")
            if hdrs.DATE not in headers:
                headers[hdrs.DATE] = rfc822_formatted_time()
            headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE)
            keep_alive = self._keep_alive
            if keep_alive is None:
                keep_alive = self._keep_alive = keeps_alive(request)
            version = version_of(request)
            if hdrs.CONNECTION not in headers:
                if not keep_alive:
                    if version == HttpVersion11:
                        headers[hdrs.CONNECTION] = "close"
                elif version == HttpVersion10:
                    headers[hdrs.CONNECTION] = "keep-alive"
            self._req = request
            last, hooks = _last_hooks  # _prepare_hooks, without its call for the usual match
            if getattr(request, "_match_info", None) is not last:
                hooks = _prepare_hooks(request)
            if hooks is _SERVER_HEADER_ONLY:
                if not self.keeps_server:  # name_server's work, without its call
                    headers[hdrs.SERVER] = SERVER
            elif hooks:
                await request._prepare_hook(self)
            status_line = f"HTTP/{version.major}.{version.minor} {status} {self._reason}"
            head = _serialize_headers(status_line, headers)
            protocol = request._protocol
            transport = None if protocol is None else protocol.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("the client's connection is closing")
            transport.write(head + body)  # head and body in one write
            writer = request._payload_writer
            writer.output_size += len(head) + len(body)
            self._eof_sent = True  # aiohttp's write_eof, called next, has nothing left to do
            self._body_length = writer.output_size
            self._req = None
            slow = transport.get_write_buffer_size() > 0
        finally:
            record = self._record
            if record is not None:
                self._record = None
                record.ended()
        if slow:
            await writer.drain()  # a slow reader: no next answer piles up behind this one
        return None


_REASONS = {status.value: status.phrase for status in HTTPStatus}  # as aiohttp's REASON_PHRASES

_FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # as aiohttp's writer (RFC 9110 §5.5)


class Relayed(web.StreamResponse):
    """A passed-through answer relayed as it comes, its head first."""

    keeps_server = False  # the upstream sent its own ``Server`` header (server_header)
    __http_exception__ = False  # as WholeAnswer's


class ExactHead(Relayed):
    """A relayed response whose head holds bytes that are not UTF-8 (a Latin-1 header value).

    Such bytes reach the proxy as surrogate escapes; aiohttp's writer encodes a head as UTF-8,
    and its C writer drops surrogates. This head is written here instead, each byte as the
    upstream sent it; the body then goes through ``client_sink`` as for any relay. It leans on
    aiohttp's internals (``_write_headers``, ``_req``): tests/meta/test_layers.py checks them.
    """

    async def _write_headers(self) -> None:  # aiohttp's step that serialises the head
        request = self._req
        assert request is not None
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ClientGone()
        version = request.version
        parts = [f"HTTP/{version.major}.{version.minor} {self.status} {self.reason}"]
        parts += [f"{name}: {value}" for name, value in self.headers.items()]
        for part in parts:
            if _FORBIDDEN.search(part):
                raise ValueError("a control character in a response header")
        head = "\r\n".join(parts) + "\r\n\r\n"
        transport.write(head.encode("utf-8", "surrogateescape"))
