"""What the proxy holds for one upstream (``UpstreamState``): its admission line (``Slots``), its
replicas (``ReplicaSet``), its retry policy and budget (``RetryPolicy``), and its count of
requests in flight. ``proxy.upstream.service`` does the I/O around it.

A reload builds a state for each upstream of the new config; one an earlier config named, and
whose requests may still run, hands it its line and replicas, so that every generation's
requests count against one ``max_concurrency`` (docs/operating.md#reload).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from proxy.config import Upstream
from proxy.observe import Metrics, log_event
from proxy.upstream.replicas import Ejection, Placement, ReplicaSet
from proxy.upstream.retry import Backoff, RetryBudget, RetryPolicy
from proxy.upstream.slots import Slots


class UpstreamState:
    """What the proxy holds for one upstream: replicas, slots, retry policy, requests in flight."""

    def __init__(
        self,
        upstream: Upstream,
        metrics: Metrics,
        max_response_bytes: int,
        earlier: UpstreamState | None = None,
    ) -> None:
        """``max_response_bytes``: the config's. ``earlier``: the same upstream's state in a
        config a reload replaced, still alive: its line (resized only at the hand-over,
        ``take_over``) and its replicas are this one's."""
        self.upstream = upstream
        # What every request reads of the config, as fields of this compiled class: a field of
        # a pydantic model is a Python attribute read through its __getattr__ hook.
        timeouts = upstream.timeouts
        self.connect_timeout: float = timeouts.connect
        self.first_byte_timeout: float = timeouts.first_byte
        self.idle_timeout: float = timeouts.idle
        self.max_response_bytes = max_response_bytes
        self.slots = Slots(upstream.max_concurrency, upstream.max_queue, grace(upstream))
        if earlier is not None:
            self.slots = earlier.slots
        self.fair = upstream.admission == "fair"  # each client's children in a line of its own
        self.metrics = metrics
        placement = upstream.placement
        self.replicas = ReplicaSet(
            upstream.urls,
            Ejection(upstream.eject.failures, upstream.eject.seconds),
            Placement(placement.choose, None if placement.pack == "all" else placement.pack),
        )
        if earlier is not None:
            self.replicas.carry(earlier.replicas, resolved=upstream.discovery.dns)
        # The state that publishes this upstream's replica health: this one while its config
        # is current; after a reload the new config's, or None when it names this upstream no
        # more (``Upstreams.take_over``).
        self.current: UpstreamState | None = self
        self.retry_on = frozenset(upstream.retry_on)
        backoff, budget = upstream.backoff, upstream.retry_budget
        self.retry = RetryPolicy(
            upstream.retries,
            self.retry_on,
            Backoff(backoff.base, backoff.cap),
            backoff.retry_after_cap,
            RetryBudget(budget.percent, budget.min_per_second, budget.window),
        )
        self.exchanges = 0  # upstream requests in flight, retries and backoff waits included
        self.health_rounds = 0  # completed health checks of every replica
        # A fresh event per change: every waiter wakes, re-checks its condition, and waits on the
        # new event if it still does not hold, so no change between two waits is missed.
        self._changed = asyncio.Event()

    def failed(self, url: str) -> None:
        if self.replicas.failed(url, time.monotonic()):
            self._count_ejection(url)
            log_event("replica ejected", "warning", upstream=self.upstream.name, replica=url)
            self.notify()

    def _count_ejection(self, url: str) -> None:
        """A replica is one object across generations: an old request's failure ejects it for
        the new config's requests too, and the new config counts it, if it has that replica."""
        current = self.current
        if current is None or current.replicas.get(url) is not self.replicas.get(url):
            return
        current.metrics.ejections.labels(self.upstream.name, url).inc()
        current.metrics.replica_up.labels(self.upstream.name, url).set(0)
        if current is not self:
            current.notify()

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


def grace(upstream: Upstream) -> float:
    """How long a returning client's slot is kept (``Slots.grace``): with fair admission only."""
    return upstream.return_grace if upstream.admission == "fair" else 0.0
