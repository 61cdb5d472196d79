"""How the upstream HTTP client fails: its own small tree, so its callers catch one base class and
tell apart only what they act on (``retry_on``'s ``connect`` and ``reset``, a 502 against a 504)::

    HTTPClientError        any failure of one request through the client
    ├── ConnectFailed      never reached a server: refused, unreachable, TLS failure (an OSError)
    │   └── ConnectTimeout the connect, or its wait in line to connect, ran out (a TimeoutError)
    ├── Disconnected       the connection closed before a complete response head: a reset
    ├── BadResponse        body cut short, malformed response, head over its cap, undecodable coding
    ├── ResponseTimeout    no head within ``first_byte``, no data within ``idle`` (a TimeoutError)
    └── ClientClosed       the pool was closed (an OSError)
    BodyTooLong            not a failure of the exchange: a body past what its reader holds

Every ``TimeoutError`` here is also an ``OSError`` (as the builtin is).
"""

from __future__ import annotations


class HTTPClientError(Exception):
    """A request through the upstream client failed."""


class ConnectFailed(HTTPClientError, OSError):
    """The request never reached a server: nothing of it was sent."""


class ConnectTimeout(ConnectFailed, TimeoutError):
    """The connect did not complete in time (the wait in line for a connect turn included)."""


class Disconnected(HTTPClientError):
    """The server closed the connection before a complete response head came back."""


class BadResponse(HTTPClientError):
    """The response broke HTTP/1.1, was cut short, or its ``Content-Encoding`` cannot be undone."""


class ResponseTimeout(HTTPClientError, TimeoutError):
    """The server was silent too long: before the head (``first_byte``), or mid-body (``idle``)."""


class ClientClosed(HTTPClientError, OSError):
    """The pool was closed: no request goes out any more."""


class BodyTooLong(Exception):
    """A body grew past the bytes the caller holds for one response."""
