"""The one owner of the upstream ``ClientSession``: replicas, placement, concurrency and timeouts.

Every byte sent upstream goes through ``UpstreamPool.send``; aiohttp client errors are mapped here
to the proxy's own errors (502 unreachable, 504 timeout).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from multidict import CIMultiDict

from proxy.config import Config, Upstream
from proxy.errors import Overloaded, UpstreamTimeout, UpstreamUnavailable
from proxy.metrics import Metrics


class Slots:
    """A FIFO weighted semaphore: a request takes a slot per child, all at once.

    Taking them all at once matters: children that hold slots while waiting for siblings that
    cannot get one would deadlock two large streaming requests against each other.
    """

    def __init__(self, capacity: int, max_queue: int) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        self.in_use = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self, weight: int) -> int:
        weight = min(weight, self.capacity)
        if not self._waiters and self.in_use + weight <= self.capacity:
            self.in_use += weight
            return weight
        if len(self._waiters) >= self.max_queue:
            raise Overloaded("upstream is at its concurrency limit; retry shortly", retry_after=1)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (weight, future)
        self._waiters.append(entry)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.release(weight)  # granted just as we were cancelled: hand it back
            else:
                self._waiters.remove(entry)
                self._wake()
            raise
        return weight

    def release(self, weight: int) -> None:
        self.in_use -= weight
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_use + self._waiters[0][0] <= self.capacity:
            weight, future = self._waiters.popleft()
            self.in_use += weight
            future.set_result(None)


@dataclass
class Trace:
    """When a request first went upstream and when its last upstream body ended."""

    sent_at: float | None = None
    done_at: float | None = None


@dataclass
class _UpstreamState:
    upstream: Upstream
    slots: Slots
    metrics: Metrics
    turn: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        # Labelled children looked up once, not on every request.
        name = self.upstream.name
        self.in_flight = self.metrics.children_in_flight.labels(name)
        self.ttfb = self.metrics.upstream_ttfb.labels(name)
        self.duration = self.metrics.upstream_duration.labels(name)
        timeouts = self.upstream.timeouts
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.connect, sock_read=timeouts.first_byte
        )


class UpstreamPool:
    def __init__(self, config: Config, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self._states = {
            u.name: _UpstreamState(u, Slots(u.max_concurrency, u.max_queue), metrics)
            for u in config.upstreams
        }
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=False)
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "UpstreamPool.start() was not awaited"
        return self._session

    def state(self, upstream: Upstream) -> _UpstreamState:
        return self._states[upstream.name]

    def place(self, upstream: Upstream, count: int) -> list[str]:
        """Replica URLs for ``count`` children: round-robin (spread) or one replica (pack)."""
        urls = upstream.urls
        start = next(self.state(upstream).turn)
        if upstream.placement == "pack":
            return [urls[start % len(urls)]] * count
        return [urls[(start + j) % len(urls)] for j in range(count)]

    @asynccontextmanager
    async def slots(self, upstream: Upstream, count: int) -> AsyncIterator[None]:
        slots = self.state(upstream).slots
        try:
            taken = await slots.acquire(count)
        except Overloaded:
            self.metrics.rejected.labels(upstream.name).inc()
            raise
        try:
            yield
        finally:
            slots.release(taken)

    @asynccontextmanager
    async def send(
        self,
        upstream: Upstream,
        base_url: str,
        method: str,
        path_qs: str,
        headers: Mapping[str, str] | CIMultiDict[str],
        body: bytes | None,
        *,
        decompress: bool,
        trace: Trace | None = None,
        read_bufsize: int | None = None,
    ) -> AsyncIterator[Reply]:
        """Open one upstream request; the response is closed (never reused) if left unread."""
        timeouts = upstream.timeouts
        state = self.state(upstream)
        in_flight = state.in_flight
        loop = asyncio.get_running_loop()
        started = loop.time()
        if trace is not None and trace.sent_at is None:
            trace.sent_at = started
        in_flight.inc()
        try:
            try:
                response = await self.session.request(
                    method,
                    base_url + path_qs,
                    headers=headers,
                    data=body,
                    timeout=state.timeout,
                    allow_redirects=False,
                    auto_decompress=decompress,
                    read_bufsize=read_bufsize,
                )
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise upstream_error(exc, upstream) from None
            state.ttfb.observe(loop.time() - started)
            _stop_read_timer(response)
            guard = IdleGuard(response, timeouts.idle)
            try:
                yield Reply(response, guard, upstream)
            finally:
                guard.close()
                if response.content.at_eof():
                    response.release()
                else:
                    response.close()  # an abandoned body: drop the connection so generation stops
        finally:
            in_flight.dec()
            ended = loop.time()
            state.duration.observe(ended - started)
            if trace is not None:
                trace.done_at = ended if trace.done_at is None else max(trace.done_at, ended)

    async def healthy(self, upstream: Upstream, timeout: float = 2.0) -> bool:
        """An upstream is healthy when any replica answers its health path without a 5xx."""
        for url in upstream.urls:
            try:
                async with self.session.get(
                    url + upstream.health_path,
                    headers=upstream.headers,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                    allow_redirects=False,
                ) as response:
                    if response.status < 500:
                        return True
            except (TimeoutError, aiohttp.ClientError):
                continue
        return False


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

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

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


@dataclass
class Reply:
    """An upstream response whose body is read through its idle guard."""

    response: aiohttp.ClientResponse
    body: IdleGuard
    upstream: Upstream

    async def read(self) -> bytes:
        """The whole body; a read that fails is the proxy's 502 or 504 (SPEC §7)."""
        try:
            return await self.body.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise upstream_error(exc, self.upstream) from None
