"""Passing a request through untouched: streamed both ways with method, path, query, status, body
and end-to-end headers preserved; the body relayed from the upstream protocol itself.
"""

from __future__ import annotations

from aiohttp import web

from proxy.config.models import Upstream
from proxy.core.headers import request_headers, response_headers
from proxy.http import HTTPClientError
from proxy.observe.record import RequestRecord
from proxy.request.sink import ExactHead, client_sink
from proxy.upstream.service import Exchange, UpstreamRequest, Upstreams

UPSTREAM_SERVER = web.RequestKey("upstream_server", bool)  # a pass-through keeps that header
_WHOLE_BODY = 256 * 1024  # pass-through bodies up to this size are read whole, then sent


async def pass_through(
    request: web.Request,
    upstreams: Upstreams,
    upstream: Upstream,
    body: bytes,
    record: RequestRecord,
) -> web.StreamResponse:
    headers = request_headers(request.headers, upstream.headers)
    sent = UpstreamRequest(
        request.method, request.rel_url.raw_path_qs, headers, body if request.body_exists else None
    )
    (ticket,) = upstreams.admit(upstream, 1)
    async with upstreams.exchange(ticket, sent, record.child(None)) as exchange:
        return await _relay(request, exchange, record)


async def _relay(
    request: web.Request, exchange: Exchange, record: RequestRecord
) -> web.StreamResponse:
    upstream_response = exchange.response
    status = upstream_response.status
    record.bytes_out = 0  # answered: what is written from here is counted
    if "Server" in upstream_response.headers:
        request[UPSTREAM_SERVER] = True
    length = upstream_response.content_length
    exact = upstream_response.escaped  # bytes aiohttp's writer would not write back
    if length is not None and length <= _WHOLE_BODY and request.method != "HEAD" and not exact:
        # A small body of known length leaves with its headers in one write: one syscall
        # and one packet fewer on the most common pass-through answer.
        data = await exchange.read()
        record.bytes_out = len(data)
        return web.Response(
            status=status,
            reason=upstream_response.reason,
            headers=response_headers(upstream_response.headers),
            body=data,
        )
    response = (ExactHead if exact else web.StreamResponse)(
        status=status,
        reason=upstream_response.reason,
        headers=response_headers(upstream_response.headers),
    )
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
