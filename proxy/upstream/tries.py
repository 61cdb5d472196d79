"""The tries of one upstream request (docs/behaviour.md#failover): the first, the retries the
policy allows, each on another replica when there is one, and the fallback upstream's. Compiled:
every request's exchange goes through ``Tries.answer``, while ``proxy.upstream.service`` (whose
methods tests patch) stays Python.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, Protocol

from multidict import CIMultiDict

from proxy.core import Overloaded, rebased_headers
from proxy.http import BodyTooLong, ConnectionPool, HTTPClientError, UpstreamResponse
from proxy.observe import ChildRecord, Metrics, log_event
from proxy.upstream.exchange import Answered, UpstreamRequest, failure_kind, upstream_error
from proxy.upstream.replicas import Replica
from proxy.upstream.retry import Reason, Verdict, parse_retry_after
from proxy.upstream.slots import Place
from proxy.upstream.state import UpstreamState

# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_monotonic: Final = time.monotonic
_time: Final = time.time

_DISCARD_LIMIT = 64 * 1024  # a retried answer's body up to this is read, keeping its connection
_DISCARD_SECONDS = 1.0  # ... if it comes this soon: a retry must not wait on a stalled body
_RELAY_BUFFER: Final = 32 * 1024  # a pass-through body: bytes read ahead of the client at most


class Sleeper(Protocol):
    """Whose ``sleep`` spaces the tries (``Upstreams.sleep``; tests set their own)."""

    sleep: Callable[[float], Awaitable[None]]


class Tries:
    """An upstream request's tries, for every upstream of one config (``Upstreams.tries``)."""

    def __init__(
        self,
        clock: Sleeper,
        states: Mapping[str, UpstreamState],
        connections: ConnectionPool,
        metrics: Metrics,
    ) -> None:
        self._clock = clock
        self._states = states
        self._connections = connections
        self._metrics = metrics

    async def answer(
        self,
        state: UpstreamState,
        url: str,
        request: UpstreamRequest,
        child: ChildRecord,
        fallback: bool = True,
        client: str = "",
    ) -> Answered:
        """The response to relay: up to ``retries`` further tries, each on another replica when
        there is one, with the same body and headers (so the same seed and request id), spaced
        by the backoff and within the retry budget (``RetryPolicy``). When every try failed in a
        way ``retry_on`` lists, the fallback upstream is tried (not its own fallback), the child
        waiting there in ``client``'s line.

        Each wait is a cancellation point that holds nothing: the failed try's connection and
        its replica's ``outstanding`` count are let go before it. A retry is counted, logged
        and spent from the budget only once its wait is over and it goes out. No wait is inside
        an exception handler (docs/architecture.md#working-on-a-compiled-module)."""
        upstream = state.upstream
        replicas = state.replicas
        tried: list[str] = []
        replica = replicas.get(url)
        state.retry.budget.requested(_monotonic())
        while True:
            if replica is None:  # discovery dropped it since placement: a current one instead
                replica = replicas.get(replicas.retry_to(tried, _monotonic()))
                assert replica is not None
            tried.append(replica.url)
            child.sent(replica.url, request.headers)
            replica.outstanding += 1
            reason: Reason | None
            failed: UpstreamResponse | None = None
            place: Place | None = None
            try:
                response = await self._open(replica, request, state)
            except (TimeoutError, HTTPClientError) as exc:
                replica.outstanding -= 1
                reason = failure_kind(exc)
                if reason is not None:
                    state.failed(replica.url)
                verdict = self._judge(state, replica, len(tried), reason, None)
                if verdict.outcome != "retry":
                    place = self._fallback_place(state, verdict, client) if fallback else None
                    if place is None:
                        raise upstream_error(exc, upstream) from None
            except BaseException:
                replica.outstanding -= 1
                raise
            else:
                status = response.status
                if status >= 500:
                    state.failed(replica.url)
                else:
                    replicas.succeeded(replica.url)
                if status not in state.retry_on:
                    return response, replica, None
                reason = status
                header = response.headers.get("Retry-After")
                wait = None if header is None else parse_retry_after(header, _time())
                verdict = self._judge(state, replica, len(tried), status, wait)
                if verdict.outcome != "retry":
                    place = self._fallback_place(state, verdict, client) if fallback else None
                    if place is None:
                        return response, replica, None
                replica.outstanding -= 1
                failed = response
            if place is not None:  # every try failed: the fallback's turn
                return await self._fall_back(state, place, request, child, failed)
            await self._wait_to_retry(state, verdict, failed)
            # The wait is over and the retry goes out: only now is it counted and logged.
            child.retry(str(reason))
            log_event(
                "upstream retry", upstream=upstream.name, replica=replica.url, reason=str(reason),
                retry=len(tried), delay_ms=round(verdict.delay * 1000, 1),
            )  # fmt: skip
            replica = replicas.get(replicas.retry_to(tried, _monotonic()))

    def _judge(
        self,
        state: UpstreamState,
        replica: Replica,
        tries: int,
        reason: Reason | None,
        retry_after: float | None,
    ) -> Verdict:
        """The retry policy's verdict on a failed try; a refusal by the budget counted."""
        verdict = state.retry.decide(tries, reason, retry_after, _monotonic())
        if verdict.outcome == "budget":
            name = state.upstream.name
            self._metrics.retries_refused.labels(name, str(reason)).inc()
            log_event(
                "retry budget exhausted", upstream=name, replica=replica.url, reason=str(reason)
            )
        return verdict

    async def _wait_to_retry(
        self, state: UpstreamState, verdict: Verdict, failed: UpstreamResponse | None
    ) -> None:
        """Between a failed try and its retry: the failed answer let go, then the backoff.
        Cancelled here (the client left, a sibling failed), the retry never goes out: its
        budget share goes back, and nothing counts it."""
        try:
            if failed is not None:
                await self.discard(failed, state.idle_timeout)
            await self._clock.sleep(verdict.delay)
        except BaseException:
            state.retry.unsent(verdict)
            raise

    def _fallback_place(self, state: UpstreamState, verdict: Verdict, client: str) -> Place | None:
        """A place in the fallback upstream's line, when it has one and is to be tried: in the
        client's line there, not counted against it again (its place here still counts)."""
        name = state.upstream.fallback
        if name is None or not verdict.falls_back:
            return None
        other = self._states[name]
        try:
            (place,) = other.slots.join(1, client if other.fair else None)
        except Overloaded:
            self._metrics.rejected.labels(name).inc()
            return None  # its line is full: the failure here stands
        return place

    async def _fall_back(
        self,
        state: UpstreamState,
        place: Place,
        request: UpstreamRequest,
        child: ChildRecord,
        failed: UpstreamResponse | None,
    ) -> Answered:
        """The request through the fallback upstream, within its ``max_concurrency`` and with
        its configured headers instead of this one's; ``failed``, a retried status answer, is
        let go first."""
        assert state.upstream.fallback is not None  # _fallback_place gave a place
        other = self._states[state.upstream.fallback]
        try:
            if failed is not None:
                await self.discard(failed, state.idle_timeout)
            await place.wait()
            self._metrics.fallbacks.labels(state.upstream.name, other.upstream.name).inc()
            log_event("upstream fallback", upstream=state.upstream.name, to=other.upstream.name)
            (url,) = other.replicas.place(1, _monotonic())
            headers = rebased_headers(
                request.headers, state.upstream.headers, other.upstream.headers
            )
            response, replica, _ = await self.answer(
                other, url, request.with_headers(headers), child, fallback=False
            )
        except BaseException:
            place.release()
            raise
        return response, replica, place

    def _open(
        self, replica: Replica, request: UpstreamRequest, state: UpstreamState
    ) -> Awaitable[UpstreamResponse]:
        """One HTTP request to one replica, up to its response headers. Not a coroutine itself:
        the caller awaits the pool's, one coroutine fewer a request."""
        return self._connections.request(
            replica.url, request.method, request.path_qs, with_host(request.headers, replica),
            request.body, connect=state.connect_timeout, first_byte=state.first_byte_timeout,
            idle=state.idle_timeout, inflate=request.inflate,
            buffer=2 * (request.read_bufsize or _RELAY_BUFFER), tls_name=replica.tls_name,
        )  # fmt: skip

    async def discard(self, response: UpstreamResponse, within: float) -> None:
        """Be done with an answer not relayed: a small body that comes within ``within`` and
        ``_DISCARD_SECONDS`` is read so its connection can be reused; anything else is closed.
        The request waits on this (a retry, a fallback, with its slot held), so never for as
        long as ``timeouts.idle``."""
        try:
            length = response.content_length
            if length is not None and length <= _DISCARD_LIMIT:
                async with asyncio.timeout(min(within, _DISCARD_SECONDS)):
                    await response.read(_DISCARD_LIMIT)
        except (TimeoutError, HTTPClientError, BodyTooLong):
            pass
        finally:
            self._connections.release(response)


def with_host(
    headers: Mapping[str, str] | CIMultiDict[str], replica: Replica
) -> Mapping[str, str] | CIMultiDict[str]:
    """A replica found by DNS is reached by address and still sees the configured host name."""
    if replica.host is None:
        return headers
    out = CIMultiDict(headers)
    out["Host"] = replica.host
    return out
