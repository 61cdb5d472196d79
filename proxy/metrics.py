"""Prometheus metrics of one proxy instance (its own registry, so tests can run several)."""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

# Set by ``--workers``: every worker writes its values there and /metrics adds them up.
MULTIPROCESS = "PROMETHEUS_MULTIPROC_DIR" in os.environ

_LATENCY = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)


class Metrics:
    def __init__(self) -> None:
        self._answered: dict[tuple[str, int, bool], Any] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "n_proxy_requests",
            "Requests answered, by route, status and whether they were fanned out.",
            ["route", "status", "fanned_out"],
            registry=r,
        )
        self.n = Histogram(
            "n_proxy_request_n",
            "The n of fanned-out requests (choices per prompt, or best_of).",
            buckets=(2, 3, 4, 5, 8, 10, 16, 32, 64, 128),
            registry=r,
        )
        self.children_in_flight = Gauge(
            "n_proxy_children_in_flight",
            "Upstream requests in flight, per upstream.",
            ["upstream"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.upstream_ttfb = Histogram(
            "n_proxy_upstream_ttfb_seconds",
            "Time from sending an upstream request to its response headers.",
            ["upstream"],
            buckets=_LATENCY,
            registry=r,
        )
        self.upstream_duration = Histogram(
            "n_proxy_upstream_duration_seconds",
            "Time from sending an upstream request to the end of its body.",
            ["upstream"],
            buckets=_LATENCY,
            registry=r,
        )
        self.overhead = Histogram(
            "n_proxy_overhead_seconds",
            "Time the proxy itself spends on a request: before its first upstream request and "
            "after its last upstream byte.",
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1),
            registry=r,
        )
        self.stitched_chunks = Counter(
            "n_proxy_stitched_chunks", "SSE chunks written by fan-out streams.", registry=r
        )
        self.children_aborted = Counter(
            "n_proxy_children_aborted",
            "Children cancelled before they finished (a sibling failed or the client left).",
            ["upstream"],
            registry=r,
        )
        self.rejected = Counter(
            "n_proxy_rejected",
            "Requests refused with 429 because an upstream's queue was full.",
            ["upstream"],
            registry=r,
        )
        self.client_connections = Gauge(
            "n_proxy_client_connections",
            "Open client connections on the proxy listener.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.connections_refused = Counter(
            "n_proxy_connections_refused",
            "Client connections closed at accept because max_connections were open.",
            registry=r,
        )
        self.client_timeouts = Counter(
            "n_proxy_client_timeouts",
            "Client connections cut for sending their request headers or body too slowly.",
            ["phase"],
            registry=r,
        )

        self.replica_up = Gauge(
            "n_proxy_replica_up",
            "1 when a replica takes children: its health check passes and it is not ejected.",
            ["upstream", "replica"],
            registry=r,
            multiprocess_mode="livemin",  # up only where every worker sees it up
        )
        self.retries = Counter(
            "n_proxy_retries",
            "Upstream requests tried again, by cause: connect, reset or an HTTP status.",
            ["upstream", "reason"],
            registry=r,
        )
        self.retries_refused = Counter(
            "n_proxy_retries_refused",
            "Failed tries not tried again because the upstream's retry budget was used up.",
            ["upstream", "reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "n_proxy_fallbacks",
            "Upstream requests sent to the fallback upstream after every try failed.",
            ["upstream", "fallback"],
            registry=r,
        )
        self.ejections = Counter(
            "n_proxy_ejections",
            "Times a replica was taken out after consecutive failures.",
            ["upstream", "replica"],
            registry=r,
        )
        self.slot_stalls = Counter(
            "n_proxy_slot_stalls",
            "Watchdog findings: children queued longer than the queue in front of them explains.",
            ["upstream"],
            registry=r,
        )

    def answered(self, route: str, status: int, fanned_out: bool) -> None:
        """One request answered: ``requests`` by its labels, the labelled child looked up once."""
        key = (route, status, fanned_out)
        child = self._answered.get(key)
        if child is None:
            fanned = "true" if fanned_out else "false"
            child = self._answered[key] = self.requests.labels(route, str(status), fanned)
        child.inc()

    def render(self) -> bytes:
        if MULTIPROCESS:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry)
        return generate_latest(self.registry)
