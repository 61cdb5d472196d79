"""The proxy's one request handler: read the body, decide (fan out or pass through), dispatch.

Everything that is not a fan-out (n missing/1, other paths, native-n upstreams) is passed through
(``proxy.request.passthrough``); a fan-out runs in ``proxy.request.fanout``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.config.models import Config, Upstream
from proxy.core.encoding import content_codings, inflate
from proxy.core.errors import (
    BodyTooLarge,
    ChildFailed,
    InvalidRequest,
    ProxyError,
    RequestTimeout,
    UnsupportedEncoding,
)
from proxy.core.headers import child_headers, client_request_id
from proxy.core.plan import Endpoint, Plan, endpoint_of, parse_body, plan_request
from proxy.observe.clienterrors import kind_of
from proxy.request.fanout import Fanout, respond_json, respond_stream
from proxy.request.outcome import Outcome, record
from proxy.request.passthrough import pass_through
from proxy.request.responses import child_failed_response, error_response
from proxy.request.runtime import POOL, RUNTIME, TRIMMER, Runtime


async def handle(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    started = time.perf_counter()  # not loop.time(): uvloop's has millisecond steps
    outcome = Outcome()
    tracing = runtime.tracing
    if tracing is not None:
        outcome.span = tracing.server_span(request.method, request.path, request.headers)
    runtime.enter()
    try:
        response = await _dispatch(request, outcome)
        outcome.status = response.status
        if outcome.bytes_out is None and isinstance(response, web.Response):
            outcome.bytes_out = response.content_length
        return response
    finally:
        runtime.leave()
        request.app[TRIMMER].request_ended(outcome.body_bytes, outcome.children)
        record(request, outcome, runtime.metrics, tracing, started, time.perf_counter())


async def _dispatch(request: web.Request, outcome: Outcome) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    config = runtime.config
    if request.version < aiohttp.HttpVersion10:
        # An HTTP/0.9-style request line ("GET /"): nothing of it goes upstream.
        return error_response(InvalidRequest("malformed request line: no HTTP version"), close=True)
    body = await _read_body(request, runtime)
    if isinstance(body, web.StreamResponse):
        return body
    outcome.body_bytes = len(body)
    path = request.rel_url.path
    endpoint = endpoint_of(path) if _fans_out(request, config) else None
    if endpoint is not None:
        outcome.route = path
    try:
        upstream, plan, outcome.model = _decide(request, config, endpoint, body)
        outcome.upstream = upstream.name
        if plan is None:
            return await pass_through(request, upstream, body, outcome)
        outcome.n = plan.best_of or plan.n
        outcome.children = len(plan.children)
        runtime.metrics.n.observe(outcome.n)
        headers = child_headers(request.headers, upstream.headers)
        fanout = outcome.fanout = Fanout(
            pool=request.app[POOL],
            runtime=runtime,
            upstream=upstream,
            plan=plan,
            path_qs=request.rel_url.raw_path_qs,
            headers=headers,
            tracing=runtime.tracing,
            span=outcome.span,
        )
        outcome.streamed = plan.stream
        if plan.stream:
            return await respond_stream(fanout, request)
        return await respond_json(fanout)
    except ProxyError as exc:
        return error_response(exc)
    except ChildFailed as exc:
        return child_failed_response(exc)


async def _read_body(request: web.Request, runtime: Runtime) -> bytes | web.StreamResponse:
    """The whole request body, or the answer that ends the request instead (413, 408)."""
    config = runtime.config
    try:
        if request.content.is_eof():  # the whole body came with the head: nothing to wait for
            return await request.read()
        async with asyncio.timeout(config.client_timeouts.body):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error_response(
            BodyTooLarge(f"request body is larger than {config.max_body_bytes} bytes")
        )
    except HttpProcessingError as exc:  # its framing is broken: a bad chunk size, say
        runtime.client_errors.record(kind_of(exc), type(exc).__name__, request.remote)
        message = f"malformed request body: {exc.message[:200]}"
        return await _answer_and_close(request, InvalidRequest(message))
    except TimeoutError:
        seconds = config.client_timeouts.body
        runtime.metrics.client_timeouts.labels("body").inc()
        message = f"request body not received within {seconds} s"
        return await _answer_and_close(request, RequestTimeout(message))


async def _answer_and_close(request: web.Request, exc: ProxyError) -> web.Response:
    """The answer to a body the proxy stopped reading; then the connection is closed, rather
    than linger reading the rest of the body."""
    response = error_response(exc)
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response


def _fans_out(request: web.Request, config: Config) -> bool:
    return request.method == "POST" and request.rel_url.path in config.fanout_paths


def _decide(
    request: web.Request, config: Config, endpoint: Endpoint | None, body: bytes
) -> tuple[Upstream, Plan | None, str | None]:
    """Where the request goes, its children when it fans out (``None``: pass it through), and
    its model where the body was read (for the log line).

    Raises ``ProxyError`` for a body the proxy refuses (docs/behaviour.md#validation); reads
    nothing but the body and headers it is given.
    """
    codings = content_codings(request.headers.get("Content-Encoding"))
    if endpoint is not None:
        plain = inflate(body, codings, config.max_body_bytes) if codings else body
        parsed: dict[str, object] | None = parse_body(plain)
    else:
        parsed = _routing_json(request, body, codings, config)
    found = parsed.get("model") if parsed is not None else None
    model = found if isinstance(found, str) else None
    upstream = config.choose_upstream(request.rel_url.path, model)
    model = model[:200] if model is not None else None  # the log's: bounded
    if endpoint is None or parsed is None or upstream.native_n:
        return upstream, None, model
    plan = plan_request(
        parsed,
        functools.partial(_parent_id, request, parsed),
        config.max_n,
        endpoint=endpoint,
        max_children=config.max_children,
    )
    return upstream, plan, model


def _routing_json(
    request: web.Request, body: bytes, codings: list[str], config: Config
) -> dict[str, object] | None:
    """Only model-based routes need the body of a non-fan-out request; it is forwarded as sent.

    Declared JSON is held to the same policy as a fan-out body (no NaN, Infinity, BOM...).
    """
    if not config.routes_by_model or not body or request.content_type != "application/json":
        return None
    try:
        plain = inflate(body, codings, config.max_body_bytes) if codings else body
    except UnsupportedEncoding:
        return None  # unreadable here: the default route gets it as it came
    try:
        parsed = orjson.loads(plain)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    return parsed if isinstance(parsed, dict) else None


def _parent_id(request: web.Request, body: dict[str, object]) -> str:
    incoming = client_request_id(request.headers.get("X-Request-Id"), body.get("request_id"))
    if incoming is not None:
        return incoming
    return os.urandom(16).hex()  # as random as uuid4().hex, at a third of its cost
