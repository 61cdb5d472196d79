"""Passing a request through untouched: streamed both ways with method, path, query, status, body
and end-to-end headers preserved; the body relayed from the upstream protocol itself.
"""

from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager

from aiohttp import web

from proxy.config.models import Upstream
from proxy.core.errors import (
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.core.headers import request_headers, response_headers
from proxy.http import HTTPClientError
from proxy.observe.metrics import Metrics, failure_outcome, status_outcome
from proxy.request.outcome import Outcome
from proxy.request.runtime import POOL, RUNTIME
from proxy.request.sink import ExactHead, client_sink
from proxy.upstream.exchange import Answer, UpstreamRequest

UPSTREAM_SERVER = web.RequestKey("upstream_server", bool)  # a pass-through keeps that header
_WHOLE_BODY = 256 * 1024  # pass-through bodies up to this size are read whole, then sent


async def pass_through(
    request: web.Request, upstream: Upstream, body: bytes, outcome: Outcome
) -> web.StreamResponse:
    pool = request.app[POOL]
    metrics = request.app[RUNTIME].metrics
    trace = outcome.trace
    headers = request_headers(request.headers, upstream.headers)
    sent = UpstreamRequest(
        request.method, request.rel_url.raw_path_qs, headers, body if request.body_exists else None
    )
    joined = time.perf_counter()
    ((url, place),) = pool.admit(upstream, 1)
    exchange: AbstractAsyncContextManager[Answer]
    try:
        async with place:
            outcome.queued = waited = time.perf_counter() - joined
            metrics.queue_wait.labels(upstream.name).observe(waited)
            exchange = pool.send(upstream, url, sent, trace)
            tracing, span = request.app[RUNTIME].tracing, outcome.span
            if tracing is not None and span is not None:
                exchange = tracing.traced(span, exchange, trace, request.method, upstream.name,
                                          url, None, headers)  # fmt: skip
            async with exchange as answer:
                return await _relay(request, answer, metrics, upstream, outcome)
    except (UpstreamTimeout, UpstreamUnavailable) as exc:
        if outcome.bytes_out is None:  # no answer came: the upstream request's outcome
            metrics.upstream_responses.labels(upstream.name, failure_outcome(exc)).inc()
        raise


async def _relay(
    request: web.Request, answer: Answer, metrics: Metrics, upstream: Upstream, outcome: Outcome
) -> web.StreamResponse:
    upstream_response = answer.response
    status = upstream_response.status
    metrics.upstream_responses.labels(upstream.name, status_outcome(status)).inc()
    outcome.bytes_out = 0  # answered: a failure now is not the upstream request's outcome
    if "Server" in upstream_response.headers:
        request[UPSTREAM_SERVER] = True
    length = upstream_response.content_length
    exact = upstream_response.escaped  # bytes aiohttp's writer would not write back
    if length is not None and length <= _WHOLE_BODY and request.method != "HEAD" and not exact:
        # A small body of known length leaves with its headers in one write: one syscall
        # and one packet fewer on the most common pass-through answer.
        data = await answer.read()
        outcome.bytes_out = len(data)
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
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("the client left")
        write, full, drain = client_sink(request, transport)

        def counted(data: bytes) -> None:
            # The first chunk's time (time to first token, for an LLM stream) and the size.
            if outcome.first_chunk_at is None:
                outcome.first_chunk_at = time.perf_counter()
            outcome.bytes_out = (outcome.bytes_out or 0) + len(data)
            write(data)

        await answer.relay(counted, full, drain)
        await response.write_eof()
    except (TimeoutError, HTTPClientError, ConnectionError):
        # The status is sent already (or the client is gone): cut the client's connection so
        # it sees a truncated body.
        if request.transport is not None:
            request.transport.abort()
    return response
