"""One upstream's state, pure but for the futures its line parks on: the admission line to
its ``max_concurrency`` (``Slots``), its replicas and where each request goes (``ReplicaSet``),
its retry policy and budget (``RetryPolicy``), and ``UpstreamState``, which holds them with its
count of requests in flight. ``proxy.upstream.service`` does the I/O around it; callers pass the
time in.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

from proxy.config.models import Upstream
from proxy.core.errors import Overloaded
from proxy.core.url import at_address, authority, tls_name
from proxy.observe.log import log_event
from proxy.observe.metrics import Metrics

# ---- admission
#
# Admission to an upstream's ``max_concurrency``: one slot per child, granted FIFO
# (docs/behaviour.md#admission).
#
# A request is refused (429) only on arrival, when every slot is taken and ``max_queue`` children
# already wait; the children of an admitted request are never refused later. A waiter that is
# cancelled at any moment is skipped, never granted, and a grant that races a cancellation is
# handed back: ``in_use`` always equals the number of places held.


PlaceState = Literal["waiting", "held", "gone"]


class Place:
    """One child's place in line: waiting for a slot, holding one, or gone (released)."""

    __slots__ = ("_future", "_slots", "ahead", "frees_before", "queued_at", "state")

    def __init__(self, slots: Slots, state: PlaceState, ahead: int, frees_before: int) -> None:
        self._slots = slots
        self._future: asyncio.Future[None] | None = None
        self.state: PlaceState = state
        self.ahead = ahead  # live waiters in front of this one when it joined the queue
        self.frees_before = frees_before  # the slots' free count when it joined
        self.queued_at = asyncio.get_running_loop().time()

    async def wait(self) -> None:
        """Until the slot is granted; on cancellation the place is released, whatever happened."""
        if self.state == "held":
            return
        if self.state == "gone":
            raise RuntimeError("this place was released")
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
        try:
            await self._future
        except BaseException:
            self.release()  # a grant that raced the cancellation goes back too
            raise

    def release(self) -> None:
        """Give the slot back, or leave the queue; a second call does nothing."""
        self._slots._release(self)

    async def __aenter__(self) -> Place:
        await self.wait()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


@dataclass(frozen=True)
class Stall:
    """What the watchdog found: a waiter the queue in front of it does not explain."""

    reason: str
    waited: float  # seconds the oldest waiter has waited
    in_use: int
    queued: int


class Slots:
    """A FIFO semaphore counted in children."""

    def __init__(self, capacity: int, max_queue: int) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        self.in_use = 0
        self.frees = 0  # slots given back so far: each one grants the oldest live waiter
        self._queued = 0  # live waiters; the deque may also hold released ones, skipped lazily
        self._line: deque[Place] = deque()

    @property
    def queued(self) -> int:
        return self._queued

    def join(self, count: int) -> list[Place]:
        """Places for ``count`` children in FIFO order, the first ones granted while slots are free.

        Raises ``Overloaded`` when no slot is free and ``max_queue`` children already wait.
        """
        if self.in_use >= self.capacity and self._queued >= self.max_queue:
            raise Overloaded("upstream is at its concurrency limit; retry shortly", retry_after=1)
        places = []
        for _ in range(count):
            if self.in_use < self.capacity and not self._queued:
                self.in_use += 1
                places.append(Place(self, "held", 0, self.frees))
            else:
                place = Place(self, "waiting", self._queued, self.frees)
                self._line.append(place)
                self._queued += 1
                places.append(place)
        return places

    def _release(self, place: Place) -> None:
        if place.state == "held":
            place.state = "gone"
            self.in_use -= 1
            self.frees += 1
            self._wake()
        elif place.state == "waiting":
            place.state = "gone"
            self._queued -= 1
            future = place._future
            if future is not None and not future.done():
                future.cancel()
            if len(self._line) > 2 * self._queued + 64:
                self._line = deque(p for p in self._line if p.state == "waiting")

    def _wake(self) -> None:
        while self._line and self.in_use < self.capacity:
            place = self._line.popleft()
            if place.state != "waiting":
                continue  # released while it waited: skipped, never granted
            future = place._future
            if future is not None and future.cancelled():
                # Its task was cancelled but has not run its handler yet: that handler's
                # release finds the place gone.
                place.state = "gone"
                self._queued -= 1
                continue
            place.state = "held"
            self._queued -= 1
            self.in_use += 1
            if future is not None:
                future.set_result(None)

    def audit(self, now: float, patience: float) -> Stall | None:
        """The watchdog's check (``proxy.upstream.service``); None while the queue explains every
        wait.

        A waiter with ``ahead`` live waiters in front of it must be granted by the
        ``ahead + 1``-th slot freed after it joined; a free slot with waiters is a stall too.
        ``patience``: also report a head waiter that waited that long with no slot freed.
        """
        head = next((p for p in self._line if p.state == "waiting"), None)
        if head is None:
            return None
        waited = now - head.queued_at
        if self.in_use < self.capacity:
            reason = "a slot is free while children wait"
        elif self.frees - head.frees_before > head.ahead:
            reason = f"{self.frees - head.frees_before} slots freed, {head.ahead} waiters ahead"
        elif patience and waited >= patience and self.frees == head.frees_before:
            reason = f"no slot freed in {waited:.0f} s"
        else:
            return None
        return Stall(reason, waited, self.in_use, self._queued)

    def repair(self) -> None:
        """Grant what a free slot allows (the watchdog's remedy for the first kind of stall)."""
        self._wake()


# ---- replicas
#
# The replica set of one upstream: which replicas exist, which may take children, and where
# each child and each retry goes (docs/behaviour.md#failover). Pure: the caller passes the time
# in; no I/O.
#
# A replica is usable when its last health check passed and it is not ejected. Placement and
# retries use usable replicas only; when none is usable, every replica is tried (fail open).
# Load is the proxy's own count of requests in flight on each replica (``outstanding``).


@dataclass(frozen=True)
class Address:
    """Where a replica is reached: ``url`` to connect to, ``host`` for its Host header.

    ``host`` is set when ``url`` holds a resolved address, so the server still sees the name
    it was configured under (virtual hosts, TLS names); None keeps the URL's own.
    """

    url: str
    host: str | None = None


@dataclass(eq=False)
class Replica:
    url: str
    host: str | None = None
    healthy: bool = True  # optimistic until the first check: a fresh proxy serves at once
    failures: int = 0  # consecutive, since the last success
    ejected_until: float = -math.inf
    outstanding: int = 0  # upstream requests in flight there, from this proxy
    # The name an https replica reached by address checks its certificate for: known at once,
    # so no request parses the URL again.
    tls_name: str | None = field(init=False)

    def __post_init__(self) -> None:
        self.tls_name = tls_name(self.url, self.host)

    def usable(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until


@dataclass(frozen=True)
class Ejection:
    failures: int = 3  # consecutive failures that eject a replica; 0 never ejects
    seconds: float = 10.0


@dataclass(frozen=True)
class Placement:
    """Where a request's children go: in groups of ``pack`` (None: all of them in one), each
    group to the next replica in turn (``round_robin``), or to the less busy of that one and
    one other drawn at random (``least_outstanding``: the power of two choices).

    At equal load, ``least_outstanding`` places exactly as ``round_robin`` does.
    """

    choose: Literal["round_robin", "least_outstanding"] = "round_robin"
    pack: int | None = 1


@dataclass(frozen=True)
class Change:
    """Replicas that entered and left the set in one update (for their metric labels)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


@dataclass
class ReplicaSet:
    """The replicas of one upstream, in a stable order, with their health and ejection state."""

    sources: Sequence[str]  # the configured URLs, each standing for one or more replicas
    ejection: Ejection = Ejection()
    placement: Placement = Placement()
    rng: random.Random = field(default_factory=random.Random)  # the second choice's draw
    _by_source: dict[str, tuple[Address, ...]] = field(init=False)
    _replicas: dict[str, Replica] = field(init=False)
    _turn: itertools.count[int] = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._by_source = {source: (Address(source),) for source in self.sources}
        self._replicas = {source: Replica(source) for source in self.sources}

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas.values()))

    @property
    def urls(self) -> list[str]:
        return list(self._replicas)

    def get(self, url: str) -> Replica | None:
        return self._replicas.get(url)

    def usable(self, now: float) -> list[Replica]:
        """The replicas that may take children now; all of them when none may (fail open)."""
        replicas = list(self._replicas.values())
        return [r for r in replicas if r.usable(now)] or replicas

    def place(self, count: int, now: float) -> list[str]:
        """Replica URLs for ``count`` children, over the usable replicas (see ``Placement``).

        Requests take turns: each starts its groups one replica further on. A group placed by
        this call counts as load for the next group's choice.
        """
        usable = self.usable(now)
        turn = next(self._turn)
        size = self.placement.pack or max(count, 1)
        if size == 1 and self.placement.choose == "round_robin":  # the default, kept lean
            return [usable[(turn + j) % len(usable)].url for j in range(count)]
        added = [0] * len(usable)
        out: list[str] = []
        for group, first in enumerate(range(0, count, size)):
            pos = self._choose(usable, turn + group, added)
            taken = min(size, count - first)
            added[pos] += taken
            out += [usable[pos].url] * taken
        return out

    def _choose(self, replicas: Sequence[Replica], turn: int, added: Sequence[int]) -> int:
        """The position of the replica whose turn it is, or of a random other one less busy."""
        mine = turn % len(replicas)
        if self.placement.choose == "round_robin" or len(replicas) == 1:
            return mine
        other = self.rng.randrange(len(replicas) - 1)
        other += other >= mine  # any position but mine
        if replicas[other].outstanding + added[other] < replicas[mine].outstanding + added[mine]:
            return other
        return mine

    def retry_to(self, tried: Sequence[str], now: float) -> str:
        """Where a retry goes: a usable replica not tried yet, else any usable one, else one not
        tried yet, else the last one tried that is still in the set (the only one there is).
        Within the first of these that has any, ``placement.choose`` picks.

        Always a replica of the set as it is now: discovery may have dropped those tried.
        """
        replicas = list(self._replicas.values())
        usable = [r for r in replicas if r.usable(now)]
        turn = next(self._turn)
        for group in (
            [r for r in usable if r.url not in tried],
            usable,
            [r for r in replicas if r.url not in tried],
        ):
            if group:
                return group[self._choose(group, turn, [0] * len(group))].url
        return next(url for url in reversed(tried) if url in self._replicas)

    def succeeded(self, url: str) -> None:
        replica = self._replicas.get(url)
        if replica is not None:
            replica.failures = 0

    def failed(self, url: str, now: float) -> bool:
        """Count a connect failure, reset or 5xx; True when it ejects the replica."""
        replica = self._replicas.get(url)
        if replica is None or now < replica.ejected_until:
            return False  # gone, or out already: late failures of its in-flight requests
        replica.failures += 1
        limit = self.ejection.failures
        if limit == 0 or replica.failures < limit:
            return False
        replica.failures = 0
        replica.ejected_until = now + self.ejection.seconds
        return True

    def checked(self, url: str, ok: bool) -> None:
        """A health check's result; a passing one ends an ejection at once
        (docs/behaviour.md#failover)."""
        replica = self._replicas.get(url)
        if replica is None:
            return
        replica.healthy = ok
        if ok:
            replica.failures = 0
            replica.ejected_until = -math.inf

    def discovered(self, source: str, addresses: Sequence[Address]) -> Change:
        """The addresses ``source`` resolves to now. An empty answer keeps the last known ones:
        a DNS hiccup must not take every replica away. Replicas that stay keep their state;
        requests in flight on a removed one finish, as they hold no reference the set needs."""
        if source not in self._by_source or not addresses:
            return Change()
        self._by_source[source] = tuple(dict.fromkeys(addresses))
        old = self._replicas
        new: dict[str, Replica] = {}
        for address in itertools.chain.from_iterable(self._by_source.values()):
            if address.url not in new:
                new[address.url] = old.get(address.url) or Replica(address.url, address.host)
        self._replicas = new
        return Change(
            added=tuple(url for url in new if url not in old),
            removed=tuple(url for url in old if url not in new),
        )


def resolved_addresses(url: str, ips: Iterable[str]) -> tuple[Address, ...]:
    """One address per IP behind ``url``'s host: the URL's scheme, port and path, the IP as host.

    The original host name (with its port, when the URL has one) becomes the Host header.
    """
    host = authority(url)
    return tuple(Address(at_address(url, ip), host) for ip in dict.fromkeys(ips))


# ---- retries
#
# When a failed upstream try is tried again, and after how long: backoff, ``Retry-After`` and
# the retry budget (docs/behaviour.md#failover). Pure: the caller passes the time and the random
# draw in; no I/O.


Reason = str | int  # "connect", "reset" or an HTTP status, as ``retry_on`` lists them


@dataclass(frozen=True)
class Backoff:
    """Retry ``r`` (1-based) waits a random time between half and all of
    ``min(cap, base * 2 ** (r - 1))``: exponential, and jittered so that the children of one
    request, failed together, do not come back together ("equal jitter"). Half is kept fixed
    so retries are always spaced, even on an unlucky draw."""

    base: float = 0.05
    cap: float = 2.0

    def delay(self, retry: int, draw: float) -> float:
        """``draw`` in [0, 1): the random part."""
        ceiling = min(self.cap, self.base * 2.0 ** min(retry - 1, 64))
        return ceiling / 2 + ceiling / 2 * draw


def parse_retry_after(value: str, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delay-seconds or an HTTP date (RFC 9110
    §10.2.3), ``now`` in Unix seconds. None when it is neither; a date in the past is 0."""
    value = value.strip()
    if value.isascii() and value.isdigit():  # "1e3", "-1", "inf" are not delay-seconds
        return float(value)
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if moment.tzinfo is None:  # asctime's form has no zone: HTTP dates are always GMT
        moment = moment.replace(tzinfo=datetime.UTC)
    return max(moment.timestamp() - now, 0.0)


class RetryBudget:
    """Retries allowed over a sliding ``window``: ``percent`` of the requests in it, and never
    fewer than ``min_per_second`` per second of it (Finagle's RetryBudget; Envoy's retry budget
    has the same two knobs over concurrent requests).

    The window is kept in ``slices`` buckets, so memory stays fixed whatever the rate.
    """

    def __init__(
        self, percent: float, min_per_second: float, window: float = 10.0, slices: int = 10
    ) -> None:
        self.ratio = percent / 100
        self.floor = min_per_second * window
        self._width = window / slices
        self._slices = slices
        self._stamp = [-1] * slices  # the slice number each bucket counts now
        self._requests = [0] * slices
        self._retries = [0] * slices

    def _bucket(self, now: float) -> int:
        number = int(now // self._width)
        pos = number % self._slices
        if self._stamp[pos] != number:
            self._stamp[pos] = number
            self._requests[pos] = 0
            self._retries[pos] = 0
        return pos

    def requested(self, now: float) -> None:
        """A first try: it earns the budget its share."""
        self._requests[self._bucket(now)] += 1

    def spend(self, now: float) -> bool:
        """Take one retry from the budget; False (nothing taken) when it is used up."""
        pos = self._bucket(now)
        oldest = self._stamp[pos] - self._slices
        requests = retries = 0
        for stamp, asked, retried in zip(self._stamp, self._requests, self._retries, strict=True):
            if stamp > oldest:
                requests += asked
                retries += retried
        if retries + 1 > self.floor + self.ratio * requests:
            return False
        self._retries[pos] += 1
        return True

    def refund(self, spent_at: float) -> None:
        """Give back the retry ``spend`` took at ``spent_at``: it was never sent. A slice that
        has left the window since holds nothing to give back."""
        number = int(spent_at // self._width)
        pos = number % self._slices
        if self._stamp[pos] == number and self._retries[pos] > 0:
            self._retries[pos] -= 1


Outcome = Literal["retry", "final", "spent", "budget", "too_long"]


@dataclass(frozen=True)
class Verdict:
    """What to do after a failed try. ``retry``: again after ``delay`` seconds. Otherwise the
    failure stands: ``final`` (not a failure ``retry_on`` lists), ``spent`` (``retries`` used),
    ``budget`` (the retry budget is used up), ``too_long`` (``Retry-After`` past its cap).
    Every outcome but ``final`` lets a fallback upstream take over."""

    outcome: Outcome
    delay: float = 0.0
    spent_at: float | None = None  # when a retry took its budget share (a connect one takes none)

    @property
    def falls_back(self) -> bool:
        return self.outcome not in ("retry", "final")


@dataclass
class RetryPolicy:
    """One upstream's retry rules and its budget, shared by every request to it."""

    retries: int
    retry_on: Collection[Reason]
    backoff: Backoff
    retry_after_cap: float
    budget: RetryBudget
    draw: Callable[[], float] = field(default=random.random)

    def decide(
        self, tries: int, reason: Reason | None, retry_after: float | None, now: float
    ) -> Verdict:
        """After ``tries`` failed tries, the last one for ``reason``; ``retry_after`` in seconds
        when that answer carried one.

        A ``connect`` failure takes nothing from the budget: the server never saw the request,
        so its retry adds no load (the budget is there against retry storms on busy servers).
        Any other retry takes its share now, so that tries failing together cannot all take
        the last one; ``unsent`` gives it back if the retry never goes out (its wait was
        cancelled: the client left, a sibling failed).
        """
        if reason is None or reason not in self.retry_on:
            return Verdict("final")
        if tries > self.retries:
            return Verdict("spent")
        if retry_after is not None and not retry_after <= self.retry_after_cap:
            return Verdict("too_long")
        spent_at = None
        if reason != "connect":
            if not self.budget.spend(now):
                return Verdict("budget")
            spent_at = now
        delay = self.backoff.delay(tries, self.draw())
        if retry_after is not None:
            delay = max(delay, retry_after)
        return Verdict("retry", delay, spent_at)

    def unsent(self, verdict: Verdict) -> None:
        """A ``retry`` verdict whose retry never went out: its budget share back."""
        if verdict.spent_at is not None:
            self.budget.refund(verdict.spent_at)


# ---- the whole of one upstream


class UpstreamState:
    """What the proxy holds for one upstream: replicas, slots, retry policy, requests in flight."""

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
        self.exchanges = 0  # upstream requests in flight, retries and backoff waits included
        self.health_rounds = 0  # completed health checks of every replica
        # A fresh event per change: every waiter wakes, re-checks its condition, and waits on the
        # new event if it still does not hold, so no change between two waits is missed.
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
