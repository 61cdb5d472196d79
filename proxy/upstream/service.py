"""The upstreams as a service: admission, replicas, placement, retries and fallback, health
checks, DNS discovery, concurrency and timeouts, around the one ``ConnectionPool`` that owns the
connections.

Every byte sent upstream, health checks included, goes through one ``ConnectionPool``
(``proxy.http.pool``), http and https alike; requests go through ``UpstreamPool.send``
(``proxy.upstream.exchange``). The replica state itself lives in ``proxy.upstream.replicas``;
this module does its I/O.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import NamedTuple

from multidict import CIMultiDict

from proxy.config.models import Config, Upstream
from proxy.core.errors import Overloaded
from proxy.core.headers import rebased_headers
from proxy.core.url import tls_name
from proxy.http import BodyTooLong, ConnectionPool, HTTPClientError, UpstreamResponse
from proxy.observe.log import log_event, logger
from proxy.observe.metrics import Metrics
from proxy.upstream.discovery import Resolver, discover, resolve
from proxy.upstream.exchange import (
    Answered,
    Exchange,
    Trace,
    UpstreamRequest,
    failure_kind,
    upstream_error,
)
from proxy.upstream.replicas import Replica
from proxy.upstream.retry import Reason, Verdict, parse_retry_after
from proxy.upstream.slots import Place
from proxy.upstream.state import UpstreamState

# (upstream name, any replica healthy, each replica's URL -> takes work) after a health round.
HealthReport = Callable[[str, bool, dict[str, bool]], None]
_DISCARD_LIMIT = 64 * 1024  # a retried answer's body up to this is read, keeping its connection
_DISCARD_SECONDS = 1.0  # ... if it comes this soon: a retry must not wait on a stalled body
_RELAY_BUFFER = 32 * 1024  # a pass-through body: bytes read ahead of the client at most

WATCHDOG_INTERVAL = 5.0  # seconds between checks of every upstream's slot queue
WATCHDOG_PATIENCE = 300.0  # a head waiter that saw no slot freed for this long is reported


class Ticket(NamedTuple):
    """One admitted request: the replica it goes to, and its place in the upstream's line
    (``async with ticket.place`` waits for the slot and gives it back)."""

    url: str
    place: Place


class UpstreamPool:
    def __init__(self, config: Config, metrics: Metrics, resolver: Resolver | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.resolve = resolver or resolve
        self._states = {u.name: UpstreamState(u, metrics) for u in config.upstreams}
        for state in self._states.values():
            state.publish()
        self._loops: list[asyncio.Task[None]] = []
        self.connections = ConnectionPool()
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # between tries

    async def start(self, report: HealthReport | None = None) -> None:
        """The pool's own loops: the slot watchdog, each upstream's health checks (results to
        ``report``) and, where configured, its DNS discovery. ``close`` ends them."""
        loops = [self._watch()]
        loops += [self._check_health(u, report) for u in self.config.upstreams]
        loops += [self._discover(u) for u in self.config.upstreams if u.discovery.dns]
        self._loops = [asyncio.create_task(loop) for loop in loops]

    async def close(self) -> None:
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        await self.connections.close()

    async def _check_health(self, upstream: Upstream, report: HealthReport | None) -> None:
        """Every replica of ``upstream`` each ``health_interval`` (docs/behaviour.md#failover)."""
        while True:
            healthy = await self.healthy(upstream)
            if report is not None:
                report(upstream.name, healthy, self.replica_health(upstream))
            await asyncio.sleep(upstream.health_interval)

    async def _discover(self, upstream: Upstream) -> None:
        while True:
            await self.discover(upstream)
            await asyncio.sleep(upstream.discovery.interval)

    def state(self, upstream: Upstream) -> UpstreamState:
        return self._states[upstream.name]

    def admit(self, upstream: Upstream, count: int) -> list[Ticket]:
        """``count`` requests into the upstream, in one step: a place each in its FIFO line (429
        on arrival when the line is full), then a replica each by its ``placement``, over the
        healthy replicas that are not ejected (docs/behaviour.md#admission, #failover)."""
        state = self.state(upstream)
        try:
            places = state.slots.join(count)
        except Overloaded:
            self.metrics.rejected.labels(upstream.name).inc()
            raise
        urls = state.replicas.place(count, time.monotonic())
        return [Ticket(url, place) for url, place in zip(urls, places, strict=True)]

    async def _watch(self) -> None:
        """Report queued children that the queue in front of them does not explain: a slot leak
        would otherwise only show as requests that never end."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL)
            for state in self._states.values():
                self.audit(state, loop.time())

    def audit(self, state: UpstreamState, now: float) -> None:
        stall = state.slots.audit(now, WATCHDOG_PATIENCE)
        if stall is None:
            return
        self.metrics.slot_stalls.labels(state.upstream.name).inc()
        fields = {
            "upstream": state.upstream.name, "reason": stall.reason,
            "waited_s": round(stall.waited, 1), "in_use": stall.in_use,
            "capacity": state.slots.capacity, "queued": stall.queued,
        }  # fmt: skip
        logger.warning("slot watchdog", extra={"fields": fields})
        state.slots.repair()

    def send(
        self, upstream: Upstream, url: str, request: UpstreamRequest, trace: Trace | None = None
    ) -> Exchange:
        """Open one upstream request: ``async with pool.send(...) as answer``.

        Failures listed in ``retry_on`` are retried before the answer is given out: nothing of a
        retried answer can have reached the client (docs/behaviour.md#failover). The response is
        closed (never reused) if its body is left unread.
        """
        state = self.state(upstream)
        return Exchange(
            functools.partial(self.open_response, state, url, request, trace),
            self.connections.release,
            state.timings,
            upstream,
            self.config.max_response_bytes,
            trace,
        )

    async def open_response(
        self,
        state: UpstreamState,
        url: str,
        request: UpstreamRequest,
        trace: Trace | None,
        fallback: bool = True,
    ) -> Answered:
        """The response to relay: up to ``retries`` further tries, each on another replica when
        there is one, with the same body and headers (so the same seed and request id), spaced
        by the backoff and within the retry budget (``proxy.upstream.retry``). When every try
        failed in a way ``retry_on`` lists, the fallback upstream is tried (not its own fallback).

        Each wait is a cancellation point that holds nothing: the failed try's connection and
        its replica's ``outstanding`` count are let go before it. A retry is counted, logged
        and spent from the budget only once its wait is over and it goes out."""
        upstream = state.upstream
        replicas = state.replicas
        tried: list[str] = []
        replica = replicas.get(url)
        state.retry.budget.requested(time.monotonic())
        while True:
            if replica is None:  # discovery dropped it since placement: a current one instead
                replica = replicas.get(replicas.retry_to(tried, time.monotonic()))
                assert replica is not None
            tried.append(replica.url)
            if trace is not None:
                trace.replica = replica.url
            replica.outstanding += 1
            reason: Reason | None
            failed: UpstreamResponse | None = None
            try:
                response = await self._open(replica, request, upstream)
            except (TimeoutError, HTTPClientError) as exc:
                replica.outstanding -= 1
                reason = failure_kind(exc)
                if reason is not None:
                    state.failed(replica.url)
                verdict = self._judge(state, replica, len(tried), reason, None)
                if verdict.outcome != "retry":
                    place = self._fallback_place(state, verdict) if fallback else None
                    if place is None:
                        raise upstream_error(exc, upstream) from None
                    return await self._fall_back(state, place, request, trace, None)
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
                    return Answered(response, replica)
                reason = status
                header = response.headers.get("Retry-After")
                wait = None if header is None else parse_retry_after(header, time.time())
                verdict = self._judge(state, replica, len(tried), status, wait)
                if verdict.outcome != "retry":
                    place = self._fallback_place(state, verdict) if fallback else None
                    if place is None:
                        return Answered(response, replica)
                    replica.outstanding -= 1
                    return await self._fall_back(state, place, request, trace, response)
                replica.outstanding -= 1
                failed = response
            await self._wait_to_retry(state, verdict, failed)
            # The wait is over and the retry goes out: only now is it counted and logged.
            self.metrics.retries.labels(upstream.name, str(reason)).inc()
            if trace is not None:
                trace.retries += 1
            log_event(
                "upstream retry", upstream=upstream.name, replica=replica.url, reason=str(reason),
                retry=len(tried), delay_ms=round(verdict.delay * 1000, 1),
            )  # fmt: skip
            replica = replicas.get(replicas.retry_to(tried, time.monotonic()))

    def _judge(
        self,
        state: UpstreamState,
        replica: Replica,
        tries: int,
        reason: Reason | None,
        retry_after: float | None,
    ) -> Verdict:
        """The retry policy's verdict on a failed try; a refusal by the budget counted."""
        verdict = state.retry.decide(tries, reason, retry_after, time.monotonic())
        if verdict.outcome == "budget":
            name = state.upstream.name
            self.metrics.retries_refused.labels(name, str(reason)).inc()
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
                await self._discard(failed, state.upstream.timeouts.idle)
            await self.sleep(verdict.delay)
        except BaseException:
            state.retry.unsent(verdict)
            raise

    def _fallback_place(self, state: UpstreamState, verdict: Verdict) -> Place | None:
        """A place in the fallback upstream's line, when it has one and is to be tried."""
        name = state.upstream.fallback
        if name is None or not verdict.falls_back:
            return None
        try:
            (place,) = self._states[name].slots.join(1)
        except Overloaded:
            self.metrics.rejected.labels(name).inc()
            return None  # its line is full: the failure here stands
        return place

    async def _fall_back(
        self,
        state: UpstreamState,
        place: Place,
        request: UpstreamRequest,
        trace: Trace | None,
        failed: UpstreamResponse | None,
    ) -> Answered:
        """The request through the fallback upstream, within its ``max_concurrency`` and with
        its configured headers instead of this one's; ``failed``, a retried status answer, is
        let go first."""
        assert state.upstream.fallback is not None  # _fallback_place gave a place
        other = self._states[state.upstream.fallback]
        try:
            if failed is not None:
                await self._discard(failed, state.upstream.timeouts.idle)
            await place.wait()
            self.metrics.fallbacks.labels(state.upstream.name, other.upstream.name).inc()
            log_event("upstream fallback", upstream=state.upstream.name, to=other.upstream.name)
            (url,) = other.replicas.place(1, time.monotonic())
            headers = rebased_headers(
                request.headers, state.upstream.headers, other.upstream.headers
            )
            answered = await self.open_response(
                other, url, request._replace(headers=headers), trace, fallback=False
            )
        except BaseException:
            place.release()
            raise
        return answered._replace(place=place)

    async def _open(
        self, replica: Replica, request: UpstreamRequest, upstream: Upstream
    ) -> UpstreamResponse:
        """One HTTP request to one replica, up to its response headers."""
        method, path_qs, headers, body, inflate, read_bufsize = request
        timeouts = upstream.timeouts
        return await self.connections.request(
            replica.url, method, path_qs, _with_host(headers, replica), body,
            connect=timeouts.connect, first_byte=timeouts.first_byte, idle=timeouts.idle,
            inflate=inflate, buffer=2 * (read_bufsize or _RELAY_BUFFER),
            tls_name=tls_name(replica.url, replica.host),
        )  # fmt: skip

    async def _discard(self, response: UpstreamResponse, within: float) -> None:
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
            self.connections.release(response)

    async def healthy(self, upstream: Upstream, timeout: float = 2.0) -> bool:
        """Check every replica (docs/behaviour.md#failover); the upstream is healthy when any
        replica is."""
        state = self.state(upstream)
        replicas = list(state.replicas)
        results = await asyncio.gather(*(self._check(upstream, r, timeout) for r in replicas))
        for replica, ok in zip(replicas, results, strict=True):
            if replica.healthy != ok:
                log_event("replica health", upstream=upstream.name, replica=replica.url, ok=ok)
            state.replicas.checked(replica.url, ok)
        state.health_rounds += 1
        state.publish()
        state.notify()
        return any(results)

    async def _check(self, upstream: Upstream, replica: Replica, timeout: float) -> bool:
        """A replica passes when its health path answers without a 5xx."""
        try:
            async with asyncio.timeout(timeout):
                response = await self.connections.request(
                    replica.url, "GET", upstream.health_path,
                    _with_host(upstream.headers, replica), None,
                    connect=timeout, first_byte=timeout, idle=timeout,
                    tls_name=tls_name(replica.url, replica.host),
                )  # fmt: skip
                status = response.status
                await self._discard(response, timeout)
                return status < 500
        except (TimeoutError, HTTPClientError):
            return False

    def replica_health(self, upstream: Upstream) -> dict[str, bool]:
        """Each replica's URL and whether it takes children now."""
        now = time.monotonic()
        return {r.url: r.usable(now) for r in self.state(upstream).replicas}

    async def discover(self, upstream: Upstream) -> None:
        """Each URL's host resolved again; its addresses become the replicas
        (docs/behaviour.md#failover)."""
        await discover(self.state(upstream), self.resolve, self.metrics)


def _with_host(
    headers: Mapping[str, str] | CIMultiDict[str], replica: Replica
) -> Mapping[str, str] | CIMultiDict[str]:
    """A replica found by DNS is reached by address and still sees the configured host name."""
    if replica.host is None:
        return headers
    out = CIMultiDict(headers)
    out["Host"] = replica.host
    return out
