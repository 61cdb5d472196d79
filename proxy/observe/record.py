"""One record per request: what it came to, written in one place as it goes.

The handler owns a ``RequestRecord``; every upstream request it sends (a pass-through's one, each
fan-out child) has a ``ChildRecord`` in it. The layers below report named steps, as httpcore's
trace hook has its transports do: a child ``admitted`` (its place in line granted), ``sent``
(each try, to a replica), ``retry``, ``head`` (its status line, retries done) and ``ended``; the
request ``counted`` (what it came to is known: the metrics count it) and ``ended`` (the log line
and the span). Each step writes its facts here and then tells the ``Observer`` s: the
metrics, the spans and the request's log line are built from the record alone, so they cannot
disagree. Facts with no step (the route, the bytes written, the first chunk's time, the usage)
are plain attributes, written where they become known.

The record knows neither its observers nor the layers that report to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from mypy_extensions import mypyc_attr

from proxy.core import answer_facts

if TYPE_CHECKING:
    from opentelemetry.trace import Span

# Not loop.time(): uvloop's has millisecond steps. Read from a C static when compiled
# (docs/architecture.md#working-on-a-compiled-module).
_perf_counter: Final = time.perf_counter


@mypyc_attr(allow_interpreted_subclasses=True)  # the tracing, the log line, the tests' own
class Observer:
    """What watches requests: one method per step, each called once the record holds the step's
    facts. Every method does nothing here; only those a subclass overrides are called."""

    def begun(self, record: RequestRecord) -> None: ...

    def admitted(self, child: ChildRecord) -> None: ...

    def sent(self, child: ChildRecord, headers: MutableMapping[str, str]) -> None:
        """The child's first try, before a byte of it leaves: ``headers`` are still its own."""

    def retry(self, child: ChildRecord, reason: str) -> None:
        """A retry goes out now (its wait is over): ``reason`` is what failed the try before."""

    def head(self, child: ChildRecord) -> None: ...

    def child_ended(self, child: ChildRecord, failure: BaseException | None) -> None:
        """The child's exchange is over; ``failure`` is what ended it early, if anything."""

    def counted(self, record: RequestRecord) -> None:
        """What the request came to is known (its status, bytes, usage and duration): what
        counts it (the metrics) counts it here, before an answer held whole is written, so that
        a client holding its answer finds it counted, whichever process serves /metrics."""

    def ended(self, record: RequestRecord) -> None: ...


@dataclass(frozen=True, slots=True)
class LargeRequest:
    """An end hook for large requests only: a body of ``body_bytes`` or more, or ``children``
    upstream requests or more. A request under both is not even looked at (the memory
    trimmer's: it is the only one that needs this)."""

    body_bytes: int
    children: int
    ended: Callable[[RequestRecord], None]


class Observers:
    """Every observer's steps, gathered once: a step calls only the methods that do something."""

    __slots__ = ("admitted", "begun", "child_ended", "counted", "ended", "head", "large", "retry",
                 "sent")  # fmt: skip

    def __init__(self, observers: Iterable[Observer], large: LargeRequest | None = None) -> None:
        chosen = list(observers)

        def hooks(step: str) -> tuple[Any, ...]:
            base = getattr(Observer, step)
            return tuple(getattr(o, step) for o in chosen if getattr(type(o), step) is not base)

        self.begun: tuple[Callable[[RequestRecord], None], ...] = hooks("begun")
        self.admitted: tuple[Callable[[ChildRecord], None], ...] = hooks("admitted")
        self.sent: tuple[Callable[[ChildRecord, MutableMapping[str, str]], None], ...] = hooks(
            "sent"
        )
        self.retry: tuple[Callable[[ChildRecord, str], None], ...] = hooks("retry")
        self.head: tuple[Callable[[ChildRecord], None], ...] = hooks("head")
        self.child_ended: tuple[Callable[[ChildRecord, BaseException | None], None], ...] = hooks(
            "child_ended"
        )
        self.counted: tuple[Callable[[RequestRecord], None], ...] = hooks("counted")
        self.ended: tuple[Callable[[RequestRecord], None], ...] = hooks("ended")
        self.large = large


class RequestRecord:
    """One client request: where it went, what it sent back, how long each part took.

    Times are ``perf_counter`` seconds. Bytes written to the client (``bytes_out``) and the
    first body chunk's time (``first_chunk_at``) are kept by the writer and set here once the
    body is over (``proxy.request.sink``'s ``settle``); nothing here is touched per chunk.
    """

    __slots__ = (
        "aborted", "body", "bytes_in", "bytes_out", "children", "chunks", "client", "done_at",
        "ended_at",
        "fanned_out", "finish_reasons", "first_chunk_at", "headers", "method", "model", "n",
        "observers", "path", "provider", "queued", "relayed", "request_id", "response_id",
        "response_model", "retries", "route", "sent_at", "span", "started", "status", "tail",
        "trace_id", "upstream", "usage",
    )  # fmt: skip

    def __init__(
        self, observers: Observers, method: str, path: str, headers: Mapping[str, str]
    ) -> None:
        self.observers = observers
        self.started = _perf_counter()
        self.method = method
        self.path = path
        self.headers = headers  # the client's, as it sent them
        self.client: str | None = None  # its id (proxy.request.clients): never a key itself
        self.route = "other"  # the fan-out path it came in on, or "other"
        self.upstream = ""
        self.provider = ""  # its upstream's, as the GenAI conventions name it (``provider``)
        self.model: str | None = None  # the body's, where the body was read
        # The request's body as the proxy read it, where it did (a fan-out path's JSON object):
        # what spans take the request's parameters from.
        self.body: dict[str, Any] | None = None
        self.fanned_out = False
        self.n = 1
        self.request_id: str | None = None  # a fan-out's parent id; else the client's, if any
        # Its upstream requests, in child order; let go when it ends (``ended``).
        self.children: list[ChildRecord] = []
        self.status = 499  # nginx's "client closed request", kept when the client leaves first
        self.relayed = True  # the body follows the upstream's as it arrives (not stitched)
        self.bytes_in = 0
        self.bytes_out: int | None = None  # the response body's length, where the proxy knows it
        self.first_chunk_at: float | None = None  # streamed responses: the first body chunk
        self.queued: float | None = None  # how long its first upstream request waited to go
        self.sent_at: float | None = None  # its first upstream request went out
        self.done_at: float | None = None  # its last upstream request ended
        self.retries = 0  # over every child
        self.aborted = 0  # children cancelled before they finished
        self.chunks = 0  # SSE chunks a fan-out stream wrote
        # The answer's usage, id and model: a fan-out's merged ones, or what a passed-through
        # answer carried (read from ``tail``, its last bytes relayed, on a fan-out path only).
        self.usage: dict[str, Any] | None = None
        self.response_id: str | None = None
        self.response_model: str | None = None
        self.tail = b""
        # A fan-out's finish_reason per choice, in index order (None: a choice that never
        # finished), read from the stitched answer once it is complete.
        self.finish_reasons: tuple[str | None, ...] = ()
        self.span: Span | None = None  # its server span, when tracing
        self.trace_id: str | None = None  # the span's trace id, when tracing
        self.ended_at = 0.0  # until it is counted (``counted``)
        for hook in observers.begun:
            hook(self)

    def child(self, index: int | None) -> ChildRecord:
        """A record for one more upstream request: fan-out child ``index``'s, or (None) the
        pass-through's."""
        child = ChildRecord(self, index)
        self.children.append(child)
        return child

    def counted(self) -> None:
        """What the request came to is known: its end time taken, a passed-through LLM answer's
        usage, id and model read from its ``tail`` (a fan-out's are its stitcher's), and every
        observer's count. Once; ``ended`` does it when nothing did before."""
        if self.ended_at:
            return
        self.ended_at = _perf_counter()
        if self.tail and not self.fanned_out:
            facts = answer_facts(self.tail)
            self.usage, self.response_id, self.response_model = facts.usage, facts.id, facts.model
        for hook in self.observers.counted:
            hook(self)

    def ended(self) -> None:
        """The request is over (answered, failed, or its client gone): counted, if it was not
        yet, then every observer's end."""
        self.counted()
        observers = self.observers
        for hook in observers.ended:
            hook(self)
        large = observers.large
        if large is not None and (
            self.bytes_in >= large.body_bytes or len(self.children) >= large.children
        ):
            large.ended(self)
        # Its observers have read them: letting them go breaks the cycle with each child's
        # ``record``, so that an ended request is freed at once, not left to the cyclic collector.
        self.children = []

    @property
    def seconds(self) -> float:
        return self.ended_at - self.started

    @property
    def first_chunk(self) -> float | None:
        """Seconds from its arrival to its first body chunk written (time to first token)."""
        at = self.first_chunk_at
        return at - self.started if at is not None else None

    @property
    def overhead(self) -> float | None:
        """Time before its first upstream request less the wait for a slot (the upstream's queue),
        plus stitching after its last upstream body ended; None when nothing went upstream."""
        if self.sent_at is None:
            return None
        after = 0.0
        if not self.relayed and self.done_at is not None:
            after = max(self.ended_at - self.done_at, 0.0)
        return max(self.sent_at - self.started - (self.queued or 0.0), 0.0) + after

    def replicas(self) -> str | None:
        """The replicas that answered its upstream requests, each once, in child order."""
        children = self.children
        if len(children) == 1:  # a pass-through's, the most common
            return children[0].replica
        seen = dict.fromkeys(c.replica for c in children if c.replica is not None)
        return ",".join(seen) if seen else None


class ChildRecord:
    """One upstream request of a request: its place in line, its tries, its answer."""

    __slots__ = ("done_at", "head_at", "index", "queued", "record", "replica", "retries",
                 "sent_at", "span", "status")  # fmt: skip

    def __init__(self, record: RequestRecord, index: int | None) -> None:
        self.record = record
        self.index = index  # the choice it is for (None: a pass-through)
        self.queued = 0.0  # seconds it waited for its upstream slot
        self.replica: str | None = None  # the replica of its last try
        self.retries = 0
        # Each 0 until it happened: its first try sent, its status line (retries done) in, its
        # exchange over.
        self.sent_at = 0.0
        self.head_at = 0.0
        self.status = 0
        self.done_at = 0.0
        self.span: Span | None = None  # its client span, when tracing

    def admitted(self, joined: float) -> None:
        """Its place in line is granted; it joined the line at ``joined``."""
        self.queued = waited = _perf_counter() - joined
        record = self.record
        if record.queued is None:
            record.queued = waited
        for hook in record.observers.admitted:
            hook(self)

    def sent(self, replica: str, headers: MutableMapping[str, str]) -> None:
        """A try goes to ``replica``: the first, or one after ``retry``."""
        self.replica = replica
        if not self.sent_at:
            self.sent_at = now = _perf_counter()
            record = self.record
            if record.sent_at is None:
                record.sent_at = now
            for hook in record.observers.sent:
                hook(self, headers)

    def retry(self, reason: str) -> None:
        self.retries += 1
        record = self.record
        record.retries += 1
        for hook in record.observers.retry:
            hook(self, reason)

    def head(self, status: int) -> None:
        self.status = status
        self.head_at = _perf_counter()
        for hook in self.record.observers.head:
            hook(self)

    def ended(self, failure: BaseException | None) -> None:
        """Its exchange is over: the body read or relayed, or ``failure`` (a cancellation too)."""
        self.done_at = now = _perf_counter()
        record = self.record
        record.done_at = now
        for hook in record.observers.child_ended:
            hook(self, failure)
