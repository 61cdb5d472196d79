"""What one request came to: the record its handler fills in as it goes, and at its end the
metrics, the server span's end and the request log line (its fields: docs/operating.md#logs)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING

from aiohttp import web

from proxy.observe.log import log_enabled, log_request
from proxy.observe.metrics import Metrics
from proxy.observe.tracing import trace_id
from proxy.request.fanout import Fanout
from proxy.upstream.exchange import Trace

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from proxy.observe.tracing import Tracing

# The log line's request id when the client sent none: unique per process, cheap per request.
_ID_PREFIX = os.urandom(6).hex()
_ids = count(1)


@dataclass
class Outcome:
    """What the request log line, the metrics and the spans say about one request."""

    route: str = "other"
    upstream: str = ""
    model: str | None = None
    n: int = 1
    children: int = 0
    status: int = 499  # nginx's "client closed request", kept when the client leaves first
    streamed: bool = True  # the response body follows the upstream's as it arrives
    trace: Trace = field(default_factory=Trace)
    fanout: Fanout | None = None
    body_bytes: int = 0
    bytes_out: int | None = None  # the response body's length, where the proxy knows it
    first_chunk_at: float | None = None  # streamed responses: the first body chunk written
    queued: float = 0.0  # seconds its first upstream request waited for a slot
    span: Span | None = None  # the server span, when tracing

    def overhead(self, trace: Trace, started: float, ended: float) -> float | None:
        """Time before the first upstream request, plus stitching after the last body ended;
        not the wait for an upstream slot, which is the upstream's queue (queue_wait)."""
        if trace.sent_at is None:
            return None
        after = 0.0
        if not self.streamed and trace.done_at is not None:
            after = max(ended - trace.done_at, 0.0)
        return max(trace.sent_at - started - self.queued, 0.0) + after


def record(
    request: web.Request,
    outcome: Outcome,
    metrics: Metrics,
    tracing: Tracing | None,
    started: float,
    ended: float,
) -> None:
    """The request's end: its metrics, its span ended, its log line."""
    fanout = outcome.fanout
    trace = outcome.trace
    if fanout is not None:
        trace = fanout.summary()
        outcome.first_chunk_at = fanout.first_chunk_at
        outcome.queued = fanout.first_wait or 0.0
        if fanout.bytes_out is not None:
            outcome.bytes_out = fanout.bytes_out
    first_at = outcome.first_chunk_at
    first_chunk = first_at - started if first_at is not None else None
    metrics.answered(
        outcome.route, outcome.status, bool(outcome.children), ended - started, first_chunk
    )
    overhead = outcome.overhead(trace, started, ended)
    if overhead is not None:
        metrics.overhead.observe(overhead)
    span = outcome.span
    if span is not None and tracing is not None:
        tracing.end_server(
            span, outcome.route, outcome.upstream, outcome.n, outcome.children, outcome.status
        )
    if log_enabled():
        _log(request, outcome, trace, ended - started, first_chunk)


def _log(
    request: web.Request,
    outcome: Outcome,
    trace: Trace,
    seconds: float,
    first_chunk: float | None,
) -> None:
    """The request line (proxy.observe.log): ids, where it went, sizes, times, tokens."""
    fanout = outcome.fanout
    usage = fanout.usage if fanout else None
    if fanout:
        replica: str | None = fanout.replicas()
    else:
        replica = trace.replica
    span = outcome.span
    log_request(
        request_id=fanout.plan.parent_id if fanout else logged_id(request),
        trace_id=trace_id(span) if span is not None else _incoming_trace_id(request),
        method=request.method,
        path=request.path,
        route=outcome.route,
        model=outcome.model,
        upstream=outcome.upstream,
        replica=replica,
        n=outcome.n,
        children=outcome.children,
        children_aborted=fanout.aborted if fanout else 0,
        retries=trace.retries,
        status=outcome.status,
        bytes_in=outcome.body_bytes,
        bytes_out=outcome.bytes_out,
        duration_ms=round(seconds * 1000, 3),
        ttft_ms=round(first_chunk * 1000, 3) if first_chunk is not None else None,
        prompt_tokens=usage.get("prompt_tokens") if usage else None,
        completion_tokens=usage.get("completion_tokens") if usage else None,
    )


def logged_id(request: web.Request) -> str:
    """The client's id, else one of the proxy's own (never sent upstream: a pass-through sends
    exactly the client's request)."""
    incoming = request.headers.get("X-Request-Id")
    return incoming[:200] if incoming is not None else f"{_ID_PREFIX}-{next(_ids):x}"


def _incoming_trace_id(request: web.Request) -> str | None:
    """The client's W3C trace id, logged even with tracing off, for finding the request."""
    parent = request.headers.get("traceparent")
    if parent is None or len(parent) < 55 or parent[2] != "-":
        return None
    return parent[3:35]
