"""Running a planned fan-out: k concurrent children upstream, one stitched answer downstream.

The I/O shell around ``plan`` and ``stitch``: children run as tasks, each taking its own upstream
slot; every pending child is cancelled (its connection closed, its slot or place in line given
back) in a ``finally``, so nothing generates for a client that is gone.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.config.models import Upstream
from proxy.core.errors import ChildFailed, InvalidRequest, ProxyError, UpstreamUnavailable
from proxy.core.plan import Plan
from proxy.core.sse import MAX_EVENT_BYTES, SSEDecoder
from proxy.core.stitch import StreamError, StreamStitcher, error_event, stitch_json
from proxy.http import HTTPClientError
from proxy.observe.metrics import failure_outcome, status_outcome
from proxy.request.mailbox import PING, Mailbox, PingTimer
from proxy.request.runtime import Runtime
from proxy.request.sink import Sink, client_sink
from proxy.upstream.exchange import Answer, Trace, UpstreamRequest, upstream_error
from proxy.upstream.service import Ticket, UpstreamPool

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from proxy.observe.tracing import Tracing

T = TypeVar("T")
# The upstream client stops reading a child's socket once it buffers twice this (inflated bytes
# included), and the mailbox holds at most one more read per child: what a child behind a slow
# client holds stays a few times this, however long its stream. The bench measures it, the
# client's write buffer included ("bytes held per child", bench/memory.py).
CHILD_READ_BUFFER = 16 * 1024


@dataclass
class Fanout:
    """One fan-out request: where its children go, what they carry, what came of them."""

    pool: UpstreamPool
    runtime: Runtime
    upstream: Upstream
    plan: Plan
    path_qs: str
    headers: CIMultiDict[str]  # end-to-end headers shared by every child
    tracing: Tracing | None = None
    span: Span | None = None  # the request's server span, when tracing
    aborted: int = 0  # children cancelled before they finished
    traces: list[Trace] = field(init=False)  # each child's: its replica, retries, times
    joined_at: float = 0.0  # when the children joined their upstream's queue
    first_wait: float | None = None  # how long the first child sent waited for its slot
    first_chunk_at: float | None = None  # streams: the first chunk written to the client
    bytes_out: int | None = None  # streams: body bytes written to the client
    usage: dict[str, Any] | None = None  # the merged usage, when the children sent one

    def __post_init__(self) -> None:
        self.traces = [Trace() for _ in self.plan.children]

    @property
    def max_event_bytes(self) -> int:
        """One SSE line or event held for a child: within the cap on a child's JSON body."""
        return min(MAX_EVENT_BYTES, self.runtime.config.max_response_bytes)

    def child_headers(self, pos: int) -> CIMultiDict[str]:
        headers = self.headers.copy()
        mode = self.upstream.child_request_id
        if mode == "prefixed":
            headers["X-Request-Id"] = self.plan.children[pos].request_id
        elif mode == "uuid":
            headers["X-Request-Id"] = str(uuid.uuid4())
        else:
            headers.popall("X-Request-Id", None)
        headers["Content-Type"] = "application/json"
        return headers

    def admit(self, count: int) -> list[Ticket]:
        """Each child's replica and place in line (``UpstreamPool.admit``)."""
        self.joined_at = time.perf_counter()
        return self.pool.admit(self.upstream, count)

    def send(self, pos: int, url: str) -> AbstractAsyncContextManager[Answer]:
        """Child ``pos``'s request, once its place is granted (inside its span when tracing)."""
        waited = time.perf_counter() - self.joined_at
        self.runtime.metrics.queue_wait.labels(self.upstream.name).observe(waited)
        if self.first_wait is None:
            self.first_wait = waited
        headers = self.child_headers(pos)
        request = UpstreamRequest(
            "POST", self.path_qs, headers, self.plan.children[pos].body,
            inflate=True, read_bufsize=CHILD_READ_BUFFER,
        )  # fmt: skip
        trace = self.traces[pos]
        exchange = self.pool.send(self.upstream, url, request, trace)
        if self.tracing is None or self.span is None:
            return exchange
        index = self.plan.children[pos].index
        return self.tracing.traced(
            self.span, exchange, trace, "POST", self.upstream.name, url, index, headers
        )

    def answered(self, answer: int | BaseException) -> None:
        """A child's status line after any retries, or the failure that left it without one."""
        outcome = status_outcome(answer) if isinstance(answer, int) else failure_outcome(answer)
        self.runtime.metrics.upstream_responses.labels(self.upstream.name, outcome).inc()

    def summary(self) -> Trace:
        """The children's traces as one: first sent, last done, retries summed."""
        sent = [t.sent_at for t in self.traces if t.sent_at is not None]
        done = [t.done_at for t in self.traces if t.done_at is not None]
        retries = sum(t.retries for t in self.traces)
        return Trace(min(sent, default=None), max(done, default=None), retries)

    def replicas(self) -> str | None:
        """The replicas that answered the children, each once, in child order."""
        seen = dict.fromkeys(t.replica for t in self.traces if t.replica is not None)
        return ",".join(seen) if seen else None

    async def cancel(self, tasks: Sequence[asyncio.Future[Any]]) -> None:
        aborted = await _cancel_all(tasks)
        if aborted:
            self.aborted += aborted
            self.runtime.metrics.children_aborted.labels(self.upstream.name).inc(aborted)


async def respond_json(fanout: Fanout) -> web.Response:
    """Non-streaming (docs/behaviour.md#json): wait for every child, fail fast on the first
    failure."""
    plan = fanout.plan
    # One slot per child, FIFO: a batch larger than max_concurrency runs in turns.
    tickets = fanout.admit(len(plan.children))

    async def fetch(pos: int) -> dict[str, Any]:
        answered = False
        try:
            async with tickets[pos].place, fanout.send(pos, tickets[pos].url) as answer:
                answered = True
                fanout.answered(answer.response.status)
                raw = await answer.read()
                if answer.response.status >= 300:
                    raise ChildFailed(answer.response.status, raw, answer.response.content_type)
        except ProxyError as exc:
            if not answered:
                fanout.answered(exc)
            raise
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            raise UpstreamUnavailable(
                f"upstream sent a body that is not a JSON object: {raw[:80]!r}"
            )
        return body

    tasks = [fanout.runtime.spawn_child(fetch(pos)) for pos in range(len(tickets))]
    try:
        bodies = await _all_or_first_failure(tasks)
    finally:
        try:
            await fanout.cancel(tasks)
        finally:  # a second cancellation right here must not keep the places
            _release(tickets)
    stitched = stitch_json(plan, bodies)
    usage = stitched.get("usage")
    fanout.usage = usage if isinstance(usage, dict) else None
    return web.Response(
        body=orjson.dumps(stitched),
        content_type="application/json",
        headers={"X-Request-Id": plan.parent_id},
    )


class Start:
    """When a stream commits (docs/behaviour.md#stream-start): at the first child's answer, or at
    every child's ("all").

    Answers are recorded synchronously by the children, so a failure is either the response's
    (before the commit) or a mid-stream error for the mailbox (after it), never lost between.
    """

    def __init__(self, count: int, wait_all: bool) -> None:
        self.decided: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting = count if wait_all else 1

    def answer(self, failure: BaseException | None) -> bool:
        """Record one child's status line; True when its failure became the response's."""
        if self.decided.done():
            return False
        if failure is not None:
            self.decided.set_exception(failure)
            return True
        self._waiting -= 1
        if self._waiting == 0:
            self.decided.set_result(None)
        return False

    def close(self) -> None:
        if self.decided.done() and not self.decided.cancelled():
            self.decided.exception()  # retrieved: a failure nobody awaited is not "never retrieved"


async def respond_stream(fanout: Fanout, request: web.Request) -> web.StreamResponse:
    """Streaming (docs/behaviour.md#streaming): 200 at the first child's answer, then chunks as
    they arrive."""
    plan = fanout.plan
    count = len(plan.children)
    config = fanout.runtime.config
    wait_all = config.stream_start == "all"
    if wait_all and count > fanout.upstream.max_concurrency:
        # stream_start: all: every child's status line comes before the 200, so every child must
        # run at once (docs/behaviour.md#stream-start).
        raise InvalidRequest(
            f"this stream needs {count} concurrent upstream requests; the upstream takes "
            f"{fanout.upstream.max_concurrency}: send fewer prompts or a smaller n",
            param="prompt" if plan.prompts > 1 else "n",
        )
    tickets = fanout.admit(count)
    mailbox = Mailbox(count)
    start = Start(count, wait_all)

    async def run_child(pos: int) -> None:
        replied = answered = False
        try:
            async with tickets[pos].place, fanout.send(pos, tickets[pos].url) as answer:
                replied = True
                response = answer.response
                fanout.answered(response.status)
                if response.status >= 300:
                    raise ChildFailed(response.status, await answer.read(), response.content_type)
                answered = True
                start.answer(None)
                decoder = SSEDecoder(max_event_bytes=fanout.max_event_bytes)

                def feed(data: bytes) -> None:
                    # Called from the upstream protocol as bytes arrive: no task hop per chunk.
                    events = decoder.feed_raw(data)
                    if events:
                        mailbox.put_nowait((pos, events))

                await answer.relay(feed, mailbox.full, mailbox.room)
                await mailbox.put((pos, decoder.close_raw()))
            await mailbox.put((pos, None))
        except (ProxyError, ChildFailed) as exc:
            if isinstance(exc, ProxyError) and not replied:
                fanout.answered(exc)  # no status line came
            if answered or not start.answer(exc):
                await mailbox.put((pos, exc))
        except (TimeoutError, HTTPClientError, ValueError) as exc:
            if answered or not start.answer(upstream_error(exc, fanout.upstream)):
                await mailbox.put((pos, exc))

    tasks = [fanout.runtime.spawn_child(run_child(pos)) for pos in range(count)]
    try:
        await start.decided
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": plan.parent_id,
            }
        )
        try:
            await response.prepare(request)  # the 200 leaves now, not with the first chunk
            if request.transport is None:
                raise ConnectionResetError("the client left")
            sink = client_sink(request, request.transport)
            stitcher = StreamStitcher(plan)
            fanout.runtime.streams.add(mailbox)
            try:
                await _merge(stitcher, mailbox, sink, config.sse_keepalive_seconds, fanout)
            finally:
                fanout.runtime.streams.discard(mailbox)
                fanout.usage = stitcher.usage()
                fanout.runtime.metrics.stitched_chunks.inc(stitcher.chunks)
            await response.write_eof()
        except ConnectionError:  # the client is gone (at the head, mid-stream, at the end)
            if request.transport is not None:
                request.transport.abort()
        return response
    finally:
        start.close()
        try:
            await fanout.cancel(tasks)
        finally:  # a second cancellation right here must not keep the places
            _release(tickets)


def _release(tickets: Sequence[Ticket]) -> None:
    """Every place back, granted or still queued: a task cancelled before it ran holds one too."""
    for ticket in tickets:
        ticket.place.release()


async def _merge(
    stitcher: StreamStitcher, mailbox: Mailbox, sink: Sink, seconds: float, fanout: Fanout
) -> None:
    """Write chunks as they arrive, then the merged tail or one error event.

    Everything one wake-up finds leaves in one write, straight into the client's transport;
    past its high-water mark the writer waits for the drain, and the children's reads stall
    behind the full mailbox. With nothing written for ``seconds`` (0: never), an SSE
    comment keeps load balancers from cutting a stream whose next child is still queued
    (docs/behaviour.md#keep-alive).
    """
    plan = stitcher.plan
    running = len(plan.children)
    write, full, drain = sink
    keepalive = PingTimer(mailbox, seconds)
    fanout.bytes_out = 0

    async def send(data: bytes) -> None:
        write(data)
        fanout.bytes_out = (fanout.bytes_out or 0) + len(data)
        keepalive.wrote()
        if full():
            await drain()

    try:
        while running:
            out: list[bytes] = []
            try:
                items = await mailbox.take()
                if items is None:
                    await send(PING)
                    continue
                if not items:
                    raise StreamError(None, mailbox.cut_reason or "cut")
                for pos, item in items:
                    if item is None:
                        running -= 1
                        if not stitcher.finished(pos):
                            index = plan.children[pos].index
                            raise StreamError(index, "stream ended before finishing")
                    elif isinstance(item, BaseException):
                        raise StreamError(plan.children[pos].index, _reason(item))
                    else:
                        for data, event in item:
                            chunk = stitcher.chunk(pos, data, event)
                            if chunk is not None:
                                out.append(chunk)
            except StreamError as error:
                out.append(error_event(error))
                await send(b"".join(out))
                return
            if out:
                if fanout.first_chunk_at is None:
                    fanout.first_chunk_at = time.perf_counter()
                await send(out[0] if len(out) == 1 else b"".join(out))
        await send(stitcher.tail())
    finally:
        keepalive.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ChildFailed):
        return f"upstream answered {exc.status}"
    if isinstance(exc, TimeoutError):
        return "upstream went idle (timeout)"
    if isinstance(exc, ProxyError):
        return exc.message
    if isinstance(exc, ValueError):
        return f"upstream stream is malformed: {exc}"
    return f"upstream connection broke ({type(exc).__name__})"


async def _all_or_first_failure(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Await all concurrently; raise the first failure as soon as it happens
    (docs/behaviour.md#errors).

    The caller cancels what is left, so that it can count the children it cut short.
    """
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    pending: set[asyncio.Future[T]] = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t in done and t.exception() is not None]
        if failed:
            error = failed[0].exception()
            assert error is not None
            raise error
    return [t.result() for t in tasks]


async def _cancel_all(tasks: Sequence[asyncio.Future[Any]]) -> int:
    """Cancel whatever still runs and wait for it to unwind; returns how many were cut short."""
    running = [t for t in tasks if not t.done()]
    if not running:  # the common end of a fan-out: nothing to wait for, only failures to read
        for task in tasks:
            if not task.cancelled():
                task.exception()
        return 0
    for task in running:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return len(running)
