"""The answers the proxy writes itself: its own errors and a failed child's, as OpenAI error
bodies, with its ``Server`` header; also the error pages of a client connection (a parser's
refusal, the pages written before any request was parsed).
"""

from __future__ import annotations

from http import HTTPStatus

import orjson
from aiohttp import web

from proxy.core import ChildFailed, Overloaded, ProxyError, error_body, status_type

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
