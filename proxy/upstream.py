"""The one owner of the upstream connections: replicas, placement, retries, health checks,
DNS discovery, concurrency and timeouts.

Every byte sent upstream goes through ``UpstreamPool.send``: on the lean client
(``proxy.client``) for http replicas, on aiohttp's ``ClientSession`` for https ones, for health
checks, and for everything when ``lean=False`` (the seam). Client errors are mapped here to the
proxy's own errors (502 unreachable, 504 timeout). The replica state itself lives in
``proxy.replicas``; this module does its I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.client import BodyTooLong, ClientPool, Response, read_capped
from proxy.config import Config, Timeouts, Upstream
from proxy.errors import Overloaded, UpstreamTimeout, UpstreamUnavailable
from proxy.headers import rebased_headers
from proxy.log import log_event, logger
from proxy.metrics import Metrics
from proxy.replicas import Ejection, Placement, Replica, ReplicaSet, resolved_addresses
from proxy.retry import Backoff, Reason, RetryBudget, RetryPolicy, Verdict, parse_retry_after
from proxy.slots import Place, Slots

# (host, port) -> every address it resolves to now; tests inject their own.
Resolver = Callable[[str, int], Awaitable[list[str]]]
_DISCARD_LIMIT = 64 * 1024  # a retried answer's body up to this is read, keeping its connection
_RELAY_BUFFER = 32 * 1024  # a pass-through body: bytes read ahead of the client at most
Answer = aiohttp.ClientResponse | Response

WATCHDOG_INTERVAL = 5.0  # seconds between checks of every upstream's slot queue
WATCHDOG_PATIENCE = 300.0  # a head waiter that saw no slot freed for this long is reported


class UpstreamRequest(NamedTuple):
    """What one upstream request carries: the same on every try, so the same seed and id."""

    method: str
    path_qs: str
    headers: Mapping[str, str] | CIMultiDict[str]
    body: bytes | None
    decompress: bool = False  # undo a Content-Encoding of the answer (children parse it)
    read_bufsize: int | None = None  # bytes read ahead of the consumer


class Answered(NamedTuple):
    """An answer to relay, the replica it came from (its ``outstanding`` counts it until the
    exchange ends), and the fallback upstream's place in line when the fallback sent it."""

    response: Answer
    replica: Replica
    place: Place | None = None


@dataclass
class Trace:
    """When a request first went upstream, when its last upstream body ended (``perf_counter``
    seconds), how many retries."""

    sent_at: float | None = None
    done_at: float | None = None
    retries: int = 0


class _UpstreamState:
    def __init__(self, upstream: Upstream, metrics: Metrics) -> None:
        self.upstream = upstream
        self.slots = Slots(upstream.max_concurrency, upstream.max_queue)
        self.metrics = metrics
        placement = upstream.placement
        self.replicas = ReplicaSet(
            upstream.urls,
            Ejection(upstream.eject.failures, upstream.eject.seconds),
            Placement(placement.choose, None if placement.pack == "all" else placement.pack),
        )
        self.retry_on = frozenset(upstream.retry_on)
        backoff, budget = upstream.backoff, upstream.retry_budget
        self.retry = RetryPolicy(
            upstream.retries,
            self.retry_on,
            Backoff(backoff.base, backoff.cap),
            backoff.retry_after_cap,
            RetryBudget(budget.percent, budget.min_per_second, budget.window),
        )
        # Labelled children looked up once, not on every request.
        name = upstream.name
        self.in_flight = metrics.children_in_flight.labels(name)
        self.ttfb = metrics.upstream_ttfb.labels(name)
        self.duration = metrics.upstream_duration.labels(name)
        timeouts = upstream.timeouts
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.connect, sock_read=timeouts.first_byte
        )
        self.health_rounds = 0  # completed health checks of every replica
        # A fresh event per change, as the devserver does: waiters re-check their condition.
        self._changed = asyncio.Event()

    def failed(self, url: str) -> None:
        if self.replicas.failed(url, time.monotonic()):
            self.metrics.ejections.labels(self.upstream.name, url).inc()
            self.metrics.replica_up.labels(self.upstream.name, url).set(0)
            log_event("replica ejected", upstream=self.upstream.name, replica=url)
            self.notify()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Until ``predicate()`` holds after a health round, a discovery or an ejection."""
        async with asyncio.timeout(timeout):
            while not predicate():
                await self._changed.wait()

    def publish(self) -> None:
        """Each replica's ``n_proxy_replica_up``."""
        now = time.monotonic()
        for replica in self.replicas:
            up = 1 if replica.usable(now) else 0
            self.metrics.replica_up.labels(self.upstream.name, replica.url).set(up)


class UpstreamPool:
    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        resolver: Resolver | None = None,
        *,
        lean: bool = True,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.resolve = resolver or resolve
        self._states = {u.name: _UpstreamState(u, metrics) for u in config.upstreams}
        for state in self._states.values():
            state.publish()
        self._session: aiohttp.ClientSession | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.lean = lean  # the seam: False sends every request through the ClientSession
        self.client = ClientPool()
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # between tries

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=False)
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self._watchdog = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        await self.client.close()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "UpstreamPool.start() was not awaited"
        return self._session

    def state(self, upstream: Upstream) -> _UpstreamState:
        return self._states[upstream.name]

    def place(self, upstream: Upstream, count: int) -> list[str]:
        """Replica URLs for ``count`` children by the upstream's ``placement``, over the healthy
        replicas that are not ejected (SPEC §10)."""
        return self.state(upstream).replicas.place(count, time.monotonic())

    def join(self, upstream: Upstream, count: int) -> list[Place]:
        """Places in the upstream's FIFO line for ``count`` children; 429 on arrival when full."""
        try:
            return self.state(upstream).slots.join(count)
        except Overloaded:
            self.metrics.rejected.labels(upstream.name).inc()
            raise

    async def _watch(self) -> None:
        """Report queued children that the queue in front of them does not explain (#10)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL)
            for state in self._states.values():
                self.audit(state, loop.time())

    def audit(self, state: _UpstreamState, now: float) -> None:
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
        """Open one upstream request: ``async with pool.send(...) as reply``.

        Failures listed in ``retry_on`` are retried before the reply is given out: nothing of a
        retried answer can have reached the client (SPEC §10). The response is closed (never
        reused) if its body is left unread.
        """
        return Exchange(self, upstream, url, request, trace)

    async def _answer(
        self,
        state: _UpstreamState,
        url: str,
        request: UpstreamRequest,
        trace: Trace | None,
        fallback: bool = True,
    ) -> Answered:
        """The response to relay: up to ``retries`` further tries, each on another replica when
        there is one, with the same body and headers (so the same seed and request id), spaced
        by the backoff and within the retry budget (``proxy.retry``). When every try failed in
        a way ``retry_on`` lists, the fallback upstream is tried (not its own fallback).

        Each wait is a cancellation point that holds nothing: the failed try's connection and
        its replica's ``outstanding`` count are let go before it."""
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
            replica.outstanding += 1
            reason: Reason | None
            try:
                response = await self._open(replica, request, state.timeout, upstream.timeouts)
            except (TimeoutError, aiohttp.ClientError) as exc:
                replica.outstanding -= 1
                reason = failure_kind(exc)
                if reason is not None:
                    state.failed(replica.url)
                verdict = self._judge(state, replica, len(tried), reason, None, trace)
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
                verdict = self._judge(state, replica, len(tried), status, wait, trace)
                if verdict.outcome != "retry":
                    place = self._fallback_place(state, verdict) if fallback else None
                    if place is None:
                        return Answered(response, replica)
                    replica.outstanding -= 1
                    return await self._fall_back(state, place, request, trace, response)
                replica.outstanding -= 1
                await self._discard(response, upstream.timeouts.idle)
            await self.sleep(verdict.delay)
            replica = replicas.get(replicas.retry_to(tried, time.monotonic()))

    def _judge(
        self,
        state: _UpstreamState,
        replica: Replica,
        tries: int,
        reason: Reason | None,
        retry_after: float | None,
        trace: Trace | None,
    ) -> Verdict:
        """The retry policy's verdict on a failed try, counted and logged."""
        verdict = state.retry.decide(tries, reason, retry_after, time.monotonic())
        name = state.upstream.name
        if verdict.outcome == "retry":
            self.metrics.retries.labels(name, str(reason)).inc()
            if trace is not None:
                trace.retries += 1
            log_event(
                "upstream retry", upstream=name, replica=replica.url, reason=str(reason),
                retry=tries, delay_ms=round(verdict.delay * 1000, 1),
            )  # fmt: skip
        elif verdict.outcome == "budget":
            self.metrics.retries_refused.labels(name, str(reason)).inc()
            log_event(
                "retry budget exhausted", upstream=name, replica=replica.url, reason=str(reason)
            )
        return verdict

    def _fallback_place(self, state: _UpstreamState, verdict: Verdict) -> Place | None:
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
        state: _UpstreamState,
        place: Place,
        request: UpstreamRequest,
        trace: Trace | None,
        failed: Answer | None,
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
            answered = await self._answer(
                other, url, request._replace(headers=headers), trace, fallback=False
            )
        except BaseException:
            place.release()
            raise
        return answered._replace(place=place)

    async def _open(
        self,
        replica: Replica,
        request: UpstreamRequest,
        timeout: aiohttp.ClientTimeout,
        timeouts: Timeouts,
    ) -> Answer:
        """One HTTP request to one replica, up to its response headers."""
        method, path_qs, headers, body, decompress, read_bufsize = request
        headers = _with_host(headers, replica)
        if self.lean and replica.url.startswith("http:"):
            return await self.client.request(
                replica.url, method, path_qs, headers, body,
                connect=timeouts.connect, first_byte=timeouts.first_byte, idle=timeouts.idle,
                decompress=decompress, buffer=2 * (read_bufsize or _RELAY_BUFFER),
            )  # fmt: skip
        return await self.session.request(
            method,
            replica.url + path_qs,
            headers=headers,
            data=body,
            timeout=timeout,
            allow_redirects=False,
            auto_decompress=decompress,
            read_bufsize=read_bufsize,
            server_hostname=_tls_name(replica),
        )

    async def _discard(self, response: Answer, within: float) -> None:
        """Be done with an answer that is retried: a small body is read so its connection can be
        reused, anything else is closed."""
        try:
            length = response.content_length
            if length is not None and length <= _DISCARD_LIMIT:
                async with asyncio.timeout(within):
                    if isinstance(response, Response):
                        await response.read(_DISCARD_LIMIT)
                    else:
                        await response.read()
        except (TimeoutError, aiohttp.ClientError, BodyTooLong):
            pass
        finally:
            self._let_go(response)

    def _let_go(self, response: Answer) -> None:
        """A read answer's connection back to the pool; one left unread is closed, so the
        upstream stops generating into it."""
        if isinstance(response, Response):
            self.client.release(response)  # the lean pool tells read from unread itself
        elif response.content.at_eof():
            response.release()
        else:
            response.close()

    async def healthy(self, upstream: Upstream, timeout: float = 2.0) -> bool:
        """Check every replica (SPEC §10); the upstream is healthy when any replica is."""
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
            async with self.session.get(
                replica.url + upstream.health_path,
                headers=_with_host(upstream.headers, replica),
                timeout=aiohttp.ClientTimeout(total=timeout),
                allow_redirects=False,
                server_hostname=_tls_name(replica),
            ) as response:
                return response.status < 500
        except (TimeoutError, aiohttp.ClientError):
            return False

    def replica_health(self, upstream: Upstream) -> dict[str, bool]:
        """Each replica's URL and whether it takes children now."""
        now = time.monotonic()
        return {r.url: r.usable(now) for r in self.state(upstream).replicas}

    async def discover(self, upstream: Upstream) -> None:
        """Resolve each URL's host; its addresses become the replicas (``discovery.dns``).

        A failed lookup keeps the last known replicas of that URL.
        """
        state = self.state(upstream)
        for source in upstream.urls:
            parts = urlsplit(source)
            host = parts.hostname or ""
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                async with asyncio.timeout(upstream.discovery.interval):
                    ips = await self.resolve(host, port)
            except OSError as exc:  # TimeoutError and socket.gaierror among them
                log_event("dns lookup failed", upstream=upstream.name, host=host, error=str(exc))
                continue
            change = state.replicas.discovered(source, resolved_addresses(source, ips))
            for url in change.removed:
                for family in (self.metrics.replica_up, self.metrics.ejections):
                    with contextlib.suppress(KeyError):  # never set for this replica
                        family.remove(upstream.name, url)
            if change.added or change.removed:
                log_event(
                    "replicas changed",
                    upstream=upstream.name,
                    added=list(change.added),
                    removed=list(change.removed),
                )
        state.publish()
        state.notify()


async def resolve(host: str, port: int) -> list[str]:
    """Every A and AAAA address of ``host``, through the system resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def failure_kind(exc: BaseException) -> Literal["connect", "reset"] | None:
    """``connect``: the request never reached a server. ``reset``: the connection closed before
    a status line came back. Anything else (a timeout waiting for the answer) is neither."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return "connect"
    if isinstance(exc, TimeoutError):
        return None
    if isinstance(exc, aiohttp.ClientConnectionError):  # disconnected, reset, broken pipe
        return "reset"
    return None


def _with_host(
    headers: Mapping[str, str] | CIMultiDict[str], replica: Replica
) -> Mapping[str, str] | CIMultiDict[str]:
    """A replica found by DNS is reached by address and still sees the configured host name."""
    if replica.host is None:
        return headers
    out = CIMultiDict(headers)
    out["Host"] = replica.host
    return out


def _tls_name(replica: Replica) -> str | None:
    """An https replica reached by address still checks its certificate for the host name."""
    if replica.host is None or not replica.url.startswith("https:"):
        return None
    return urlsplit("//" + replica.host).hostname


class Exchange:
    """One upstream request, from sending it to the end of its body (``UpstreamPool.send``).

    A class, not an ``asynccontextmanager``: it is on every request's path, and a generator
    behind two awaits per request costs more than these few lines.
    """

    __slots__ = ("_answered", "_guard", "_pool", "_request", "_started", "_state", "_trace",
                 "_upstream", "_url")  # fmt: skip

    def __init__(
        self,
        pool: UpstreamPool,
        upstream: Upstream,
        url: str,
        request: UpstreamRequest,
        trace: Trace | None,
    ) -> None:
        self._pool = pool
        self._upstream = upstream
        self._state = pool.state(upstream)
        self._url = url
        self._request = request
        self._trace = trace
        self._started = 0.0
        self._answered: Answered | None = None
        self._guard: IdleGuard | None = None

    async def __aenter__(self) -> Reply:
        pool, state, upstream, trace = self._pool, self._state, self._upstream, self._trace
        # Durations on perf_counter, the clock of Trace and of the request log: uvloop's
        # loop.time() moves in whole milliseconds, coarser than most of what is measured here.
        self._started = started = time.perf_counter()
        if trace is not None and trace.sent_at is None:
            trace.sent_at = started
        state.in_flight.inc()
        try:
            answered = self._answered = await pool._answer(state, self._url, self._request, trace)
        except BaseException:
            self._ended(time.perf_counter())
            raise
        state.ttfb.observe(time.perf_counter() - started)
        response = answered.response
        max_bytes = pool.config.max_response_bytes
        if isinstance(response, Response):
            return Reply(response, response, upstream, max_bytes, response)
        _stop_read_timer(response)
        guard = self._guard = IdleGuard(response, upstream.timeouts.idle)
        return Reply(response, guard, upstream, max_bytes)

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if self._guard is not None:
                self._guard.close()
            if self._answered is not None:
                self._pool._let_go(self._answered.response)
        finally:
            self._ended(time.perf_counter())

    def _ended(self, ended: float) -> None:
        state, trace, answered = self._state, self._trace, self._answered
        if answered is not None:
            answered.replica.outstanding -= 1
            if answered.place is not None:
                answered.place.release()
        state.in_flight.dec()
        state.duration.observe(ended - self._started)
        if trace is not None:
            trace.done_at = ended if trace.done_at is None else max(trace.done_at, ended)


def upstream_error(exc: BaseException, upstream: Upstream) -> UpstreamTimeout | UpstreamUnavailable:
    """Map an aiohttp client failure to the proxy's own error (SPEC §7: 502 or 504)."""
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"upstream {upstream.name} timed out")
    return UpstreamUnavailable(f"upstream {upstream.name} failed: {type(exc).__name__}")


def _stop_read_timer(response: aiohttp.ClientResponse) -> None:
    """Hand the body's clock to ``IdleGuard``.

    aiohttp's own sock_read timer only knew the first-byte value, and it can run on while
    reading is paused for backpressure (a slow client is not a silent upstream).
    """
    connection = response.connection
    protocol = connection.protocol if connection is not None else None
    if protocol is not None:
        protocol.read_timeout = None
        protocol.start_timeout()  # with no timeout set, this cancels the running timer


class IdleGuard:
    """The body's bytes as they arrive; a timeout after ``idle`` seconds of waiting for any.

    Only time spent waiting on the upstream counts: while the consumer is busy elsewhere
    (blocked on a slow client), the clock is stopped.
    """

    def __init__(self, response: aiohttp.ClientResponse, idle: float) -> None:
        self._content = response.content
        self._idle = idle
        self._loop = asyncio.get_running_loop()
        self._waiting_since: float | None = None
        self._timer = self._loop.call_later(idle, self._check)

    def __aiter__(self) -> IdleGuard:
        return self

    async def __anext__(self) -> bytes:
        self._waiting_since = self._loop.time()
        try:
            chunk = await self._content.readany()
        finally:
            self._waiting_since = None
        if not chunk:
            raise StopAsyncIteration
        return chunk

    async def read(self, limit: int) -> bytes:
        return await read_capped(self, limit)

    def _check(self) -> None:
        since = self._waiting_since
        now = self._loop.time()
        if since is not None and now - since >= self._idle:
            self._content.set_exception(
                aiohttp.ServerTimeoutError(f"no data from upstream for {self._idle} s")
            )
            return
        start = since if since is not None else now
        self._timer = self._loop.call_at(start + self._idle, self._check)

    def close(self) -> None:
        self._timer.cancel()


class Head(Protocol):
    """What callers read of an upstream response's head (aiohttp's or the lean client's)."""

    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def headers(self) -> CIMultiDict[str] | CIMultiDictProxy[str]: ...
    @property
    def content_type(self) -> str: ...
    @property
    def content_length(self) -> int | None: ...


class Body(Protocol):
    def __aiter__(self) -> AsyncIterator[bytes]: ...
    async def read(self, limit: int) -> bytes: ...


@dataclass
class Reply:
    """An upstream response whose body is read through its idle guard.

    ``direct`` is set on the lean client: the body can then be relayed from the upstream
    protocol straight into a sink (``relay``), with no task or iterator per chunk.
    """

    response: Head
    body: Body
    upstream: Upstream
    max_bytes: int  # config.max_response_bytes: what ``read`` holds in memory at most
    direct: Response | None = None

    async def relay(
        self,
        sink: Callable[[bytes], None],
        paused: Callable[[], bool],
        drain: Callable[[], Awaitable[None]],
    ) -> None:
        """The body into ``sink`` as it arrives; failures stay aiohttp's client errors."""
        if self.direct is not None:
            await self.direct.relay(sink, paused, drain)
            return
        async for chunk in self.body:
            sink(chunk)
            if paused():
                await drain()

    async def read(self) -> bytes:
        """The whole body; a read that fails is the proxy's 502 or 504 (SPEC §7).

        Past ``max_bytes`` the read stops at once and the request fails with 502; leaving the
        body unread makes ``UpstreamPool.send`` drop the connection, so the upstream stops too.
        """
        length = self.response.content_length
        try:
            if length is not None and length > self.max_bytes:
                raise BodyTooLong(length)
            return await self.body.read(self.max_bytes)
        except BodyTooLong:
            raise UpstreamUnavailable(
                f"upstream {self.upstream.name} sent a body larger than {self.max_bytes} bytes"
            ) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise upstream_error(exc, self.upstream) from None
