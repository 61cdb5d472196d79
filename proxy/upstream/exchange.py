"""One upstream request from sending it to the end of its body, and what it gives its caller.

``Exchange`` (opened by ``UpstreamPool.send``) times the request and lets its connection go at
the end; ``Answer`` is the response with the reads callers need; upstream client failures are
mapped here to the proxy's own errors (docs/behaviour.md#errors: 502 unreachable, 504 timeout).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

from multidict import CIMultiDict
from prometheus_client import Gauge, Histogram

from proxy.config.models import Upstream
from proxy.core.errors import UpstreamTimeout, UpstreamUnavailable
from proxy.http import (
    BodyTooLong,
    ClientClosed,
    ConnectFailed,
    Disconnected,
    HTTPClientError,
    UpstreamResponse,
)
from proxy.upstream.replicas import Replica
from proxy.upstream.slots import Place


class UpstreamRequest(NamedTuple):
    """What one upstream request carries: the same on every try, so the same seed and id."""

    method: str
    path_qs: str
    headers: Mapping[str, str] | CIMultiDict[str]
    body: bytes | None
    inflate: bool = False  # undo a gzip or deflate Content-Encoding (children parse the body)
    read_bufsize: int | None = None  # bytes read ahead of the consumer


class Answered(NamedTuple):
    """An answer to relay, the replica it came from (its ``outstanding`` counts it until the
    exchange ends), and the fallback upstream's place in line when the fallback sent it."""

    response: UpstreamResponse
    replica: Replica
    place: Place | None = None


@dataclass
class Trace:
    """When a request first went upstream, when its last upstream body ended (``perf_counter``
    seconds), how many retries, and the replica of the last try."""

    sent_at: float | None = None
    done_at: float | None = None
    retries: int = 0
    replica: str | None = None


@dataclass(frozen=True, slots=True)
class Timings:
    """One upstream's labelled metrics of its exchanges, looked up once."""

    in_flight: Gauge
    ttfb: Histogram
    duration: Histogram


class Exchange:
    """One upstream request, from sending it to the end of its body (``UpstreamPool.send``).

    A class, not an ``asynccontextmanager``: it is on every request's path, and a generator
    behind two awaits per request costs more than these few lines.
    """

    __slots__ = ("_answer", "_answered", "_max_bytes", "_release", "_started", "_timings",
                 "_trace", "_upstream")  # fmt: skip

    def __init__(
        self,
        answer: Callable[[], Awaitable[Answered]],  # the response, retries done
        release: Callable[[UpstreamResponse], None],  # read: pooled; unread: closed
        timings: Timings,
        upstream: Upstream,
        max_bytes: int,
        trace: Trace | None,
    ) -> None:
        self._answer = answer
        self._release = release
        self._timings = timings
        self._upstream = upstream
        self._max_bytes = max_bytes
        self._trace = trace
        self._started = 0.0
        self._answered: Answered | None = None

    async def __aenter__(self) -> Answer:
        timings, trace = self._timings, self._trace
        # Durations on perf_counter, the clock of Trace and of the request log: uvloop's
        # loop.time() moves in whole milliseconds, coarser than most of what is measured here.
        self._started = started = time.perf_counter()
        if trace is not None and trace.sent_at is None:
            trace.sent_at = started
        timings.in_flight.inc()
        try:
            answered = self._answered = await self._answer()
        except BaseException:
            self._ended(time.perf_counter())
            raise
        timings.ttfb.observe(time.perf_counter() - started)
        return Answer(answered.response, self._upstream, self._max_bytes)

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if self._answered is not None:
                # Read to its end: back to the pool. Left unread: closed, so the upstream stops.
                self._release(self._answered.response)
        finally:
            self._ended(time.perf_counter())

    def _ended(self, ended: float) -> None:
        timings, trace, answered = self._timings, self._trace, self._answered
        if answered is not None:
            answered.replica.outstanding -= 1
            if answered.place is not None:
                answered.place.release()
        timings.in_flight.dec()
        timings.duration.observe(ended - self._started)
        if trace is not None:
            trace.done_at = ended if trace.done_at is None else max(trace.done_at, ended)


@dataclass
class Answer:
    """An upstream response as its caller reads it: the head, then the body whole or relayed."""

    response: UpstreamResponse
    upstream: Upstream
    max_bytes: int  # config.max_response_bytes: what ``read`` holds in memory at most

    async def relay(
        self,
        sink: Callable[[bytes], None],
        paused: Callable[[], bool],
        drain: Callable[[], Awaitable[None]],
    ) -> None:
        """The body into ``sink`` as it arrives, from the upstream protocol itself (no task or
        iterator per chunk); failures stay the upstream client's (``proxy.http.errors``)."""
        await self.response.relay(sink, paused, drain)

    async def read(self) -> bytes:
        """The whole body; a read that fails is the proxy's 502 or 504 (docs/behaviour.md#errors).

        Past ``max_bytes`` the read stops at once and the request fails with 502; leaving the
        body unread makes ``UpstreamPool.send`` drop the connection, so the upstream stops too.
        """
        length = self.response.content_length
        try:
            if length is not None and length > self.max_bytes:
                raise BodyTooLong(length)
            return await self.response.read(self.max_bytes)
        except BodyTooLong:
            raise UpstreamUnavailable(
                f"upstream {self.upstream.name} sent a body larger than {self.max_bytes} bytes"
            ) from None
        except (TimeoutError, HTTPClientError) as exc:
            raise upstream_error(exc, self.upstream) from None


def upstream_error(exc: BaseException, upstream: Upstream) -> UpstreamTimeout | UpstreamUnavailable:
    """Map an upstream client failure to the proxy's own error (docs/behaviour.md#errors: 502
    or 504)."""
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"upstream {upstream.name} timed out")
    return UpstreamUnavailable(f"upstream {upstream.name} failed: {type(exc).__name__}")


def failure_kind(exc: BaseException) -> Literal["connect", "reset"] | None:
    """``connect``: the request never reached a server (its connect timing out included).
    ``reset``: the connection closed before a status line came back, or the client was closed
    under it. Anything else (a timeout waiting for the answer, a malformed answer) is neither."""
    match exc:
        case ConnectFailed():
            return "connect"
        case Disconnected() | ClientClosed():
            return "reset"
    return None
