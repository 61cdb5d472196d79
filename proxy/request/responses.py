"""The answers the proxy writes itself: its own errors and a failed child's, as OpenAI error
bodies, with its ``Server`` header.
"""

from __future__ import annotations

from aiohttp import web

from proxy.core.errors import (
    ChildFailed,
    Overloaded,
    ProxyError,
    error_body,
    status_type,
)

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
