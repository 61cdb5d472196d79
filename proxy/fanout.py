"""Running a planned fan-out: k concurrent children upstream, one stitched answer downstream.

The I/O shell around ``plan`` and ``stitch``: children run as tasks, every pending child is
cancelled (its connection closed) in a ``finally``, so nothing generates for a client that is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.config import Upstream
from proxy.errors import ChildFailed, ProxyError, UpstreamUnavailable
from proxy.plan import Plan
from proxy.sse import Event, SSEDecoder
from proxy.stitch import StreamError, StreamStitcher, error_event, stitch_json
from proxy.upstream import UpstreamPool, upstream_error

T = TypeVar("T")
_END = None  # a child's stream ended cleanly


@dataclass(frozen=True)
class Fanout:
    """One fan-out request: where its children go and what they carry."""

    pool: UpstreamPool
    upstream: Upstream
    plan: Plan
    path_qs: str
    headers: CIMultiDict[str]  # end-to-end headers shared by every child

    def child_headers(self, pos: int) -> CIMultiDict[str]:
        headers = self.headers.copy()
        headers["X-Request-Id"] = self.plan.children[pos].request_id
        headers["Content-Type"] = "application/json"
        return headers


async def respond_json(fanout: Fanout) -> web.Response:
    """Non-streaming (SPEC §4): wait for every child, fail fast on the first failure."""
    plan = fanout.plan
    urls = fanout.pool.place(fanout.upstream, len(plan.children))

    async def fetch(pos: int) -> dict[str, Any]:
        child = plan.children[pos]
        async with fanout.pool.send(
            fanout.upstream, urls[pos], "POST", fanout.path_qs, fanout.child_headers(pos),
            child.body, decompress=True,
        ) as response:  # fmt: skip
            try:
                raw = await response.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise upstream_error(exc, fanout.upstream) from None
            if response.status >= 300:
                raise ChildFailed(response.status, raw, response.content_type)
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = None
            if not isinstance(body, dict):
                raise UpstreamUnavailable(
                    f"upstream sent a body that is not a JSON object: {raw[:80]!r}"
                )
            return body

    async with fanout.pool.slots(fanout.upstream, len(plan.children)):
        bodies = await _all_or_first_failure([fetch(pos) for pos in range(len(urls))])
    return web.Response(
        body=orjson.dumps(stitch_json(plan, bodies)),
        content_type="application/json",
        headers={"X-Request-Id": plan.parent_id},
    )


async def respond_stream(fanout: Fanout, request: web.Request) -> web.StreamResponse:
    """Streaming (SPEC §5): every child's headers first, then chunks interleaved as they arrive."""
    plan = fanout.plan
    count = len(plan.children)
    urls = fanout.pool.place(fanout.upstream, count)
    # Bounded: a child can run at most one read ahead of a slow client (backpressure, STYLE).
    queue: asyncio.Queue[tuple[int, list[Event] | BaseException | None]] = asyncio.Queue(count)
    headers_in = [asyncio.get_running_loop().create_future() for _ in range(count)]

    async def run_child(pos: int) -> None:
        child = plan.children[pos]
        try:
            async with fanout.pool.send(
                fanout.upstream, urls[pos], "POST", fanout.path_qs, fanout.child_headers(pos),
                child.body, decompress=True,
            ) as response:  # fmt: skip
                if response.status >= 300:
                    raise ChildFailed(response.status, await response.read(), response.content_type)
                if not headers_in[pos].done():  # done already if a sibling failed first
                    headers_in[pos].set_result(None)
                decoder = SSEDecoder()
                async for data in response.content.iter_any():
                    events = decoder.feed(data)
                    if events:
                        await queue.put((pos, events))
                await queue.put((pos, decoder.close()))
                await queue.put((pos, _END))
        except (ProxyError, ChildFailed) as exc:
            if not headers_in[pos].done():
                headers_in[pos].set_exception(exc)
            else:
                await queue.put((pos, exc))
        except (TimeoutError, aiohttp.ClientError) as exc:
            if not headers_in[pos].done():
                headers_in[pos].set_exception(upstream_error(exc, fanout.upstream))
            else:
                await queue.put((pos, exc))

    async with fanout.pool.slots(fanout.upstream, count):
        tasks = [asyncio.create_task(run_child(pos)) for pos in range(count)]
        try:
            await _all_or_first_failure(headers_in)
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Request-Id": plan.parent_id,
                }
            )
            await response.prepare(request)
            await _merge(plan, queue, response)
            await response.write_eof()
            return response
        finally:
            for future in headers_in:
                if future.done() and not future.cancelled():
                    future.exception()  # retrieved: a sibling's failure is not "never retrieved"
            await _cancel_all(tasks)


async def _merge(
    plan: Plan,
    queue: asyncio.Queue[tuple[int, list[Event] | BaseException | None]],
    response: web.StreamResponse,
) -> None:
    stitcher = StreamStitcher(plan)
    running = len(plan.children)
    while running:
        out: list[bytes] = []
        pos, item = await queue.get()
        try:
            while True:
                if item is _END:
                    running -= 1
                    if not stitcher.finished(pos):
                        raise StreamError(plan.children[pos].index, "stream ended before finishing")
                elif isinstance(item, BaseException):
                    raise StreamError(plan.children[pos].index, _reason(item))
                else:
                    for event in item:
                        chunk = stitcher.chunk(pos, event.data, event.event)
                        if chunk is not None:
                            out.append(chunk)
                if queue.empty():
                    break
                pos, item = queue.get_nowait()  # coalesce what is already here into one write
        except StreamError as error:
            out.append(error_event(error))
            await response.write(b"".join(out))
            return
        if out:
            await response.write(b"".join(out))
    await response.write(stitcher.tail())


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ChildFailed):
        return f"upstream answered {exc.status}"
    if isinstance(exc, TimeoutError):
        return "upstream went idle (timeout)"
    if isinstance(exc, ProxyError):
        return exc.message
    return f"upstream connection broke ({type(exc).__name__})"


async def _all_or_first_failure(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Await all concurrently; on the first failure cancel the rest and raise it (SPEC §7)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        pending: set[asyncio.Future[T]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t in done and t.exception() is not None]
            if failed:
                error = failed[0].exception()
                assert error is not None
                raise error
        return [t.result() for t in tasks]
    finally:
        await _cancel_all(tasks)


async def _cancel_all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
