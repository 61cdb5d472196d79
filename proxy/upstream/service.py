"""The upstreams as a service: admission, replicas, placement, health checks, DNS discovery,
concurrency and timeouts, around the one ``ConnectionPool`` that owns the connections; retries
and fallback are its ``tries`` (``proxy.upstream.tries``, compiled).

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
import time
from collections.abc import Awaitable, Callable, Sequence

from proxy.config import Config, Upstream
from proxy.http import (
    ConnectionPool,
    HTTPClientError,
)
from proxy.observe import Metrics, log_event, logger
from proxy.upstream.discovery import Resolver, discover, resolve
from proxy.upstream.exchange import (
    Front,
)
from proxy.upstream.replicas import Replica
from proxy.upstream.slots import Tabs
from proxy.upstream.state import UpstreamState
from proxy.upstream.succession import gone, hand_over, newest
from proxy.upstream.tries import Tries, with_host

WATCHDOG_INTERVAL = 5.0  # seconds between checks of every upstream's slot queue
WATCHDOG_PATIENCE = 300.0  # a head waiter that saw no slot freed for this long is reported


class Upstreams(Front):
    """Every upstream of the config: which one a request goes to (``route``), its admission, its
    exchanges with retries and fallback, its health checks and DNS discovery (not "a pool":
    ``ConnectionPool`` is the connections').

    ``checked_health`` and ``checked_replicas`` hold each upstream's last health round, as
    ``/readyz`` shows it; ``health_checked`` is set once every upstream has had one."""

    tries: Tries  # Front's, made here: its exchanges' tries, and the discard of what they leave

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
        previous = newest(other._states for other in earlier)
        states = {
            u.name: UpstreamState(u, metrics, config.max_response_bytes, previous.get(u.name))
            for u in config.upstreams
        }
        # Each client's places over every upstream (clients.max_children), one for every config.
        tabs = earlier[0].tabs if earlier else Tabs()
        super().__init__(config, metrics, states, ConnectionPool(), tabs)
        self.resolve = resolver or resolve
        for state in self._states.values():
            state.publish()
        self.loops: list[asyncio.Task[None]] = []
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # between tries
        self.tries = Tries(self, self._states, self.connections, metrics)
        self.checked_health: dict[str, bool] = {}  # upstream name -> any replica passed
        self.checked_replicas: dict[str, dict[str, bool]] = {}  # name -> replica -> takes work
        self.health_checked = asyncio.Event()
        self.routes_by_model = any(r.model is not None for r in config.routes)
        # GET /v1/models asks each of these and merges their lists, when there are several:
        # the default upstream first, then each upstream a route names, in config order.
        named = [config.default_upstream, *(r.upstream for r in config.routes)]
        self.model_lists = tuple(config.upstream(name) for name in dict.fromkeys(named))
        self._required = [u.name for u in config.upstreams if u.readiness == "required"]

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

    async def _discover(self, upstream: Upstream) -> None:
        while True:
            await self.discover(upstream)
            await asyncio.sleep(upstream.discovery.interval)

    def state(self, upstream: Upstream) -> UpstreamState:
        return self._states[upstream.name]

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
                    with_host(upstream.headers, replica), None,
                    connect=timeout, first_byte=timeout, idle=timeout,
                    tls_name=replica.tls_name,
                )  # fmt: skip
                status = response.status
                await self.tries.discard(response, timeout)
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
