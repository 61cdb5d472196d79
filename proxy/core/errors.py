"""The proxy's own errors and the one place that turns them into OpenAI error bodies.

ProxyError                 status + OpenAI error body
├── InvalidRequest         400 invalid_request_error (bad n, seed, best_of, JSON, too many children)
├── RequestTimeout         408 (the client sent its body too slowly)
├── BodyTooLarge           413 (also after inflating a gzip/deflate body)
├── UnsupportedEncoding    415 (a Content-Encoding the proxy cannot inflate, on a fan-out path)
├── Overloaded             429, with Retry-After
│   └── ClientLimited      429: the client is at clients.max_children
├── UpstreamUnavailable    502 (connection refused, reset before headers, bad upstream body)
└── UpstreamTimeout        504
ChildFailed                a child's own non-2xx answer, relayed with its status and body
ClientGone                 the client left mid-response (a ConnectionResetError)
"""

from __future__ import annotations

from typing import Any

import orjson


def error_body(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def status_type(status: int) -> str:
    """The OpenAI error type of an HTTP status the proxy has no more specific error for."""
    return "invalid_request_error" if status < 500 else "server_error"


class ProxyError(Exception):
    status = 500
    type_ = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return orjson.dumps(error_body(self.message, self.type_, self.param, self.code))


class InvalidRequest(ProxyError):
    status = 400
    type_ = "invalid_request_error"


class RequestTimeout(ProxyError):
    status = 408
    type_ = "invalid_request_error"


class BodyTooLarge(ProxyError):
    status = 413
    type_ = "invalid_request_error"


class UnsupportedEncoding(ProxyError):
    status = 415
    type_ = "invalid_request_error"


class Overloaded(ProxyError):
    status = 429
    type_ = "rate_limit_error"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ClientLimited(Overloaded):
    """One client's children at its cap (``clients.max_children``): OpenAI's own code for a
    rate limit, so that clients back off as they would from OpenAI."""

    code = "rate_limit_exceeded"


class UpstreamUnavailable(ProxyError):
    status = 502
    type_ = "server_error"


class UpstreamTimeout(ProxyError):
    status = 504
    type_ = "server_error"


class ChildFailed(Exception):
    """A child answered with a non-2xx status before streaming (docs/behaviour.md#errors)."""

    def __init__(self, status: int, body: bytes, content_type: str | None) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


class ClientGone(ConnectionResetError):
    """The client left: its connection is closed or closing. Raised only where a response is
    written to the client (``proxy.request.sink``, and the head of a pass-through); callers catch
    ``ConnectionError``, as for a reset from the socket itself."""

    def __init__(self) -> None:
        super().__init__("the client left")
