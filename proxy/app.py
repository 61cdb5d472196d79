"""The proxy's aiohttp application: one catch-all handler that fans out or passes through.

Everything that is not a fan-out (n missing/1, other paths, native-n upstreams) is streamed
through both ways with method, path, query, status, body and end-to-end headers preserved.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator

import aiohttp
import orjson
from aiohttp import web

from proxy.config import Config, Upstream
from proxy.errors import BodyTooLarge, ChildFailed, Overloaded, ProxyError
from proxy.fanout import Fanout, respond_json, respond_stream
from proxy.headers import request_headers, response_headers
from proxy.plan import parse_body, plan_request
from proxy.upstream import UpstreamPool

CONFIG = web.AppKey("config", Config)
POOL = web.AppKey("pool", UpstreamPool)

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,200}")  # visible ASCII: safe to echo and to prefix


def build_app(config: Config) -> web.Application:
    app = web.Application(
        client_max_size=config.max_body_bytes, handler_args={"max_field_size": 65536}
    )
    app[CONFIG] = config
    app.cleanup_ctx.append(_pool)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def _pool(app: web.Application) -> AsyncIterator[None]:
    pool = UpstreamPool(app[CONFIG])
    await pool.start()
    app[POOL] = pool
    yield
    await pool.close()


async def handle(request: web.Request) -> web.StreamResponse:
    config = request.app[CONFIG]
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error_response(
            BodyTooLarge(f"request body is larger than {config.max_body_bytes} bytes")
        )
    path = request.rel_url.path
    fanout_path = request.method == "POST" and path in config.fanout_paths
    try:
        parsed = parse_body(body) if fanout_path else _maybe_json(request, body, config)
        model = parsed.get("model") if parsed is not None else None
        upstream = config.choose_upstream(path, model if isinstance(model, str) else None)
        if fanout_path and parsed is not None and not upstream.native_n:
            plan = plan_request(
                parsed,
                _parent_id(request),
                config.max_n,
                completions=path.endswith("/completions")
                and not path.endswith("/chat/completions"),
            )
            if plan is not None:
                fanout = Fanout(
                    pool=request.app[POOL],
                    upstream=upstream,
                    plan=plan,
                    path_qs=request.rel_url.raw_path_qs,
                    headers=request_headers(request.headers, upstream.headers),
                )
                if plan.stream:
                    return await respond_stream(fanout, request)
                return await respond_json(fanout)
        return await pass_through(request, upstream, body)
    except ProxyError as exc:
        return error_response(exc)
    except ChildFailed as exc:
        return web.Response(
            status=exc.status,
            body=exc.body,
            content_type=exc.content_type or "application/json",
        )


def _maybe_json(request: web.Request, body: bytes, config: Config) -> dict[str, object] | None:
    """Only model-based routes need the body of a non-fan-out request."""
    if not config.routes_by_model or not body or request.content_type != "application/json":
        return None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _parent_id(request: web.Request) -> str:
    incoming = request.headers.get("X-Request-Id")
    if incoming is not None and _REQUEST_ID.fullmatch(incoming):
        return incoming
    return uuid.uuid4().hex


async def pass_through(request: web.Request, upstream: Upstream, body: bytes) -> web.StreamResponse:
    pool = request.app[POOL]
    (url,) = pool.place(upstream, 1)
    headers = request_headers(request.headers, upstream.headers)
    async with (
        pool.slots(upstream, 1),
        pool.send(
            upstream,
            url,
            request.method,
            request.rel_url.raw_path_qs,
            headers,
            body if request.body_exists else None,
            decompress=False,
        ) as upstream_response,
    ):
        response = web.StreamResponse(
            status=upstream_response.status,
            reason=upstream_response.reason,
            headers=response_headers(upstream_response.headers),
        )
        if upstream_response.content_length is not None:
            response.content_length = upstream_response.content_length
        await response.prepare(request)
        try:
            async for chunk in upstream_response.content.iter_any():
                await response.write(chunk)
        except (TimeoutError, aiohttp.ClientError):
            # The status is sent already: cut the client's connection so it sees a truncated body.
            if request.transport is not None:
                request.transport.abort()
            return response
        await response.write_eof()
        return response


def error_response(exc: ProxyError) -> web.Response:
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Overloaded) else None
    return web.Response(
        status=exc.status, body=exc.body(), content_type="application/json", headers=headers
    )
