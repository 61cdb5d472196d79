"""Passing a request through untouched: streamed both ways with method, path, query, status, body
and end-to-end headers preserved; the body relayed from the upstream protocol itself.
"""

from __future__ import annotations

import re

from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.compression_utils import MAX_SYNC_CHUNK_SIZE
from aiohttp.helpers import must_be_empty_body, rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion10, HttpVersion11
from aiohttp.http_writer import _serialize_headers
from multidict import CIMultiDict

from proxy.config import Upstream
from proxy.core import ClientGone, request_headers, response_headers
from proxy.http import HTTPClientError
from proxy.observe import RequestRecord
from proxy.request.models import MODELS_PATH, learn_listed
from proxy.request.sink import client_sink
from proxy.upstream import Exchange, UpstreamRequest, Upstreams

_WHOLE_BODY = 256 * 1024  # pass-through bodies up to this size are read whole, then sent


async def pass_through(
    request: web.Request,
    upstreams: Upstreams,
    upstream: Upstream,
    body: bytes,
    record: RequestRecord,
    client: str,
) -> web.StreamResponse:
    headers = request_headers(request.headers, upstream.headers)
    sent = UpstreamRequest(
        request.method, request.rel_url.raw_path_qs, headers, body if request.body_exists else None
    )
    (ticket,) = upstreams.admit(upstream, 1, client)
    async with upstreams.exchange(ticket, sent, record.child(None)) as exchange:
        response = await _relay(request, exchange, record)
    if record.path == MODELS_PATH and response.status == 200 and isinstance(response, web.Response):
        listed = response.body
        if isinstance(listed, bytes):
            learn_listed(upstreams, upstream, listed)
    return response


async def _relay(
    request: web.Request, exchange: Exchange, record: RequestRecord
) -> web.StreamResponse:
    upstream_response = exchange.response
    status = upstream_response.status
    record.bytes_out = 0  # answered: what is written from here is counted
    keeps_server = hdrs.SERVER in upstream_response.headers
    length = upstream_response.content_length
    exact = upstream_response.escaped  # bytes aiohttp's writer would not write back
    if length is not None and length <= _WHOLE_BODY and request.method != "HEAD" and not exact:
        # A small body of known length leaves with its headers in one write: one syscall
        # and one packet fewer on the most common pass-through answer.
        data = await exchange.read()
        record.bytes_out = len(data)
        if record.route != "other" and 200 <= status < 300:
            record.tail = data
        whole = WholeAnswer.relayed(
            status, upstream_response.reason, response_headers(upstream_response.headers), data
        )
        whole.keeps_server = keeps_server
        return whole
    response = (ExactHead if exact else Relayed)(
        status=status,
        reason=upstream_response.reason,
        headers=response_headers(upstream_response.headers),
    )
    response.keeps_server = keeps_server
    if length is not None:
        response.content_length = length
    try:
        # The head is written here: a client gone by now is the same as one gone mid-body.
        await response.prepare(request)
        # The sink stamps the first chunk (time to first token, for an LLM stream) and counts
        # the bytes, for the record once the body is over.
        sink = client_sink(request, record, first_chunk=True)
        try:
            await upstream_response.relay(sink.write, sink.full, sink.drain, sink.framed)
        finally:
            sink.settle()
        await response.write_eof()
    except (TimeoutError, HTTPClientError, ConnectionError):
        # The status is sent already (or the client is gone): cut the client's connection so
        # it sees a truncated body.
        if request.transport is not None:
            request.transport.abort()
    return response


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
        web.StreamResponse.__init__(answer, status=status, reason=reason, _real_headers=headers)
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
        if self.prepared:
            return False
        self._record = record
        return True

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        try:
            body = self.body
            if (
                self.prepared
                or not isinstance(body, bytes)
                or self._cookies  # the property would make an empty jar
                or self.compression
                or must_be_empty_body(request.method, self.status)
            ):
                return await super().prepare(request)
            headers = self.headers
            headers[hdrs.CONTENT_LENGTH] = str(len(body))
            if body:
                headers.setdefault(hdrs.CONTENT_TYPE, "application/octet-stream")
            if hdrs.DATE not in headers:
                headers[hdrs.DATE] = rfc822_formatted_time()
            headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE)
            keep_alive = self.keep_alive
            if keep_alive is None:
                keep_alive = self._keep_alive = request.keep_alive
            version = request.version
            if hdrs.CONNECTION not in headers:
                if not keep_alive:
                    if version == HttpVersion11:
                        headers[hdrs.CONNECTION] = "close"
                elif version == HttpVersion10:
                    headers[hdrs.CONNECTION] = "keep-alive"
            self._req = request
            await request._prepare_hook(self)
            status_line = f"HTTP/{version.major}.{version.minor} {self.status} {self.reason}"
            head = _serialize_headers(status_line, headers)
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("the client's connection is closing")
            transport.write(head + body)  # head and body in one write
            writer = request.writer
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
