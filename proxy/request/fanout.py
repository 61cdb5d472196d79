"""Running a planned fan-out: k concurrent children upstream, one stitched answer downstream.

The I/O shell around ``plan`` and ``stitch``: children run as tasks, each taking its own upstream
slot; every pending child is cancelled (its connection closed, its slot or place in line given
back) in a ``finally``, so nothing generates for a client that is gone. A stream's children hand
their events to its one writer (``proxy.request.writer.merge``, compiled) through its mailbox.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.config import Config, Upstream
from proxy.core import (
    MAX_EVENT_BYTES,
    ChildFailed,
    InvalidRequest,
    Plan,
    ProxyError,
    SSEDecoder,
    StreamStitcher,
    UpstreamUnavailable,
    body_facts,
    finish_reasons,
    stitch_json,
)
from proxy.http import HTTPClientError
from proxy.observe import ChildRecord, RequestRecord
from proxy.request.mailbox import Mailbox
from proxy.request.responses import WholeAnswer
from proxy.request.sink import client_sink
from proxy.request.writer import merge
from proxy.upstream import Exchange, Ticket, Tickets, UpstreamRequest, Upstreams, upstream_error

# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_json_loads: Final = orjson.loads
_json_dumps: Final = orjson.dumps

T = TypeVar("T")
# The upstream client stops reading a child's socket once it buffers twice this (inflated bytes
# included), and the mailbox holds at most one more read per child: what a child behind a slow
# client holds stays a few times this, however long its stream. The bench measures it, the
# client's write buffer included ("bytes held per child", bench/scenarios/memory.py).
CHILD_READ_BUFFER = 16 * 1024


class Fanouts:
    """Every running fan-out's children, counted as tasks until they are done, and the streams
    a drain can cut."""

    def __init__(self) -> None:
        self.children = 0
        self.streams: set[Mailbox] = set()

    def spawn(self, child: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A fan-out child as a task, counted until it is done, however it ends: a task
        cancelled before it ever ran has no ``finally`` of its own to count it out. Made with
        ``create_task``: ``ensure_future`` first asks whether the coroutine is a future, by a
        ``hasattr`` on its class that fails, formatting an AttributeError (2,000 instructions a
        child)."""
        task = asyncio.create_task(child)
        self.children += 1
        task.add_done_callback(self._child_done)
        return task

    def _child_done(self, task: asyncio.Task[Any]) -> None:
        self.children -= 1

    def cut_streams(self, reason: str) -> None:
        for stream in list(self.streams):
            stream.cut(reason)


@dataclass
class Fanout:
    """One fan-out request: where its children go and what they carry; what came of them is
    on its record (a ``ChildRecord`` per child)."""

    upstreams: Upstreams
    upstream: Upstream
    plan: Plan
    config: Config
    path_qs: str
    headers: CIMultiDict[str]  # end-to-end headers shared by every child
    record: RequestRecord
    fanouts: Fanouts
    client: str  # whose children these are: admission's line and cap
    children: list[ChildRecord] = field(init=False)

    def __post_init__(self) -> None:
        self.children = [self.record.child(c.index) for c in self.plan.children]

    @property
    def max_event_bytes(self) -> int:
        """One SSE line or event held for a child: within the cap on a child's JSON body."""
        return min(MAX_EVENT_BYTES, self.config.max_response_bytes)

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

    def admit(self) -> Tickets:
        """Each child's replica and place in the client's line (``Upstreams.admit``)."""
        return self.upstreams.admit(self.upstream, len(self.plan.children), self.client)

    def exchange(self, pos: int, ticket: Ticket) -> Exchange:
        """Child ``pos``'s upstream request, from its place in line to the end of its body."""
        request = UpstreamRequest(
            "POST", self.path_qs, self.child_headers(pos), self.plan.children[pos].body,
            inflate=True, read_bufsize=CHILD_READ_BUFFER,
        )  # fmt: skip
        return self.upstreams.exchange(ticket, request, self.children[pos])

    async def cancel(self, tasks: Sequence[asyncio.Future[Any]]) -> None:
        aborted = await _cancel_all(tasks)  # not `+= await`: mypyc fails on it (a record's
        self.record.aborted += aborted  # attribute read, then held across the suspension)


async def respond_json(fanout: Fanout) -> web.Response:
    """Non-streaming (docs/behaviour.md#json): wait for every child, fail fast on the first
    failure."""
    plan = fanout.plan
    # One slot per child, in the client's turns: a batch larger than max_concurrency runs in turns.
    tickets = fanout.admit()

    async def fetch(pos: int) -> dict[str, Any]:
        async with fanout.exchange(pos, tickets[pos]) as exchange:
            raw = await exchange.read()
            response = exchange.response
            if response.status >= 300:
                raise ChildFailed(response.status, raw, response.content_type)
        try:
            body = _json_loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            raise UpstreamUnavailable(
                f"upstream sent a body that is not a JSON object: {raw[:80]!r}"
            )
        return body

    tasks = [fanout.fanouts.spawn(fetch(pos)) for pos in range(len(tickets))]
    failure: BaseException | None = None
    try:
        bodies = await _all_or_first_failure(tasks)
    except BaseException as exc:  # held for after the cleanup, not a finally that awaits: _settle
        failure = exc
    try:
        await _settle(fanout, tasks, tickets)
        if failure is not None:
            raise failure
    finally:
        failure = None  # its traceback holds this frame: no reference cycle through it
    stitched = stitch_json(plan, bodies)
    record = fanout.record
    facts = body_facts(stitched)
    record.usage, record.response_id, record.response_model = facts.usage, facts.id, facts.model
    record.finish_reasons = finish_reasons(stitched)
    return WholeAnswer(
        body=_json_dumps(stitched),
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
    config = fanout.config
    wait_all = config.stream_start == "all"
    if wait_all and count > fanout.upstream.max_concurrency:
        # stream_start: all: every child's status line comes before the 200, so every child must
        # run at once (docs/behaviour.md#stream-start).
        raise InvalidRequest(
            f"this stream needs {count} concurrent upstream requests; the upstream takes "
            f"{fanout.upstream.max_concurrency}: send fewer prompts or a smaller n",
            param="prompt" if plan.prompts > 1 else "n",
        )
    tickets = fanout.admit()
    mailbox = Mailbox(count)
    start = Start(count, wait_all)

    async def run_child(pos: int) -> None:
        answered = False
        failure: BaseException | None = None
        try:
            async with fanout.exchange(pos, tickets[pos]) as exchange:
                response = exchange.response
                if response.status >= 300:
                    raise ChildFailed(response.status, await exchange.read(), response.content_type)
                answered = True
                start.answer(None)
                decoder = SSEDecoder(max_event_bytes=fanout.max_event_bytes)
                feed = mailbox.feeder(pos, decoder)
                await response.relay(feed, mailbox.full, mailbox.room)
                await mailbox.put((pos, decoder.close_raw()))
            await mailbox.put((pos, None))
        except (ProxyError, ChildFailed) as exc:
            if answered or not start.answer(exc):
                failure = exc
        except (TimeoutError, HTTPClientError, ValueError) as exc:
            if answered or not start.answer(upstream_error(exc, fanout.upstream)):
                failure = exc
        if failure is not None:
            # Put after the handler, not in it: a full mailbox parks the put, and a compiled
            # handler must not span a suspension (_settle says why).
            try:
                await mailbox.put((pos, failure))
            finally:
                failure = None  # its traceback holds this frame: no reference cycle through it

    tasks = [fanout.fanouts.spawn(run_child(pos)) for pos in range(count)]
    failure: BaseException | None = None
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
            sink = client_sink(request, fanout.record, first_chunk=False)
            stitcher = StreamStitcher(plan)
            streams = fanout.fanouts.streams
            streams.add(mailbox)
            try:
                await merge(stitcher, mailbox, sink, config.sse_keepalive_seconds, fanout.record)
            finally:
                sink.settle()
                streams.discard(mailbox)
                fanout.record.usage = stitcher.usage()
                fanout.record.response_id, fanout.record.response_model = stitcher.answered()
                fanout.record.finish_reasons = stitcher.finish_reasons()
                fanout.record.chunks = stitcher.chunks
            await response.write_eof()
        except ConnectionError:  # the client is gone (at the head, mid-stream, at the end)
            if request.transport is not None:
                request.transport.abort()
    except BaseException as exc:  # held for after the cleanup, not a finally that awaits: _settle
        failure = exc
    start.close()
    try:
        await _settle(fanout, tasks, tickets)
        if failure is not None:
            raise failure
    finally:
        failure = None  # its traceback holds this frame: no reference cycle through it
    return response


async def _settle(fanout: Fanout, tasks: Sequence[asyncio.Future[Any]], tickets: Tickets) -> None:
    """A fan-out's end, however it came: the children still running cancelled and waited for,
    every place given back.

    The responders hold a failure in a variable across this await and raise it after, rather
    than await this in a ``finally``: in a coroutine mypyc compiles, a ``finally`` that awaits
    keeps the exception it is handling in the thread's ``sys.exc_info()``, never puts back what
    was there, and once its body is done re-raises whatever ``sys.exc_info()`` then holds, even
    when nothing failed. A cancellation thrown in (a client gone) thus stayed in the thread for
    good, and every later fan-out, in any request, ended by raising that old ``CancelledError``
    (docs/architecture.md#working-on-a-compiled-module).
    """
    try:
        await fanout.cancel(tasks)
    finally:  # a second cancellation right here must not keep the places (no await in here)
        tickets.release()


async def _all_or_first_failure(tasks: Sequence[asyncio.Future[T]]) -> list[T]:
    """Await all concurrently; raise the first failure as soon as it happens
    (docs/behaviour.md#errors).

    The caller cancels what is left, so that it can count the children it cut short. What
    ``asyncio.wait(..., return_when=FIRST_EXCEPTION)`` does, without its argument checks: one
    asks ``hasattr`` of a set's class, which fails and formats an AttributeError each fan-out.
    """
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    left = len(tasks)

    def ended(task: asyncio.Future[T]) -> None:
        nonlocal left
        left -= 1
        if waiter.done():
            return
        if left == 0 or (not task.cancelled() and task.exception() is not None):
            waiter.set_result(None)

    for task in tasks:
        task.add_done_callback(ended)
    try:
        if left:
            await waiter
    finally:
        for task in tasks:
            task.remove_done_callback(ended)
    for task in tasks:
        if task.done() and task.exception() is not None:
            error = task.exception()
            assert error is not None
            raise error
    return [task.result() for task in tasks]


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
