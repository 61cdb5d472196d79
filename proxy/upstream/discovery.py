"""DNS discovery (``discovery.dns``): every address behind a configured host name becomes a
replica; a failed lookup keeps the last known ones (docs/behaviour.md#failover)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable

from proxy.core import parse_origin
from proxy.observe import Metrics, log_event
from proxy.upstream.replicas import resolved_addresses
from proxy.upstream.state import UpstreamState

# (host, port) -> every address it resolves to now; tests inject their own.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def discover(state: UpstreamState, resolve: Resolver, metrics: Metrics) -> None:
    """Resolve each of the upstream's URLs; its addresses replace that URL's replicas."""
    upstream = state.upstream
    for source in upstream.urls:
        origin = parse_origin(source)
        host, port = origin.host, origin.port
        try:
            async with asyncio.timeout(upstream.discovery.interval):
                ips = await resolve(host, port)
        except OSError as exc:  # TimeoutError and socket.gaierror among them
            log_event("dns lookup failed", upstream=upstream.name, host=host, error=str(exc))
            continue
        change = state.replicas.discovered(source, resolved_addresses(source, ips))
        for url in change.removed:
            for family in (metrics.replica_up, metrics.ejections):
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
