"""The proxy's aiohttp application: one catch-all handler that fans out or passes through.

Everything that is not a fan-out (n missing/1, other paths, native-n upstreams) is streamed
through both ways with method, path, query, status, body and end-to-end headers preserved.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.census import Census, UpstreamCensus
from proxy.clienterrors import kind_of
from proxy.config import Config, Upstream
from proxy.discovery import Resolver
from proxy.encoding import content_codings, inflate
from proxy.errors import (
    BodyTooLarge,
    ChildFailed,
    InvalidRequest,
    Overloaded,
    ProxyError,
    RequestTimeout,
    UnsupportedEncoding,
    UpstreamTimeout,
    UpstreamUnavailable,
    error_body,
    status_type,
)
from proxy.exchange import Answer, UpstreamRequest
from proxy.fanout import Fanout, respond_json, respond_stream
from proxy.headers import child_headers, client_request_id, request_headers, response_headers
from proxy.memory import Trimmer
from proxy.metrics import MULTIPROCESS, Metrics, failure_outcome, status_outcome
from proxy.outcome import Outcome, record
from proxy.plan import Endpoint, Plan, endpoint_of, parse_body, plan_request
from proxy.runtime import Runtime
from proxy.sink import ExactHead, client_sink
from proxy.tally import value_of
from proxy.upstream import UpstreamPool

if TYPE_CHECKING:
    pass

RUNTIME = web.AppKey("runtime", Runtime)
POOL = web.AppKey("pool", UpstreamPool)
TRIMMER = web.AppKey("trimmer", Trimmer)
UPSTREAM_SERVER = web.RequestKey("upstream_server", bool)  # a pass-through keeps that header
DEMO_HEADER = "X-N-Proxy-Demo"
SERVER = "n-proxy"  # our Server header, instead of aiohttp's "Python/3.x aiohttp/x.y"
_WHOLE_BODY = 256 * 1024  # pass-through bodies up to this size are read whole, then sent

_SAMPLE_SECONDS = 1.0  # --workers: how often each worker writes its queue depths for /metrics


def build_app(
    config: Config,
    runtime: Runtime | None = None,
    *,
    resolver: Resolver | None = None,
    notice: str | None = None,
) -> web.Application:
    """``resolver`` replaces the system's DNS lookups for ``discovery.dns`` (tests inject one);
    ``notice`` goes out as ``X-N-Proxy-Demo`` on every response (the demo mode's warning)."""
    app = web.Application(
        client_max_size=config.max_body_bytes,
        # auto_decompress off: a pass-through forwards the client's bytes as they came; the
        # fan-out paths inflate gzip/deflate themselves, within max_body_bytes (proxy.encoding).
        handler_args={"max_field_size": 65536, "auto_decompress": False},
    )
    app[RUNTIME] = runtime or Runtime(config)
    app[TRIMMER] = Trimmer()
    app.on_response_prepare.append(_server_header)
    if notice is not None:
        app.on_response_prepare.append(functools.partial(_notice_header, notice))
    app.cleanup_ctx.append(functools.partial(_pool, resolver=resolver))
    every = _EveryPath("/")
    app.router.register_resource(every)
    every.add_route("*", handle)
    return app


class _EveryPath(web.PlainResource):
    """Every request's path, whatever it holds: a ``/{tail:.*}`` pattern's ``.`` stops at a
    decoded line break (``%0A``), and a path no route matches gets aiohttp's plain-text 404,
    neither logged nor counted. Cheaper than a pattern, too: nothing to match."""

    def _match(self, path: str) -> dict[str, str]:
        return {}


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    if not request.get(UPSTREAM_SERVER, False):
        response.headers["Server"] = SERVER


async def _notice_header(notice: str, request: web.Request, response: web.StreamResponse) -> None:
    response.headers[DEMO_HEADER] = notice  # replaces any copy a pass-through brought along


async def _pool(app: web.Application, resolver: Resolver | None) -> AsyncIterator[None]:
    runtime = app[RUNTIME]
    pool = UpstreamPool(runtime.config, runtime.metrics, resolver)
    await pool.start(runtime.health_reported)
    app[POOL] = pool
    runtime.metrics.census = functools.partial(take_census, runtime, pool)
    sampler = asyncio.create_task(_sample(runtime.metrics)) if MULTIPROCESS else None
    yield
    app[TRIMMER].close()
    if sampler is not None:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    await pool.close()


def take_census(runtime: Runtime, pool: UpstreamPool | None) -> Census:
    """The counts as they are now; ``pool`` None before the app's start (nothing upstream)."""
    upstreams = []
    if pool is not None:
        for upstream in pool.config.upstreams:
            state = pool.state(upstream)
            upstreams.append(
                UpstreamCensus(
                    upstream.name,
                    state.slots.in_use,
                    state.slots.queued,
                    round(value_of(state.timings.in_flight)),
                    {replica.url: replica.outstanding for replica in state.replicas},
                )
            )
    return Census(
        requests=runtime.in_flight,
        children=runtime.children,
        streams=len(runtime.streams),
        connections=len(pool.connections.in_use) if pool is not None else 0,
        idle=pool.connections.idle_count() if pool is not None else 0,
        upstreams=tuple(upstreams),
    )


async def _sample(metrics: Metrics) -> None:
    while True:
        metrics.sample()
        await asyncio.sleep(_SAMPLE_SECONDS)


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

    Raises ``ProxyError`` for a body the proxy refuses (SPEC §2); reads nothing but the body and
    headers it is given.
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
    except (TimeoutError, aiohttp.ClientError, ConnectionError):
        # The status is sent already (or the client is gone): cut the client's connection so
        # it sees a truncated body.
        if request.transport is not None:
            request.transport.abort()
    return response


def child_failed_response(exc: ChildFailed) -> web.Response:
    """The failing child's own status and body (SPEC §5, §7); an empty body gets an OpenAI one."""
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
