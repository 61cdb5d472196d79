"""One upstream response: its head at once, its body iterated or relayed, inflated in bounded steps.

The parser side (``proxy.http.connection``) hands body bytes in; the consumer takes them out, either
as an async iterator (fan-out JSON) or through a sink called from ``data_received`` (relays: no
task, queue or iterator per chunk). Nothing is held further than ``limit`` bytes ahead of the
consumer, compressed input included: reading pauses instead. The idle clock runs only while the
proxy waits on the upstream, never while it waits on its own client.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from multidict import CIMultiDict

from proxy.core.encoding import INFLATED, Inflater
from proxy.core.futures import settle, wake
from proxy.http.errors import BadResponse, BodyTooLong, ResponseTimeout

BodySink = Callable[[bytes], None]


class Reading(Protocol):
    """What a response needs of its connection (``proxy.http.connection.UpstreamConnection``)."""

    loop: asyncio.AbstractEventLoop
    paused: bool

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def abort(self) -> None: ...


class UpstreamResponse:
    def __init__(self, connection: Reading, method: str, limit: int, inflate: bool) -> None:
        self._connection = connection
        self._loop = connection.loop
        self.method = method
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        # A header value or the reason held bytes that are not UTF-8: see proxy.sink.ExactHead.
        self.escaped = False
        self._limit = limit
        self._inflate = inflate
        self._inflater: Inflater | None = None
        self.head: asyncio.Future[None] = self._loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._waiting_since: float | None = None
        self.ended = False  # every byte of the message arrived
        self.complete = False  # ... and every body byte was handed on
        self.error: BaseException | None = None
        self.sink: BodySink | None = None  # set by ``relay``: bytes go there as they arrive
        self._sink_paused: Callable[[], bool] | None = None
        self._relay_done: asyncio.Future[None] | None = None
        self._out: list[bytes] = []
        self.last_data = 0.0
        self._idle = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self.until_close = False  # a body delimited by the connection closing

    @property
    def content_type(self) -> str:
        raw = self.headers.get("Content-Type")
        if not raw:
            return "application/octet-stream"
        return raw.split(";", 1)[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        """The body's length as the consumer will see it, when known."""
        raw = self.headers.get("Content-Length")
        if raw is None or self._inflater is not None:
            return None
        try:
            return int(raw)
        except ValueError:
            return None

    # ---- parser side (called from UpstreamConnection.data_received)

    def on_head(self, status: int, until_close: bool) -> None:
        self.status = status
        self.until_close = until_close
        if self._inflate:
            coding = self.headers.get("Content-Encoding", "").strip().lower()
            if coding in INFLATED:
                self._inflater = Inflater(coding)
            elif coding not in ("", "identity"):
                self.fail(BadResponse(f"cannot decode Content-Encoding {coding}"))
                return
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, data: bytes) -> None:
        if self._inflater is not None:
            self._inflater.feed(data)  # inflated after this read, as far as there is room
        elif self.sink is not None:
            self._out.append(data)
        else:
            self._chunks.append(data)
            self._buffered += len(data)
            if self._buffered > self._limit:
                self._connection.pause()
            wake(self._waiter)

    def on_end(self) -> None:
        """The message's last byte arrived (the connection's end, for a close-delimited body)."""
        self.ended = True
        if self._inflater is None:
            self._completed()
        # else: complete once the last input is inflated (``_pump``)

    def after_read(self) -> None:
        """After one ``data_received``: relayed pieces leave in one write, input is inflated."""
        out = self._out
        if out:  # only a relay fills it
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            self._to_sink(data)
        if self._inflater is not None:
            self._pump()

    def _to_sink(self, data: bytes) -> None:
        assert self.sink is not None
        try:
            self.sink(data)
        except Exception as exc:  # e.g. a malformed stream: the relay raises it
            self.fail(exc)
            return
        paused = self._sink_paused
        if paused is not None and paused():
            self._connection.pause()
            if self._relay_done is not None:
                settle(self._relay_done)  # wakes the relay's task to wait for the drain

    def _pump(self) -> None:
        """Inflate what the consumer has room for; reading waits while input is left over."""
        inflater = self._inflater
        assert inflater is not None
        try:
            if self.sink is not None:
                paused = self._sink_paused
                while inflater.pending and self.error is None:
                    if paused is not None and paused():
                        break
                    data = inflater.read(self._limit)
                    if data:
                        self._to_sink(data)
            else:
                while inflater.pending and self._buffered < self._limit:
                    data = inflater.read(self._limit - self._buffered)
                    if data:
                        self._chunks.append(data)
                        self._buffered += len(data)
                        wake(self._waiter)
            if inflater.pending:
                self._connection.pause()
            elif self.ended and not self.complete and self.error is None:
                tail = inflater.close()
                if tail:
                    if self.sink is not None:
                        self._to_sink(tail)
                    else:
                        self._chunks.append(tail)
                        self._buffered += len(tail)
                self._completed()
        except zlib.error as exc:
            self.fail(BadResponse(f"bad compressed body: {exc}"))

    def _completed(self) -> None:
        if self.error is not None:
            return
        self.complete = True
        self._stop_idle()
        if self._relay_done is not None:
            settle(self._relay_done)
        wake(self._waiter)

    def fail(self, exc: BaseException) -> None:
        if self.complete or self.error is not None:
            return
        self.error = exc
        self._stop_idle()
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved here: the caller may have stopped waiting
        if self._relay_done is not None:
            settle(self._relay_done, exc)
        wake(self._waiter)
        self._connection.abort()

    # ---- head and timeouts

    async def wait_head(self, first_byte: float) -> None:
        timer = self._loop.call_later(
            first_byte,
            self.fail,
            ResponseTimeout(f"no response head from upstream within {first_byte} s"),
        )
        try:
            await self.head
        finally:
            timer.cancel()

    def start_idle(self, idle: float) -> None:
        self._idle = idle
        self.last_data = self._loop.time()
        if not self.complete and self.error is None:
            self._idle_timer = self._loop.call_later(idle, self._check_idle)

    def _stop_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_since(self) -> float | None:
        """When the idle clock started, or None while it is stopped."""
        if self.ended:
            return None  # the upstream said all it had: what is left is the consumer's
        if self.sink is not None:
            return None if self._connection.paused else self.last_data
        if self._chunks or self._waiter is None:
            return None  # the consumer is busy elsewhere: not the upstream's silence
        return self._waiting_since

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self.complete or self.error is not None:
            return
        since = self._idle_since()
        now = self._loop.time()
        if since is not None and now - since >= self._idle:
            self.fail(ResponseTimeout(f"no data from upstream for {self._idle} s"))
            return
        start = since if since is not None else now
        self._idle_timer = self._loop.call_at(start + self._idle, self._check_idle)

    # ---- iterator mode

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        inflater = self._inflater
        while not self._chunks:
            if self.error is not None:
                raise self.error
            if inflater is not None and inflater.pending:
                self._pump()
                continue
            if self.complete:
                raise StopAsyncIteration
            self._connection.resume()
            self._waiter = self._loop.create_future()
            self._waiting_since = self._loop.time()
            try:
                await self._waiter
            finally:
                self._waiter = None
                self._waiting_since = None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if inflater is None or not inflater.pending:
            self._connection.resume()
        return data

    async def read(self, limit: int) -> bytes:
        return await read_capped(self, limit)

    # ---- relay mode

    async def relay(
        self, sink: BodySink, paused: Callable[[], bool], drain: Callable[[], Awaitable[None]]
    ) -> None:
        """Hand every body byte to ``sink`` from ``data_received``, until the body ends.

        ``paused`` says the sink's buffer is full; this task then awaits ``drain()`` and
        resumes reading. ``drain`` must suspend until there is room, or raise (the sink's
        client is gone, which ends the relay at once): one that returns at once while the
        sink stays full would spin this loop and freeze the event loop. Raises the body's
        failure; cancelling it aborts the connection.
        """
        self.sink = sink
        self._sink_paused = paused
        if self._chunks:  # anything read before the relay began
            data = b"".join(self._chunks)
            self._chunks.clear()
            self._buffered = 0
            self._to_sink(data)
        inflater = self._inflater
        while True:
            if self.error is not None:
                raise self.error
            if self.complete:
                return
            if paused():
                self._connection.pause()
                await drain()
                self.last_data = self._loop.time()  # the idle clock stood still meanwhile
                continue
            if inflater is not None and inflater.pending:
                self._pump()
                continue
            self._connection.resume()
            self._relay_done = self._loop.create_future()
            try:
                await self._relay_done
            finally:
                self._relay_done = None


async def read_capped(body: AsyncIterator[bytes], limit: int) -> bytes:
    """A whole body; ``BodyTooLong`` the moment it grows past ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in body:
        size += len(chunk)
        if size > limit:
            raise BodyTooLong(size)
        chunks.append(chunk)
    return b"".join(chunks)
