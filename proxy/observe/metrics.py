"""Prometheus metrics of one proxy instance (its own registry, so tests can run several).

What moves on every request is a plain Python number read at scrape time (the plain counts of
``proxy.observe.plain``, through one ``Collector``). Under ``--workers`` (multiprocess mode)
those families are prometheus-client's instead, so every worker's files add up. Labelled families
start at zero for every label set known up front.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import prometheus_client
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from proxy.observe.catalog import OTHER, ModelCatalog
from proxy.observe.census import GAUGES
from proxy.observe.plain import Count, Observe, PlainCounter, PlainHistogram, counted, observed

if TYPE_CHECKING:
    from proxy.config import Config
    from proxy.observe.census import Census

# Set by ``--workers``: every worker writes its values there and /metrics adds them up.
MULTIPROCESS = "PROMETHEUS_MULTIPROC_DIR" in os.environ

# A `_created` twin of every counter and histogram doubles the series and helps no query.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
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

# How an upstream answered a request or child, after any retries (docs/behaviour.md#errors,
# #failover).
UPSTREAM_OUTCOMES = ("2xx", "3xx", "4xx", "5xx", "timeout", "unreachable")
# The part of a request the HTTP parser refused (proxy.observe.clienterrors): never the
# client's words.
PROTOCOL_ERROR_KINDS = ("request_line", "header", "too_long", "body", "other")
STATUS_CLASSES = ("other", "other", "2xx", "3xx", "4xx", "5xx", "other", "other", "other", "other")


class _PlainCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        for family in self._metrics.plain:
            yield family.collect()
        yield from self._metrics.sampled()


class Metrics:
    def __init__(self) -> None:
        self.plain: list[PlainCounter | PlainHistogram] = []
        # What the proxy holds now (proxy.observe.census), read at scrape time.
        self.census: Callable[[], Census] | None = None
        self._replicas_sampled: set[tuple[str, str]] = set()  # multiprocess: labels written
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = self._counter(
            "n_proxy_requests",
            "Requests answered, by route, status and whether they were fanned out.",
            ["route", "status", "fanned_out"],
        )
        self.request_duration = self._histogram(
            "n_proxy_request_duration_seconds",
            "Time from a request's arrival to the end of its response, as the client sees it.",
            ["route", "fanned_out"],
        )
        self.first_chunk = self._histogram(
            "n_proxy_time_to_first_chunk_seconds",
            "Streamed responses: time from the request's arrival to the first body chunk "
            "written to the client (for an LLM stream, about the time to first token).",
            ["route", "fanned_out"],
        )
        self.n = self._histogram(
            "n_proxy_request_n",
            "The n of fanned-out requests (choices per prompt, or best_of).",
            buckets=(2, 3, 4, 5, 8, 10, 16, 32, 64, 128),
        )
        self.queue_wait = self._histogram(
            "n_proxy_queue_wait_seconds",
            "Time a request or child waited for one of its upstream's max_concurrency slots.",
            ["upstream"],
        )
        self.upstream_responses = self._counter(
            "n_proxy_upstream_responses",
            "Upstream requests and children by how they ended after any retries: a status "
            "class, timeout or unreachable.",
            ["upstream", "outcome"],
        )
        self.upstream_ttfb = self._histogram(
            "n_proxy_upstream_ttfb_seconds",
            "Time from sending an upstream request to its response headers.",
            ["upstream"],
        )
        self.upstream_duration = self._histogram(
            "n_proxy_upstream_duration_seconds",
            "Time from sending an upstream request to the end of its body.",
            ["upstream"],
        )
        self.overhead = self._histogram(
            "n_proxy_overhead_seconds",
            "Time the proxy itself spends on a request: before its first upstream request and "
            "after its last upstream byte.",
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1),
        )
        # Tokens, as the answers' usage reports them (docs/operating.md#tokens): a fan-out's merged
        # usage, a passed-through answer's own where it carries one.
        self.models = ModelCatalog()
        tokens = ["route", "upstream", "model"]
        self.prompt_tokens = self._counter(
            "n_proxy_prompt_tokens", "Prompt tokens of the answers, by route, upstream and model.",
            tokens,
        )  # fmt: skip
        self.completion_tokens = self._counter(
            "n_proxy_completion_tokens",
            "Completion tokens of the answers (every choice), by route, upstream and model.",
            tokens,
        )
        self.cached_tokens = self._counter(
            "n_proxy_cached_tokens",
            "Prompt tokens the upstream served from its prefix cache (usage's "
            "prompt_tokens_details.cached_tokens), by route, upstream and model.",
            tokens,
        )
        self.reasoning_tokens = self._counter(
            "n_proxy_reasoning_tokens",
            "Completion tokens spent reasoning (usage's completion_tokens_details."
            "reasoning_tokens), by route, upstream and model.",
            tokens,
        )
        self.time_to_first_token = self._histogram(
            "n_proxy_time_to_first_token_seconds",
            "Streams answered 2xx: time from the request's arrival to its first token chunk "
            "written to the client, by route and model.",
            ["route", "model"],
        )
        self.time_per_output_token = self._histogram(
            "n_proxy_time_per_output_token_seconds",
            "Streams answered 2xx with usage: time from the first token to the end, over each "
            "choice's completion tokens after its first, by route and model.",
            ["route", "model"],
            buckets=_PER_TOKEN,
        )
        self.children = self._histogram(
            "n_proxy_children_per_request",
            "Upstream requests each fanned-out request sent (its prompts times n, or best_of): "
            "the fan-out factor.",
            ["route"],
            buckets=(1, 2, 3, 4, 5, 8, 10, 16, 32, 64, 128, 256, 1024, 2048),
        )
        self.stitched_chunks = self._counter(
            "n_proxy_stitched_chunks", "SSE chunks written by fan-out streams."
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
        self.client_limited = Counter(
            "n_proxy_client_limited",
            "Requests refused with 429 because their client had clients.max_children children "
            "queued or running.",
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
        for phase in ("headers", "body"):
            self.client_timeouts.labels(phase)
        self.client_protocol_errors = Counter(
            "n_proxy_client_protocol_errors",
            "Requests the HTTP parser refused (answered 400), by the part it refused: "
            "request_line, header, too_long, body or other.",
            ["kind"],
            registry=r,
        )
        for kind in PROTOCOL_ERROR_KINDS:
            self.client_protocol_errors.labels(kind)

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
        self.config_reloads = Counter(
            "n_proxy_config_reloads",
            "Config reloads (SIGHUP) by result: ok (new requests use it) or failed (the running "
            "config is kept).",
            ["result"],
            registry=r,
        )
        for result in ("ok", "failed"):
            self.config_reloads.labels(result)
        self.model_list_failures = Counter(
            "n_proxy_model_list_failures",
            "Upstreams left out of a merged /v1/models answer: they failed, refused or timed out.",
            ["upstream"],
            registry=r,
        )
        if MULTIPROCESS:
            # A sampler writes the queues into files for worker 0's /metrics (see ``sample``).
            self._queue_depth = Gauge(
                "n_proxy_queue_depth",
                _QUEUE_DEPTH,
                ["upstream"],
                registry=r,
                multiprocess_mode="livesum",
            )
            self._slots_in_use = Gauge(
                "n_proxy_slots_in_use",
                _SLOTS_IN_USE,
                ["upstream"],
                registry=r,
                multiprocess_mode="livesum",
            )
            self._in_flight = Gauge(
                "n_proxy_children_in_flight",
                _IN_FLIGHT,
                ["upstream"],
                registry=r,
                multiprocess_mode="livesum",
            )
            self._held = {
                name: Gauge(name, doc, registry=r, multiprocess_mode="livesum")
                for name, doc in GAUGES.items()
            }
            self._outstanding = Gauge(
                "n_proxy_replica_outstanding",
                _OUTSTANDING,
                ["upstream", "replica"],
                registry=r,
                multiprocess_mode="livesum",
            )
        else:
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                # The default registry's own collectors, for this registry too.
                r.register(_Shared(collector))
            r.register(_PlainCollector(self))

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        if MULTIPROCESS:
            return Counter(name, doc, labels, registry=self.registry)
        family = PlainCounter(name, doc, labels)
        self.plain.append(family)
        return family

    def _histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = _LATENCY
    ) -> Any:
        if MULTIPROCESS:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
        family = PlainHistogram(name, doc, labels, buckets)
        self.plain.append(family)
        return family

    def known(self, config: Config) -> None:
        """Every label set the config names, at zero, so rates and ratios exist from the start."""
        self.models.configure(route.model for route in config.routes)
        for route in (*config.fanout_paths, "other"):
            for fanned in ("true", "false") if route != "other" else ("false",):
                self.request_duration.labels(route, fanned)
                self.first_chunk.labels(route, fanned)
        for route in config.fanout_paths:
            self.children.labels(route)
            self.time_to_first_token.labels(route, OTHER)
            for upstream in config.upstreams:
                for family in self._token_families():
                    family.labels(route, upstream.name, OTHER)
        for upstream in config.upstreams:
            name = upstream.name
            self.queue_wait.labels(name)
            self.upstream_ttfb.labels(name)
            self.upstream_duration.labels(name)
            for outcome in UPSTREAM_OUTCOMES:
                self.upstream_responses.labels(name, outcome)
            for family in (
                self.children_aborted, self.rejected, self.client_limited, self.slot_stalls,
                self.model_list_failures,
            ):  # fmt: skip
                family.labels(name)
            for reason in upstream.retry_on:
                self.retries.labels(name, str(reason))
                self.retries_refused.labels(name, str(reason))
            if upstream.fallback is not None:
                self.fallbacks.labels(name, upstream.fallback)
            for url in upstream.urls:
                self.ejections.labels(name, url)

    def _token_families(self) -> tuple[Any, Any, Any, Any]:
        return self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.reasoning_tokens

    def token_series(self, route: str, upstream: str, model: str) -> TokenSeries:
        """The four token counts of one (route, upstream, model) label set."""
        prompt, completion, cached, reasoning = (
            counted(family.labels(route, upstream, model)) for family in self._token_families()
        )
        return TokenSeries(prompt, completion, cached, reasoning)

    def forget(self, upstreams: Collection[str], replicas: Collection[tuple[str, str]]) -> None:
        """Remove every series of the ``upstreams``, and of the (upstream, replica) pairs, that a
        reload took away (docs/operating.md#reload), from every family labelled by upstream. Not
        under ``--workers``: prometheus-client cannot take a series out of the workers' files."""
        if MULTIPROCESS or not (upstreams or replicas):
            return
        for family in vars(self).values():
            if isinstance(family, PlainCounter | PlainHistogram | Counter | Gauge | Histogram):
                for values in _gone(family, upstreams, replicas):
                    family.remove(*values)

    def answered_series(
        self, route: str, status: int, fanned_out: bool
    ) -> tuple[Count, Observe, Observe]:
        """The request count, duration and first-chunk children of one (route, status, fanned
        out) label set."""
        fanned = "true" if fanned_out else "false"
        return (
            counted(self.requests.labels(route, str(status), fanned)),
            observed(self.request_duration.labels(route, fanned)),
            observed(self.first_chunk.labels(route, fanned)),
        )

    def sampled(self) -> Iterator[Metric]:
        """What the proxy holds as it is now (single process: read at scrape time)."""
        depth = GaugeMetricFamily("n_proxy_queue_depth", _QUEUE_DEPTH, labels=["upstream"])
        in_use = GaugeMetricFamily("n_proxy_slots_in_use", _SLOTS_IN_USE, labels=["upstream"])
        in_flight = GaugeMetricFamily("n_proxy_children_in_flight", _IN_FLIGHT, labels=["upstream"])
        outstanding = GaugeMetricFamily(
            "n_proxy_replica_outstanding", _OUTSTANDING, labels=["upstream", "replica"]
        )
        held = {name: GaugeMetricFamily(name, doc) for name, doc in GAUGES.items()}
        if self.census is not None:
            census = self.census()
            for name, count in census.gauges().items():
                held[name].add_metric([], count)
            for upstream in census.upstreams:
                depth.add_metric([upstream.name], upstream.queued)
                in_use.add_metric([upstream.name], upstream.slots_held)
                in_flight.add_metric([upstream.name], upstream.exchanges)
                for url, count in upstream.outstanding.items():
                    outstanding.add_metric([upstream.name, url], count)
        yield depth
        yield in_use
        yield in_flight
        yield outstanding
        yield from held.values()

    def sample(self) -> None:
        """Multiprocess mode: what this worker holds into its files (a periodic task calls this).

        A replica that discovery dropped is written at 0, so the sum forgets it."""
        if not MULTIPROCESS or self.census is None:
            return
        census = self.census()
        for name, count in census.gauges().items():
            self._held[name].set(count)
        seen = set()
        for upstream in census.upstreams:
            self._queue_depth.labels(upstream.name).set(upstream.queued)
            self._slots_in_use.labels(upstream.name).set(upstream.slots_held)
            self._in_flight.labels(upstream.name).set(upstream.exchanges)
            for url, count in upstream.outstanding.items():
                self._outstanding.labels(upstream.name, url).set(count)
                seen.add((upstream.name, url))
        for labels in self._replicas_sampled - seen:
            self._outstanding.labels(*labels).set(0)
        self._replicas_sampled = seen

    def render(self) -> bytes:
        if MULTIPROCESS:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry)
        return generate_latest(self.registry)


_QUEUE_DEPTH = "Children waiting for a max_concurrency slot, per upstream."
_SLOTS_IN_USE = "max_concurrency slots held, per upstream."
_IN_FLIGHT = "Upstream requests in flight, per upstream, retries and backoff waits included."
_OUTSTANDING = (
    "Upstream requests in flight on each replica from this proxy (what least_outstanding "
    "placement compares)."
)


def _gone(
    family: PlainCounter | PlainHistogram | Counter | Gauge | Histogram,
    upstreams: Collection[str],
    replicas: Collection[tuple[str, str]],
) -> set[tuple[str, ...]]:
    """The label values of ``family``'s series that name one of ``upstreams`` (as its upstream or
    its fallback) or one of ``replicas``. A sample's labels come in the family's order, with a
    histogram bucket's ``le`` after them."""
    collected = family.collect()
    found = set()
    for metric in [collected] if isinstance(collected, Metric) else collected:
        for sample in metric.samples:
            labels = sample.labels
            upstream = labels.get("upstream")
            if upstream is not None and (
                upstream in upstreams
                or labels.get("fallback") in upstreams
                or (upstream, labels.get("replica")) in replicas
            ):
                found.add(tuple(value for name, value in labels.items() if name != "le"))
    return found


class _Shared(Collector):
    """A collector of the default registry, for ours too (one registry per proxy instance)."""

    def __init__(self, collector: Collector) -> None:
        self._collector = collector

    def collect(self) -> Iterable[Metric]:
        return self._collector.collect()


class TokenSeries(NamedTuple):
    prompt: Count
    completion: Count
    cached: Count
    reasoning: Count
