"""Client protocol errors: a request the HTTP parser refuses (a malformed request line, bad
headers or chunked framing, oversize headers, HTTP/0.9). The client's fault, not the proxy's:
each is counted by kind and logged in one short line at info (as nginx does), at most
``LINES_PER_SECOND`` a second; never a traceback or the client's bytes, so that a client
cannot grow the log faster than the lines it is allowed."""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp.http_exceptions import (
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)

from proxy.observe.log import Throttle, log_event
from proxy.observe.metrics import Metrics

LINES_PER_SECOND = 10
_REASON = 100  # characters of a parser message read for its kind: the parser's own words


def kind_of(exc: HttpProcessingError) -> str:
    """The part of the request the parser refused, one of ``PROTOCOL_ERROR_KINDS``. aiohttp's
    C parser raises a plain ``BadHttpMessage`` for several parts: llhttp's reason, before the
    client's bytes in its message, tells them apart."""
    if isinstance(exc, LineTooLong):
        return "too_long"
    if isinstance(exc, BadStatusLine | InvalidURLError):  # BadHttpMethod included
        return "request_line"
    if isinstance(exc, PayloadEncodingError):
        return "body"
    if isinstance(exc, InvalidHeader):
        return "header"
    reason = exc.message[:_REASON].partition(":")[0].lower()
    if "chunk" in reason:
        return "body"
    if "header" in reason or "content-length" in reason:
        return "header"
    return "other"


def lacks_version(line: bytes) -> bool:
    """``GET /path``, a request line with no HTTP version after its target: HTTP/0.9's, which
    the parser would take for the start of an HTTP/1 head and wait on for more lines."""
    method, space, target = line.removesuffix(b"\r").partition(b" ")
    return bool(space and target) and method.isalpha() and method.isupper() and b" " not in target


class ClientErrors:
    """The count and the log lines of one process's client protocol errors."""

    def __init__(self, metrics: Metrics) -> None:
        self._count = metrics.client_protocol_errors
        self._throttle = Throttle(LINES_PER_SECOND)
        self.clock: Callable[[], float] = time.monotonic  # the throttle's (tests set their own)

    def record(self, kind: str, error: str, remote: str | None) -> None:
        """``error``: the parser's exception class name, a word of aiohttp's, never the
        client's; ``remote``: the peer's address."""
        self._count.labels(kind).inc()
        dropped = self._throttle.admit(self.clock())
        if dropped is None:
            return
        fields: dict[str, object] = {"kind": kind, "error": error, "remote": remote}
        if dropped:
            fields["suppressed"] = dropped  # lines held back since the last one
        log_event("client protocol error", **fields)
