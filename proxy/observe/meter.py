"""The meter: the observer of requests that moves every request-path metric from the record
alone (the queue wait, each upstream request's answer, durations, retries, the tokens and times
of an LLM answer), so that the metrics cannot disagree with the log line or the span.
"""

from __future__ import annotations

from proxy.config import Config
from proxy.core import UpstreamTimeout, UpstreamUnavailable, token_counts
from proxy.observe.metrics import STATUS_CLASSES, Metrics, TokenSeries
from proxy.observe.plain import Count, Observe, counted, observed
from proxy.observe.record import ChildRecord, Observer, RequestRecord


class RequestMetrics(Observer):
    """Every metric a request's steps move, from its record: the queue wait, each upstream
    request's answer (status class, timeout or unreachable), time to its head and to its end,
    retries, children aborted, the request's count, duration, first chunk and n, the proxy's
    overhead, the chunks a stream stitched; on a fan-out path, its tokens, time to first token
    and per output token by model, and its children. Labelled children are looked up once per
    upstream (and per route, status and model), not on every request."""

    def __init__(self, metrics: Metrics, config: Config) -> None:
        self._metrics = metrics
        self._upstreams = {u.name: _UpstreamSeries(metrics, u.name) for u in config.upstreams}
        self._answered: dict[tuple[str, int, bool], tuple[Count, Observe, Observe]] = {}
        self._tokens: dict[tuple[str, str, str], TokenSeries] = {}
        self._timings: dict[tuple[str, str], tuple[Observe, Observe]] = {}

    def admitted(self, child: ChildRecord) -> None:
        self._upstreams[child.record.upstream].queue_wait.observe(child.queued)

    def retry(self, child: ChildRecord, reason: str) -> None:
        self._metrics.retries.labels(child.record.upstream, reason).inc()

    def head(self, child: ChildRecord) -> None:
        series = self._upstreams[child.record.upstream]
        series.ttfb.observe(child.head_at - child.sent_at)
        series.answered(child.status).inc()

    def child_ended(self, child: ChildRecord, failure: BaseException | None) -> None:
        series = self._upstreams[child.record.upstream]
        series.duration.observe(child.done_at - child.sent_at)
        if not child.status and isinstance(failure, UpstreamTimeout | UpstreamUnavailable):
            # No status line came: out of time (a 504), or anything else (a 502).
            (series.timeout if isinstance(failure, UpstreamTimeout) else series.unreachable).inc()

    def counted(self, record: RequestRecord) -> None:
        key = (record.route, record.status, record.fanned_out)
        children = self._answered.get(key)
        if children is None:
            children = self._answered[key] = self._metrics.answered_series(*key)
        count, duration, first = children
        count.inc()
        duration.observe(record.seconds)
        first_chunk = record.first_chunk
        if first_chunk is not None:
            first.observe(first_chunk)
        overhead = record.overhead
        if overhead is not None:
            self._metrics.overhead.observe(overhead)
        if record.fanned_out:
            self._metrics.n.observe(record.n)
            self._metrics.children.labels(record.route).observe(len(record.children))
            if record.aborted:
                self._upstreams[record.upstream].aborted.inc(record.aborted)
            if record.chunks:
                self._metrics.stitched_chunks.inc(record.chunks)
        if record.route != "other" and 200 <= record.status < 300:
            self._answer(record)

    def _answer(self, record: RequestRecord) -> None:
        """What an LLM answer cost: its tokens, its first token's time and the time per token
        after it (docs/operating.md#tokens)."""
        route, upstream = record.route, record.upstream
        model = self._metrics.models.label(upstream, record.response_model, record.model)
        usage = record.usage
        tokens = token_counts(usage) if usage is not None else None
        if tokens is not None:
            key = (route, upstream, model)
            series = self._tokens.get(key)
            if series is None:
                series = self._tokens[key] = self._metrics.token_series(*key)
            series.prompt.inc(tokens.prompt)
            series.completion.inc(tokens.completion)
            if tokens.cached:  # most answers have none of either
                series.cached.inc(tokens.cached)
            if tokens.reasoning:
                series.reasoning.inc(tokens.reasoning)
        first_at = record.first_chunk_at
        if first_at is None:
            return
        timings = self._timings.get((route, model))
        if timings is None:
            timings = self._timings[(route, model)] = (
                observed(self._metrics.time_to_first_token.labels(route, model)),
                observed(self._metrics.time_per_output_token.labels(route, model)),
            )
        to_first, per_token = timings
        to_first.observe(first_at - record.started)
        choices = len(record.children) if record.fanned_out else 1
        if tokens is not None and tokens.completion > choices:  # more than one token a choice
            after_first = tokens.completion / choices - 1
            per_token.observe(max(record.ended_at - first_at, 0.0) / after_first)


class _UpstreamSeries:
    """One upstream's labelled children of the request-path families."""

    __slots__ = ("_by_class", "_name", "_responses", "aborted", "duration", "queue_wait",
                 "timeout", "ttfb", "unreachable")  # fmt: skip

    def __init__(self, metrics: Metrics, name: str) -> None:
        self._name = name
        self._responses = metrics.upstream_responses
        self.queue_wait = observed(metrics.queue_wait.labels(name))
        self.ttfb = observed(metrics.upstream_ttfb.labels(name))
        self.duration = observed(metrics.upstream_duration.labels(name))
        self.timeout = counted(self._responses.labels(name, "timeout"))
        self.unreachable = counted(self._responses.labels(name, "unreachable"))
        self.aborted = counted(metrics.children_aborted.labels(name))
        self._by_class: list[Count | None] = [None] * 10  # status // 100 % 10 -> its count

    def answered(self, status: int) -> Count:
        """The count of upstream answers of ``status``'s class."""
        at = status // 100 % 10
        count = self._by_class[at]
        if count is None:
            count = self._by_class[at] = counted(
                self._responses.labels(self._name, STATUS_CLASSES[at])
            )
        return count
