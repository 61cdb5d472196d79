"""The proxy's one request handler: read the body, decide (fan out or pass through), dispatch.

Everything that is not a fan-out (n missing/1, other paths, native-n upstreams) is passed through
(``proxy.request.passthrough``); a fan-out runs in ``proxy.request.fanout``. The handler owns the
request's record (``proxy.observe.record``): every layer below reports to it, and its observers
(metrics, spans, the log line) read it at the end. ``InFlight`` is what a drain waits for. What
serves a config, and a reload, are ``proxy.server.generations``'.
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import Final

import aiohttp
import orjson
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.config import Config, Upstream
from proxy.core import (
    X_REQUEST_ID,
    BodyTooLarge,
    ChildFailed,
    Endpoint,
    InvalidRequest,
    Plan,
    ProxyError,
    RequestTimeout,
    UnsupportedEncoding,
    child_headers,
    client_request_id,
    content_codings,
    endpoint_of,
    inflate,
    parse_body,
    plan_request,
)
from proxy.observe import ClientErrors, Metrics, Observers, RequestRecord, kind_of
from proxy.request.clients import ClientIds
from proxy.request.fanout import Fanout, Fanouts, respond_json, respond_stream
from proxy.request.models import MODELS_PATH, list_models, merges_models
from proxy.request.parsed import (
    body_as_it_lies,
    content_of,
    headers_of,
    method_of,
    path_of,
    path_qs_of,
    status_of,
    version_of,
)
from proxy.request.passthrough import pass_through
from proxy.request.responses import (
    WholeAnswer,
    child_failed_response,
    error_response,
)
from proxy.upstream import Upstreams

# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_json_loads: Final = orjson.loads
_HTTP_10: Final = aiohttp.HttpVersion10
_CONTENT_ENCODING: Final = hdrs.CONTENT_ENCODING
_partial: Final = functools.partial
_timeout: Final = asyncio.timeout


class Requests:
    """A count of requests being handled, and a wait until there are none. The event is
    touched only while someone waits: a request pays for two integer steps alone."""

    def __init__(self) -> None:
        self.requests = 0
        self._waiting = 0
        self._idle = asyncio.Event()

    def enter(self) -> None:
        self.requests += 1

    def leave(self) -> None:
        self.requests -= 1
        if self.requests == 0 and self._waiting:
            self._idle.set()

    async def wait_idle(self) -> None:
        self._waiting += 1
        try:
            while self.requests:
                self._idle.clear()
                await self._idle.wait()
        finally:
            self._waiting -= 1


class InFlight(Requests):
    """The requests being handled (a drain waits for them to end), their fan-outs' children and
    streams (``Fanouts``), and whether the proxy drains."""

    def __init__(self) -> None:
        super().__init__()
        self.draining = False
        self.fanouts = Fanouts()


class Handler:
    """The handler of every path, with what it serves with."""

    def __init__(
        self,
        config: Config,
        upstreams: Upstreams,
        observers: Observers,
        in_flight: InFlight,
        client_errors: ClientErrors,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.upstreams = upstreams
        self.observers = observers
        self.in_flight = in_flight
        self.client_errors = client_errors
        self.metrics = metrics
        self.merges_models = merges_models(upstreams)
        self.clients = ClientIds(config.clients)
        self.begun = Requests()  # the requests that began here: a reload's old generation waits
        # A request with more children than one client may have at once could never be admitted:
        # 400 with the plan's own wording, not a 429 the client would retry for ever.
        cap = config.clients.max_children
        self.max_children = min(config.max_children, cap) if cap else config.max_children
        # What every request reads of the config, as fields of this compiled class: a field of
        # a pydantic model is a Python attribute read through its __getattr__ hook.
        self.fanout_paths = frozenset(config.fanout_paths)
        self.max_body_bytes = config.max_body_bytes
        self.max_n = config.max_n

    async def handle(self, request: web.Request) -> web.StreamResponse:
        record = RequestRecord(
            self.observers, method_of(request), path_of(request), headers_of(request)
        )
        in_flight, begun = self.in_flight, self.begun
        in_flight.enter()
        begun.enter()
        ends_here = True
        try:
            response = await self._dispatch(request, record)
            record.status = status_of(response)
            if record.bytes_out is None and isinstance(response, web.Response):
                record.bytes_out = response.content_length
            if isinstance(response, WholeAnswer):
                # Counted before it leaves; its line and span once it is written, off the
                # client's wait: aiohttp prepares it next, with no await between.
                record.counted()
                ends_here = not response.ends(record)
            return response
        finally:
            begun.leave()
            in_flight.leave()
            if ends_here:
                record.ended()

    async def _dispatch(self, request: web.Request, record: RequestRecord) -> web.StreamResponse:
        config = self.config
        if version_of(request) < _HTTP_10:
            # An HTTP/0.9-style request line ("GET /"): nothing of it goes upstream.
            message = "malformed request line: no HTTP version"
            return error_response(InvalidRequest(message), close=True)
        # The record holds the request's own path, method and headers: read there.
        path, method = record.path, record.method
        record.client = client = self.clients.of(request)
        if self.merges_models and path == MODELS_PATH and method == "GET":
            record.upstream = config.default_upstream
            return await list_models(request, self.upstreams, record, client)
        fans_out = method == "POST" and path in self.fanout_paths
        body = await self._read_body(request)
        if not isinstance(body, bytes):  # not web.StreamResponse: an ABC, a slower test
            if fans_out and not body.prepared:  # a 413: the answer of a fan-out request too
                body.headers["X-Request-Id"] = _error_request_id(request, b"")
            return body
        record.bytes_in = len(body)
        endpoint = endpoint_of(path) if fans_out else None
        if endpoint is not None:
            record.route = path
        passing = False  # a pass-through's answers are the upstream's, its errors unnamed
        try:
            upstream, plan = self._decide(request, endpoint, body, record)
            record.upstream = upstream.name
            record.provider = upstream.provider
            if plan is None:
                passing = True
                return await pass_through(request, self.upstreams, upstream, body, record, client)
            return await self._fan_out(request, record, upstream, plan, client)
        except (ProxyError, ChildFailed) as exc:
            response = (
                error_response(exc) if isinstance(exc, ProxyError) else child_failed_response(exc)
            )
            if endpoint is not None and not passing:
                # Every answer of a fan-out carries the parent's id, errors included
                # (docs/behaviour.md#headers), as its stitched 200s and the servers' own do.
                response.headers["X-Request-Id"] = record.request_id or _error_request_id(
                    request, body
                )
            return response

    async def _fan_out(
        self,
        request: web.Request,
        record: RequestRecord,
        upstream: Upstream,
        plan: Plan,
        client: str,
    ) -> web.StreamResponse:
        config = self.config
        record.fanned_out = True
        record.n = plan.best_of or plan.n
        record.request_id = plan.parent_id
        record.relayed = plan.stream
        fanout = Fanout(
            upstreams=self.upstreams,
            upstream=upstream,
            plan=plan,
            config=config,
            path_qs=path_qs_of(request),
            headers=child_headers(headers_of(request), upstream.headers),
            record=record,
            fanouts=self.in_flight.fanouts,
            client=client,
        )
        if plan.stream:
            return await respond_stream(fanout, request)
        return await respond_json(fanout)

    async def _read_body(self, request: web.Request) -> bytes | web.StreamResponse:
        """The whole request body, or the answer that ends the request instead (413, 408)."""
        config = self.config
        whole = body_as_it_lies(request)  # the whole body came with the head: taken as it lies
        if whole is not None:
            return whole if len(whole) <= self.max_body_bytes else _too_large(config)
        content = content_of(request)
        try:
            if content.is_eof():  # the whole body is in, in pieces
                body = content.read_nowait()
                return body if len(body) <= self.max_body_bytes else _too_large(config)
            async with _timeout(config.client_timeouts.body):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:  # request.read()'s cap: the app's client_max_size
            return _too_large(config)
        except HttpProcessingError as exc:  # its framing is broken: a bad chunk size, say
            self.client_errors.record(kind_of(exc), type(exc).__name__, request.remote)
            refused: ProxyError = InvalidRequest(f"malformed request body: {exc.message[:200]}")
        except TimeoutError:
            seconds = config.client_timeouts.body
            self.metrics.client_timeouts.labels("body").inc()
            refused = RequestTimeout(f"request body not received within {seconds} s")
        # Answered after the handler, not in it: compiled, a handler must not suspend
        # (docs/architecture.md#working-on-a-compiled-module).
        return await _answer_and_close(request, refused)

    def _decide(
        self, request: web.Request, endpoint: Endpoint | None, body: bytes, record: RequestRecord
    ) -> tuple[Upstream, Plan | None]:
        """Where the request goes, and its children when it fans out (``None``: pass it
        through); its model where the body was read (for the log line and the metrics) and, on a
        fan-out path, the body itself (for its span) go on ``record``.

        Raises ``ProxyError`` for a body the proxy refuses (docs/behaviour.md#validation); reads
        nothing but the body and headers it is given.
        """
        coding = record.headers.get(_CONTENT_ENCODING)
        codings = content_codings(coding) if coding is not None else []  # most requests have none
        if endpoint is not None:
            plain = inflate(body, codings, self.max_body_bytes) if codings else body
            parsed: dict[str, object] | None = parse_body(plain)
        else:
            parsed = self._routing_json(request, body, codings)
        found = parsed.get("model") if parsed is not None else None
        model = found if isinstance(found, str) else None
        upstream = self.upstreams.route(record.path, model)
        record.model = model[:200] if model is not None else None  # the log's: bounded
        if endpoint is not None:
            record.body = parsed
        if endpoint is None or parsed is None or upstream.native_n:
            return upstream, None
        plan = plan_request(
            parsed,
            _partial(_parent_id, request, parsed),
            self.max_n,
            endpoint=endpoint,
            max_children=self.max_children,
        )
        return upstream, plan

    def _routing_json(
        self, request: web.Request, body: bytes, codings: list[str]
    ) -> dict[str, object] | None:
        """Only model-based routes need the body of a non-fan-out request; it is forwarded as
        sent.

        Declared JSON is held to the same policy as a fan-out body (no NaN, Infinity, BOM...).
        """
        if (
            not self.upstreams.routes_by_model
            or not body
            or request.content_type != "application/json"
        ):
            return None
        try:
            plain = inflate(body, codings, self.config.max_body_bytes) if codings else body
        except UnsupportedEncoding:
            return None  # unreadable here: the default route gets it as it came
        try:
            parsed = _json_loads(plain)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
        return parsed if isinstance(parsed, dict) else None


def _too_large(config: Config) -> web.Response:
    return error_response(
        BodyTooLarge(f"request body is larger than {config.max_body_bytes} bytes")
    )


async def _answer_and_close(request: web.Request, exc: ProxyError) -> web.Response:
    """The answer to a body the proxy stopped reading; then the connection is closed, rather
    than linger reading the rest of the body."""
    response = error_response(exc)
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response


def _error_request_id(request: web.Request, body: bytes) -> str:
    """The id of a fan-out request refused before it had a plan: the client's (header, else a
    plain JSON body's ``request_id``) or a fresh one, as its children would have had."""
    try:
        parsed = _json_loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    return _parent_id(request, parsed if isinstance(parsed, dict) else {})


def _parent_id(request: web.Request, body: dict[str, object]) -> str:
    incoming = client_request_id(request.headers.get(X_REQUEST_ID), body.get("request_id"))
    if incoming is not None:
        return incoming
    return os.urandom(16).hex()  # as random as uuid4().hex, at a third of its cost
