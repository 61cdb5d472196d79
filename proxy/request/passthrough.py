"""Passing a request through untouched: streamed both ways with method, path, query, status, body
and end-to-end headers preserved; the body relayed from the upstream protocol itself.
"""

from __future__ import annotations

from typing import Final

from aiohttp import hdrs, web

from proxy.config import Upstream
from proxy.core import request_headers, response_headers
from proxy.http import HTTPClientError
from proxy.observe import RequestRecord
from proxy.request.models import MODELS_PATH, learn_listed
from proxy.request.parsed import has_body, headers_of, path_qs_of
from proxy.request.responses import ExactHead, Relayed, WholeAnswer
from proxy.request.sink import client_sink
from proxy.upstream import Exchange, UpstreamRequest, Upstreams

# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_SERVER: Final = hdrs.SERVER

_WHOLE_BODY: Final = 256 * 1024  # pass-through bodies up to this size are read whole, then sent


async def pass_through(
    request: web.Request,
    upstreams: Upstreams,
    upstream: Upstream,
    body: bytes,
    record: RequestRecord,
    client: str,
) -> web.StreamResponse:
    headers = request_headers(headers_of(request), upstream.headers)
    sent = UpstreamRequest(
        record.method, path_qs_of(request), headers, body if has_body(request) else None
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
    keeps_server = _SERVER in upstream_response.headers
    length = upstream_response.content_length
    exact = upstream_response.escaped  # bytes aiohttp's writer would not write back
    if length is not None and length <= _WHOLE_BODY and record.method != "HEAD" and not exact:
        # A small body of known length leaves with its headers in one write: one syscall
        # and one packet fewer on the most common pass-through answer.
        data = await exchange.read()
        record.bytes_out = len(data)
        if record.route != "other" and 200 <= status < 300:
            record.tail = data
        whole = WholeAnswer.relayed(
            status, upstream_response.reason, response_headers(upstream_response.fields), data
        )
        whole.keeps_server = keeps_server
        return whole
    response = (ExactHead if exact else Relayed)(
        status=status,
        reason=upstream_response.reason,
        headers=response_headers(upstream_response.fields),
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
