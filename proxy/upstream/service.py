"""The upstreams as a service: admission, replicas, placement, retries and fallback, health
checks, DNS discovery, concurrency and timeouts, around the one ``ConnectionPool`` that owns the
connections.

Every byte sent upstream, health checks included, goes through one ``ConnectionPool``
(``proxy.http.pool``), http and https alike. A request enters once per upstream request it
sends: ``Upstreams.admit`` gives each a place in line, and ``Upstreams.exchange`` is everything
after, from the wait for that place to the end of the body, reported step by step to the
request's record; upstream client failures become the proxy's own errors here (502 when
unreachable, 504 on a timeout). The upstreams' state lives in ``proxy.upstream.state``; this module
does its I/O.
"""

from __future__ import annotations

import asyncio
import fnmatch
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from multidict import CIMultiDict

from proxy.config import Config, Upstream
from proxy.core import Overloaded, rebased_headers
from proxy.http import (
    BodyTooLong,
    ConnectionPool,
    HTTPClientError,
    UpstreamResponse,
)
from proxy.observe import ChildRecord, Metrics, log_event, logger
from proxy.upstream.discovery import Resolver, discover, resolve
from proxy.upstream.exchange import (
    Answered,
    Exchange,
    Ticket,
    Tickets,
    UpstreamRequest,
    admission,
    failure_kind,
    upstream_error,
)
from proxy.upstream.replicas import Replica
from proxy.upstream.retry import Reason, Verdict, parse_retry_after
from proxy.upstream.slots import Place, Tabs
from proxy.upstream.state import UpstreamState
from proxy.upstream.succession import gone, hand_over, newest

_DISCARD_LIMIT = 64 * 1024  # a retried answer's body up to this is read, keeping its connection
_DISCARD_SECONDS = 1.0  # ... if it comes this soon: a retry must not wait on a stalled body
_RELAY_BUFFER = 32 * 1024  # a pass-through body: bytes read ahead of the client at most

WATCHDOG_INTERVAL = 5.0  # seconds between checks of every upstream's slot queue
WATCHDOG_PATIENCE = 300.0  # a head waiter that saw no slot freed for this long is reported


class Upstreams:
    """Every upstream of the config: which one a request goes to (``route``), its admission, its
    exchanges with retries and fallback, its health checks and DNS discovery (not "a pool":
    ``ConnectionPool`` is the connections').

    ``checked_health`` and ``checked_replicas`` hold each upstream's last health round, as
    ``/readyz`` shows it; ``health_checked`` is set once every upstream has had one."""

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        resolver: Resolver | None = None,
        earlier: Sequence[Upstreams] = (),
    ) -> None:
        """``earlier``: the upstreams of the configs this one is to replace whose requests may
        still run, newest first. An upstream one of them names takes over its line and replicas
        (``UpstreamState``); ``take_over`` is the hand-over itself."""
        self.config = config
        self.metrics = metrics
        self.resolve = resolver or resolve
        previous = newest(other._states for other in earlier)
        self._states: dict[str, UpstreamState] = {
            u.name: UpstreamState(u, metrics, previous.get(u.name)) for u in config.upstreams
        }
        for state in self._states.values():
            state.publish()
        self.loops: list[asyncio.Task[None]] = []
        self.connections = ConnectionPool()
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # between tries
        self.checked_health: dict[str, bool] = {}  # upstream name -> any replica passed
        self.checked_replicas: dict[str, dict[str, bool]] = {}  # name -> replica -> takes work
        self.health_checked = asyncio.Event()
        # Each route as (path prefix or None, model glob or None, its upstream), in config order.
        self._routes = [
            (r.path_prefix, r.model, config.upstream(r.upstream)) for r in config.routes
        ]
        self._default = config.upstream(config.default_upstream)
        self.routes_by_model = any(r.model is not None for r in config.routes)
        # GET /v1/models asks each of these and merges their lists, when there are several:
        # the default upstream first, then each upstream a route names, in config order.
        named = [config.default_upstream, *(r.upstream for r in config.routes)]
        self.model_lists = tuple(config.upstream(name) for name in dict.fromkeys(named))
        self._required = [u.name for u in config.upstreams if u.readiness == "required"]
        # Each client's places over every upstream (clients.max_children), one for every config.
        self.tabs: Tabs = earlier[0].tabs if earlier else Tabs()
        self._max_children = config.clients.max_children

    async def start(self) -> None:
        """The service's own loops: the slot watchdog, each upstream's health checks and, where
        configured, its DNS discovery. ``close`` ends them."""
        loops = [self._watch()]
        loops += [self._check_health(u) for u in self.config.upstreams]
        loops += [self._discover(u) for u in self.config.upstreams if u.discovery.dns]
        self.loops = [asyncio.create_task(loop) for loop in loops]

    async def close(self) -> None:
        self.stop()
        await asyncio.gather(*self.loops, return_exceptions=True)
        await self.connections.close()

    def stop(self) -> None:
        """The service's loops cancelled (``close`` awaits them); its requests carry on."""
        for loop in self.loops:
            loop.cancel()

    def take_over(self, earlier: Sequence[Upstreams]) -> None:
        """A reload's hand-over (docs/operating.md#reload): this config serves from now on in
        place of ``earlier`` (every one still alive, newest first), whose requests run on. Their
        loops stop: this one's check, discover, watch and publish what they share. Each line this
        config names takes its limits, so every generation's requests count against one
        ``max_concurrency`` per upstream; the series only they name go (``forget``)."""
        hand_over(self._states, [other._states for other in earlier])
        for other in earlier:
            other.stop()
            self.forget(other)

    def forget(self, other: Upstreams) -> None:
        """Remove the series of the upstreams and replicas ``other`` names and this does not."""
        self.metrics.forget(*gone(self._states, other._states))

    async def _check_health(self, upstream: Upstream) -> None:
        """Every replica of ``upstream`` each ``health_interval`` (docs/behaviour.md#failover)."""
        while True:
            self.checked_health[upstream.name] = await self.healthy(upstream)
            self.checked_replicas[upstream.name] = self.replica_health(upstream)
            if len(self.checked_health) == len(self.config.upstreams):
                self.health_checked.set()
            await asyncio.sleep(upstream.health_interval)

    @property
    def ready(self) -> bool:
        """Every upstream whose ``readiness`` is required passed its last health check; with
        none required, some upstream did."""
        if self._required:
            return all(self.checked_health.get(name, False) for name in self._required)
        return any(self.checked_health.values())

    def route(self, path: str, model: str | None) -> Upstream:
        """Where a request goes: the first route whose path prefix and model glob (case-sensitive)
        it matches, else the default upstream. Configuration alone decides, never the request's
        ``Host`` or an absolute URI: no open proxy."""
        for prefix, glob, upstream in self._routes:
            if prefix is not None and not path.startswith(prefix):
                continue
            if glob is not None and (model is None or not fnmatch.fnmatchcase(model, glob)):
                continue
            return upstream
        return self._default

    async def _discover(self, upstream: Upstream) -> None:
        while True:
            await self.discover(upstream)
            await asyncio.sleep(upstream.discovery.interval)

    def state(self, upstream: Upstream) -> UpstreamState:
        return self._states[upstream.name]

    def admit(self, upstream: Upstream, count: int, client: str = "") -> Tickets:
        """``count`` requests of ``client`` (its id) into the upstream, in one step: a place each
        in the client's line (429 on arrival when the client is at ``clients.max_children`` or
        the upstream's line is full), then a replica each by its ``placement``, over the healthy
        replicas that are not ejected (docs/behaviour.md#admission, #failover)."""
        cap = self._max_children
        tab = self.tabs.tab(client) if cap else None  # counted only for a cap
        return admission(self._states[upstream.name], count, client, tab, cap, self.metrics)

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

    def exchange(self, ticket: Ticket, request: UpstreamRequest, child: ChildRecord) -> Exchange:
        """One upstream request, once its place is granted: ``async with`` it (``Exchange``).

        Failures listed in ``retry_on`` are retried before the answer is given out: nothing of a
        retried answer can have reached the client (docs/behaviour.md#failover). The response is
        closed (never reused) if its body is left unread.
        """
        return Exchange(self, ticket, request, child)

    async def _answer(
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
            child.sent(replica.url, request.headers)
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
                    place = self._fallback_place(state, verdict, client) if fallback else None
                    if place is None:
                        raise upstream_error(exc, upstream) from None
                    return await self._fall_back(state, place, request, child, None)
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
                wait = None if header is None else parse_retry_after(header, time.time())
                verdict = self._judge(state, replica, len(tried), status, wait)
                if verdict.outcome != "retry":
                    place = self._fallback_place(state, verdict, client) if fallback else None
                    if place is None:
                        return response, replica, None
                    replica.outstanding -= 1
                    return await self._fall_back(state, place, request, child, response)
                replica.outstanding -= 1
                failed = response
            await self._wait_to_retry(state, verdict, failed)
            # The wait is over and the retry goes out: only now is it counted and logged.
            child.retry(str(reason))
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
            self.metrics.rejected.labels(name).inc()
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
                await self._discard(failed, state.upstream.timeouts.idle)
            await place.wait()
            self.metrics.fallbacks.labels(state.upstream.name, other.upstream.name).inc()
            log_event("upstream fallback", upstream=state.upstream.name, to=other.upstream.name)
            (url,) = other.replicas.place(1, time.monotonic())
            headers = rebased_headers(
                request.headers, state.upstream.headers, other.upstream.headers
            )
            response, replica, _ = await self._answer(
                other, url, request.with_headers(headers), child, fallback=False
            )
        except BaseException:
            place.release()
            raise
        return response, replica, place

    def _open(
        self, replica: Replica, request: UpstreamRequest, upstream: Upstream
    ) -> Awaitable[UpstreamResponse]:
        """One HTTP request to one replica, up to its response headers. Not a coroutine itself:
        the caller awaits the pool's, one coroutine fewer a request."""
        timeouts = upstream.timeouts
        return self.connections.request(
            replica.url, request.method, request.path_qs, _with_host(request.headers, replica),
            request.body, connect=timeouts.connect, first_byte=timeouts.first_byte,
            idle=timeouts.idle, inflate=request.inflate,
            buffer=2 * (request.read_bufsize or _RELAY_BUFFER),
            tls_name=replica.tls_name,
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
                log_event(
                    "replica health",
                    "info" if ok else "warning",
                    upstream=upstream.name,
                    replica=replica.url,
                    ok=ok,
                )
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
                    tls_name=replica.tls_name,
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
