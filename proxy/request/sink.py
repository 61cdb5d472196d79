"""The client's side of every relayed and stitched chunk: writing a response body straight into
the client's transport, past aiohttp's writer, and a fan-out stream's one writer; compiled with
the rest of the stream path (setup.py).

The relay (pass-through) and the stitched stream (fan-out) both write here: one
``transport.write`` per piece, chunked framing done in place, no coroutine per chunk. What the
request's record needs (the bytes written, the first write's time) is kept by ``BodyWriter``
and handed to the record once, when the body is over (``Sink.settle``): no attribute of a
Python object is touched per chunk. "The client left" is ``ClientGone``. The response's head is
aiohttp's, sent first; its ``write_eof`` still ends the body.

A stream's children hand their events to its writer (``merge``) through a bounded ``Mailbox``,
fed from the upstream protocol as bytes arrive (``Mailbox.feeder``), so backpressure reaches the
upstream; a ``PingTimer`` wakes the writer to send a keep-alive when nothing was written for a
while.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import NamedTuple, Protocol

from aiohttp import web

from proxy.core.errors import ChildFailed, ClientGone, ProxyError
from proxy.core.sse import RawEvent, SSEDecoder
from proxy.core.stitch import StreamError, StreamStitcher, error_event
from proxy.observe.record import RequestRecord


class Sink(NamedTuple):
    write: Callable[[bytes], bool]  # True when ``full`` after this write: the one test per chunk
    full: Callable[[], bool]  # the transport's high-water mark, or the client gone
    # Until below the low-water mark again; raises ConnectionResetError once the client is
    # gone. Never returns while the sink is full without having suspended: a writer loops
    # on ``if full(): await drain()``, and a drain that neither waits nor raises spins it.
    drain: Callable[[], Awaitable[None]]
    # The bytes written and the first write's time onto the record: once the body is over,
    # whatever ended it (a second call changes nothing).
    settle: Callable[[], None]
    # Writes whole chunks in chunked framing as they are (a relay's, from a chunked upstream),
    # with their body bytes' count; None when the response is not chunked.
    framed: Callable[[bytes, int], bool] | None


def client_sink(request: web.Request, record: RequestRecord, *, first_chunk: bool) -> Sink:
    """For a response already prepared: its body's bytes go to the client's transport directly
    (``BodyWriter``), counted for ``record`` (``bytes_out``) and, with ``first_chunk``, the
    first one's time kept (a fan-out stream stamps its first stitched chunk itself: a
    keep-alive ping is not one); ``settle`` hands both to ``record``.

    Writing or draining once the client is gone raises ``ClientGone``, the error callers
    handle. A write that finds the client's socket reset marks the transport closing at once
    and runs ``connection_lost`` only later: aiohttp's ``drain`` would return at once meanwhile
    (it waits only while the protocol is paused), so the check here comes first.
    """
    transport = request.transport
    if transport is None:
        raise ClientGone()
    writer = request.writer
    send_headers = getattr(writer, "send_headers", None)  # aiohttp >= 3.12 holds the head back
    if send_headers is not None:
        send_headers()
    protocol = request.protocol
    closing = transport.is_closing
    high = transport.get_write_buffer_limits()[1]
    chunked = bool(getattr(writer, "chunked", False))
    body = BodyWriter(transport, high, chunked, first_chunk)
    before = record.bytes_out or 0

    def full() -> bool:
        return protocol.writing_paused or closing()

    drain_writer = writer.drain

    async def drain() -> None:
        if closing():
            raise ClientGone()
        await drain_writer()  # suspends: not closing and full means the protocol is paused

    def settle() -> None:
        record.bytes_out = before + body.written
        if body.first_at >= 0 and record.first_chunk_at is None:
            record.first_chunk_at = body.first_at

    return Sink(body.write, full, drain, settle, body.write_framed if chunked else None)


class Transport(Protocol):
    """What the writer uses of an ``asyncio.WriteTransport``."""

    def write(self, data: bytes) -> None: ...
    def is_closing(self) -> bool: ...
    def get_write_buffer_size(self) -> int: ...


class BodyWriter:
    """Writes a body into ``transport``, framed as chunks when ``chunked``. Each write says
    whether the transport is past its high-water mark ``high`` or closing now: the one test
    per chunk. With ``stamp``, the first write's time is kept (``first_at``, else -1)."""

    def __init__(self, transport: Transport, high: int, chunked: bool, stamp: bool) -> None:
        self._transport = transport
        self._high = high
        self._chunked = chunked
        self._stamp = stamp
        self.written = 0  # body bytes, not the chunked framing's
        self.first_at = -1.0

    def write(self, data: bytes) -> bool:
        """Once the client is gone this raises ``ClientGone`` (uvloop itself would raise
        ``RuntimeError`` on a transport whose connection is lost). A write that finds the
        client's socket reset marks the transport closing at once, and the connection is lost
        only later: so the check comes first, and closing counts as full."""
        size = len(data)
        return self.write_framed(b"%x\r\n%b\r\n" % (size, data) if self._chunked else data, size)

    def write_framed(self, data: bytes, size: int) -> bool:
        """``data`` as it goes on the wire, holding ``size`` body bytes: from ``write``, or
        whole chunks in chunked framing already (to a chunked response only). As ``write``."""
        transport = self._transport
        if transport.is_closing():
            raise ClientGone()
        if self._stamp:
            self._stamp = False
            self.first_at = perf_counter()
        self.written += size
        transport.write(data)
        return transport.get_write_buffer_size() > self._high or transport.is_closing()


# ---- a fan-out stream's writer, and the hand-off from its children to it


async def merge(
    stitcher: StreamStitcher, mailbox: Mailbox, sink: Sink, seconds: float, record: RequestRecord
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
    write, drain = sink.write, sink.drain
    keepalive = PingTimer(mailbox, seconds, running)

    async def send(data: bytes) -> None:
        now_full = write(data)  # counted for the record by the sink
        keepalive.wrote()
        if now_full:
            await drain()

    try:
        while running:
            out: list[bytes] = []
            pulse: bytes | None = None  # a child's comment, to pass on when nothing else goes
            try:
                items = await mailbox.take()
                if items is None:
                    await send(PING)
                    continue
                if not items:
                    raise StreamError(None, mailbox.cut_reason or "cut")
                for pos, item in items:
                    if isinstance(item, list):
                        for data, event in item:
                            chunk = stitcher.chunk(pos, data, event)
                            if chunk is not None:
                                out.append(chunk)
                    elif item is None:
                        running -= 1
                        if not stitcher.finished(pos):
                            index = plan.children[pos].index
                            raise StreamError(index, "stream ended before finishing")
                    elif isinstance(item, bytes):
                        if keepalive.heard(pos) and pulse is None:
                            pulse = item + b"\n\n" if len(item) <= MAX_COMMENT_BYTES else PING
                    else:
                        raise StreamError(plan.children[pos].index, _reason(item))
            except StreamError as error:
                out.append(error_event(error))
                await send(b"".join(out))
                return
            if out:
                if record.first_chunk_at is None:
                    record.first_chunk_at = perf_counter()
                await send(out[0] if len(out) == 1 else b"".join(out))
            # A pulse is stamped by ``heard``: a ``send`` would stamp it later.
            elif pulse is not None and write(pulse):
                await drain()
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


# A child's events, a comment line it sent, a failure, or None: the child ended cleanly.
Item = list[RawEvent] | bytes | BaseException | None
PING = b": keep-alive\n\n"  # an SSE comment: load balancers see bytes, clients ignore it
MAX_COMMENT_BYTES = 1024  # a child's comment passed on as it is; a longer one as ``PING``


def _wake(future: asyncio.Future[None] | None) -> None:
    """Let the task parked on ``future`` run on; a future already done is left as it is."""
    if future is not None and not future.done():
        future.set_result(None)


class Mailbox:
    """A bounded hand-off from the child tasks to the one writer.

    Bounded so a slow client stalls the children's reads (backpressure reaches the upstream);
    ``cut`` wakes the writer at once, for a drain that has run out of time.
    """

    def __init__(self, size: int) -> None:
        self._items: deque[tuple[int, Item]] = deque()
        self._size = size
        self._getter: asyncio.Future[None] | None = None
        self._putters: deque[asyncio.Future[None]] = deque()
        self.cut_reason: str | None = None
        self._pinged = False

    async def put(self, item: tuple[int, Item]) -> None:
        while len(self._items) >= self._size:
            await self._taken()
        self.put_nowait(item)

    def feeder(self, pos: int, decoder: SSEDecoder) -> Callable[[bytes], bool]:
        """What child ``pos``'s upstream reads are fed to, as they arrive (no task hop per
        chunk): its events, or a comment line when a read holds no event, go in; returns
        ``full()``."""

        def feed(data: bytes) -> bool:
            events = decoder.feed_raw(data)
            if events:
                return self.put_nowait((pos, events))
            if decoder.comment is not None:  # only a read with no event looks
                comment, decoder.comment = decoder.comment, None
                return self.put_nowait((pos, comment))
            return self.full()

        return feed

    def full(self) -> bool:
        """Over the bound: as ``put`` blocks, one item per child may wait without a pause."""
        return len(self._items) > self._size

    def put_nowait(self, item: tuple[int, Item]) -> bool:
        """Past the bound by at most one item per child: its reader pauses until ``room``,
        so a child behind a slow client still holds about one read in the proxy. Returns
        ``full()``."""
        items = self._items
        items.append(item)
        _wake(self._getter)
        return len(items) > self._size

    async def room(self) -> None:
        """Until the mailbox is back within its bound."""
        while self.full():
            await self._taken()

    async def _taken(self) -> None:
        """Until the writer next takes what is waiting."""
        putter = asyncio.get_running_loop().create_future()
        self._putters.append(putter)
        try:
            await putter
        finally:
            if putter in self._putters:
                self._putters.remove(putter)

    async def take(self) -> list[tuple[int, Item]] | None:
        """Everything waiting (at least one item), [] once cut, None when woken by ``ping``."""
        if not self._items and self.cut_reason is None and not self._pinged:
            getter = self._getter = asyncio.get_running_loop().create_future()
            await getter
        if self.cut_reason is not None:
            return []
        self._pinged = False
        if not self._items:
            return None
        items = list(self._items)
        self._items.clear()
        while self._putters:
            _wake(self._putters.popleft())
        return items

    def ping(self) -> None:
        """Wake the writer with nothing to take (its keep-alive is due)."""
        self._pinged = True
        _wake(self._getter)

    def cut(self, reason: str) -> None:
        self.cut_reason = reason
        _wake(self._getter)


class PingTimer:
    """Pings the mailbox after ``seconds`` with nothing written (0: never), and decides which of
    the children's own comments reach the client (docs/behaviour.md#keep-alive).

    One timer per stream, moved on lazily when it fires: a write costs a clock read, not a
    timer of its own. A child's comment passes when nothing was written since that child's
    previous one (or since the stream began): with every child pulsing at the server's
    interval and nothing else to send, the client gets one comment per interval, not one per
    child; once chunks flow, none.
    """

    def __init__(self, mailbox: Mailbox, seconds: float, children: int) -> None:
        self._mailbox = mailbox
        self._seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._written_at = self._loop.time()
        self._heard = [self._written_at] * children  # each child's previous comment
        self._timer: asyncio.TimerHandle | None = None
        if seconds:
            self._timer = self._loop.call_at(self._written_at + seconds, self._check)

    def wrote(self) -> None:
        self._written_at = self._loop.time()

    def heard(self, pos: int) -> bool:
        """Child ``pos`` sent a comment: True when the client should get one now, which the
        caller then writes (or chunks in its place); it counts as written at this moment."""
        now = self._loop.time()
        quiet = self._written_at <= self._heard[pos]
        self._heard[pos] = now
        if quiet:
            self._written_at = now  # the same instant: this child's next comment may pass too
        return quiet

    def _check(self) -> None:
        now = self._loop.time()
        due = self._written_at + self._seconds
        if now >= due:
            self._mailbox.ping()
            due = now + self._seconds
        self._timer = self._loop.call_at(due, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
