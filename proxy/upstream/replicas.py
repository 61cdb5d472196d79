"""The replica set of one upstream: which replicas exist, which may take children, and where
each child and each retry goes (docs/behaviour.md#failover). Pure: the caller passes the time
in; no I/O.

A replica is usable when its last health check passed and it is not ejected. Placement and
retries use usable replicas only; when none is usable, every replica is tried (fail open).
Load is the proxy's own count of requests in flight on each replica (``outstanding``).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from proxy.core import at_address, authority, tls_name


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

    def carry(self, earlier: ReplicaSet, resolved: bool) -> None:
        """Take over the replicas of ``earlier``, the same upstream in a config a reload replaced
        (docs/operating.md#reload): a replica at a URL both sets have is the same replica, its
        health, ejection and requests in flight kept. With ``resolved`` (this set is discovered
        by DNS too), the addresses ``earlier`` found for a source both have are this set's until
        its own discovery answers. A URL new to this set starts fresh."""
        if resolved:
            for source in self.sources:
                self._by_source[source] = earlier._by_source.get(source, self._by_source[source])
        replicas: dict[str, Replica] = {}
        for address in itertools.chain.from_iterable(self._by_source.values()):
            if address.url not in replicas:
                replica = earlier.get(address.url) or Replica(address.url, address.host)
                replicas[address.url] = replica
        self._replicas = replicas

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
