"""What one proxy holds right now, counted where it is held: requests and fan-out children in
flight, upstream slots held and queued, places counted against their clients, each replica's
outstanding requests, upstream requests in flight and pooled connections checked out.
``/metrics`` exports it; all of it is 0 when idle.
``proxy.server.app.take_census`` takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

# The census's process-wide counts as /metrics gauges (per upstream: queue depth, slots in use,
# each replica's outstanding; children in flight is counted live, as upstream requests start).
GAUGES = {
    "n_proxy_requests_in_flight": "Client requests being handled now.",
    "n_proxy_fanout_children": "Fan-out children running now: queued for a slot, upstream, or "
    "unwinding after a cancellation.",
    "n_proxy_upstream_connections_in_use": "Upstream connections checked out of the pool now, "
    "health checks included.",
    "n_proxy_upstream_connections_idle": "Upstream connections kept alive in the pool for reuse.",
}


@dataclass(frozen=True, slots=True)
class UpstreamCensus:
    name: str
    slots_held: int
    queued: int  # children waiting for a slot
    exchanges: int  # upstream requests in flight, retries and backoff waits included
    outstanding: dict[str, int]  # replica URL -> its requests in flight from this proxy


@dataclass(frozen=True, slots=True)
class Census:
    requests: int  # handlers running
    children: int  # fan-out children started and not ended (queued, upstream or unwinding)
    streams: int  # fan-out streams a drain could cut
    connections: int  # upstream connections checked out of the pool (health checks included)
    idle: int  # pooled for reuse: open, holding nothing (not part of ``held``)
    upstreams: tuple[UpstreamCensus, ...]
    tabs: int = 0  # places counted against their clients (``clients.max_children``)

    def gauges(self) -> dict[str, int]:
        """The values of ``GAUGES``."""
        return {
            "n_proxy_requests_in_flight": self.requests,
            "n_proxy_fanout_children": self.children,
            "n_proxy_upstream_connections_in_use": self.connections,
            "n_proxy_upstream_connections_idle": self.idle,
        }

    def held(self) -> list[str]:
        """What is held, in words; empty when the proxy holds nothing."""
        out = [
            f"{count} {what}"
            for count, what in (
                (self.requests, "requests in flight"),
                (self.children, "fan-out children running"),
                (self.streams, "fan-out streams open"),
                (self.connections, "upstream connections checked out"),
            )
            if count
        ]
        for upstream in self.upstreams:
            name = upstream.name
            for count, what in (
                (upstream.slots_held, "slots held"),
                (upstream.queued, "children queued"),
                (upstream.exchanges, "upstream requests in flight"),
            ):
                if count:
                    out.append(f"upstream {name}: {count} {what}")
            for url, count in upstream.outstanding.items():
                if count:
                    out.append(f"upstream {name}: replica {url} has {count} outstanding")
        if self.tabs:
            out.append(f"{self.tabs} places counted against their clients")
        return out
