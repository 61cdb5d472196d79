"""The response on an upstream connection (``UpstreamResponse``): its head at once, its body
iterated or relayed, inflated in bounded steps. The connection's parser
(``proxy.http.connection``) hands body bytes in; the consumer takes them out, either as an async
iterator (fan-out JSON) or through a sink called from ``data_received`` (relays: no task, queue
or iterator per chunk). A read of nothing but whole chunks, from between two, skips the parser
(``proxy.http.chunks``): to a relay whose client is chunked too, it goes on as it came. Nothing
is held further than ``limit`` bytes ahead of the consumer, compressed input included: reading
pauses instead. The idle clock runs only while the proxy waits on the upstream, never while it
waits on its own client. Failures are ``proxy.http.errors``'.

A response is in one ``ResponseState`` at a time, and read in one ``Mode``::

    HEAD ──head──▶ BODY ──last byte in──▶ ENDED ──last byte handed on──▶ COMPLETE
    any but COMPLETE ──fail──▶ FAILED           (without inflation, ENDED is COMPLETE at once)
    ITERATE ──relay()──▶ RELAY
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from enum import IntEnum
from typing import Final, Protocol

from multidict import CIMultiDict, CIMultiDictProxy, istr
from mypy_extensions import mypyc_attr

from proxy.core import INFLATED, Inflater
from proxy.http.chunks import BodyPiece, chunk_payload, chunk_pieces
from proxy.http.errors import BadResponse, BodyTooLong, Disconnected, ResponseTimeout


def _wake(future: asyncio.Future[None] | None) -> None:
    """Let whoever waits on ``future`` run on; a future already done is left as it is."""
    if future is not None and not future.done():
        future.set_result(None)


# Takes relayed bytes; True when it is full now, so reading pauses until its drain (one call
# per read: the write and the test that follows it are one).
BodySink = Callable[[bytes], bool]

# The loop's clock, shared: uvloop's loop time and asyncio's are CLOCK_MONOTONIC's, in whole
# milliseconds for uvloop, so a timer set from it fires no earlier than meant. A method bound
# for each response was an object of its own, a cache miss on every read of 1,000 streams.
_monotonic: Final = time.monotonic


@mypyc_attr(allow_interpreted_subclasses=True)  # the tests' own
class FramedSink:
    """The same as a ``BodySink`` for bytes that are whole chunks in chunked framing, as the
    upstream sent them, with the number of body bytes they hold: a relay to a chunked client
    writes them on as they are. A class, which ``proxy.request.sink.BodyWriter`` is, so that the
    compiled relay calls it directly: a bound method was an object of its own to read per chunk
    (docs/performance.md, "What 1,000 streams miss")."""

    def write_framed(self, data: bytes, size: int) -> bool:
        raise NotImplementedError


class ResponseState(IntEnum):
    HEAD = 0  # waiting for the head
    BODY = 1  # the head is in; the body arrives
    ENDED = 2  # every byte of the message arrived; inflated bytes are still to be handed on
    COMPLETE = 3  # every body byte was handed on (buffered for the iterator, or to the sink)
    FAILED = 4  # ``error`` says why


class Mode(IntEnum):
    ITERATE = 0  # body bytes are buffered (up to ``limit``) for ``__anext__``
    RELAY = 1  # body bytes go to the sink from ``data_received`` (``relay``)


# ``UpstreamResponse.state`` and ``.mode`` hold these plain ints, compared on every read: an enum
# member's lookup and an IntEnum's comparison each cost more than the int comparison itself.
# Final literals, so that the compiled build inlines them (a module global is a dict lookup);
# tests/http/test_pool.py checks that each equals its member.
# Header names as multidict's own strings: their lower case, for a lookup, is made once.
_CONTENT_TYPE: Final = istr("Content-Type")
_CONTENT_LENGTH: Final = istr("Content-Length")
_CONTENT_ENCODING: Final = istr("Content-Encoding")

HEAD: Final = 0
BODY: Final = 1
ENDED: Final = 2
COMPLETE: Final = 3
FAILED: Final = 4
ITERATE: Final = 0
RELAY: Final = 1


class Reading(Protocol):
    """What a response needs of its connection (``proxy.http.connection.UpstreamConnection``)."""

    loop: asyncio.AbstractEventLoop
    paused: bool

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def abort(self) -> None: ...


def _never() -> bool:
    return False


def _nowhere(data: bytes) -> bool:
    raise AssertionError("a body relayed before relay() began")


def _ignore(data: bytes) -> None:
    """A body piece for a response that is over."""


# What a response holds as its headers before its head arrives: one read-only, empty, for all.
_NO_HEADERS: Final = CIMultiDictProxy(CIMultiDict[str]())


class UpstreamResponse:
    def __init__(self, connection: Reading, method: str, limit: int, inflate: bool) -> None:
        # First what a relay reads on every read, side by side at the object's start: a field
        # further in can be a cache line of its own, missed on each read of 1,000 streams.
        self.mode = ITERATE  # a Mode, as its int
        self._framed: FramedSink | None = None  # RELAY: where whole chunks go as they came
        self._sink: BodySink = _nowhere  # RELAY: where bytes go as they arrive
        self._inflater: Inflater | None = None
        self.last_data = 0.0  # RELAY: when bytes last came
        self._pieces = False  # RELAY: ``_out`` holds pieces (read without touching the list)
        self.state = HEAD  # a ResponseState, as its int
        self.connection = connection  # the one it arrives on, for ``ConnectionPool.release``
        self._loop = connection.loop
        self.method = method
        self.status = 0
        self.reason = ""
        # The head's (``UpstreamConnection.on_headers_complete``); until then none, shared.
        self.headers: CIMultiDict[str] | CIMultiDictProxy[str] = _NO_HEADERS
        self.fields: list[tuple[str, str]] = []  # the head's headers in order, as they came
        self._length: int | None = None  # its head's Content-Length (``content_length``)
        # A header value or the reason held bytes that are not UTF-8: see
        # proxy.request.passthrough.ExactHead.
        self.escaped = False
        self.error: BaseException | None = None  # why it FAILED
        self.until_close = False  # a body delimited by the connection closing
        self._limit = limit
        self._inflate = inflate
        self.head: asyncio.Future[None] = self._loop.create_future()
        self._chunks: deque[bytes] = deque()  # ITERATE: bytes the consumer has not taken
        self._buffered = 0
        self._parked: asyncio.Future[None] | None = None  # the consumer's task, waiting for more
        self._waiting_since: float | None = None  # ITERATE: when the consumer began to wait
        self._sink_full: Callable[[], bool] = _never
        self._out: list[bytes] = []  # RELAY: this read's pieces, written in one go after it
        self._idle = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self.on_body: BodyPiece = self._buffer  # a body piece parsed (``_bind_body``)

    def __repr__(self) -> str:
        state, mode = ResponseState(self.state).name, Mode(self.mode).name
        return f"<UpstreamResponse {self.method} {self.status} {state} {mode}>"

    @property
    def content_type(self) -> str:
        raw = self.headers.get(_CONTENT_TYPE)
        if not raw:
            return "application/octet-stream"
        return raw.split(";", 1)[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        """The body's length as the consumer will see it, when known (read from the head once,
        ``on_head``: the pass-through and the exchange each ask)."""
        return None if self._inflater is not None else self._length

    # ---- parser side (called from UpstreamConnection.data_received)

    def on_head(self, status: int, until_close: bool) -> None:
        self.status = status
        self.until_close = until_close
        raw = self.headers.get(_CONTENT_LENGTH)
        self._length = None if raw is None else _length_of(raw)
        if self._inflate:
            coding = self.headers.get(_CONTENT_ENCODING, "").strip().lower()
            if coding in INFLATED:
                self._inflater = Inflater(coding)
                self._bind_body()
            elif coding not in ("", "identity"):
                self.fail(BadResponse(f"cannot decode Content-Encoding {coding}"))
                return
        if self.state == HEAD:
            self.state = BODY
            self.head.set_result(None)

    def _bind_body(self) -> None:
        """Where body pieces go, chosen when the inflation or the mode is decided, so the
        per-piece path makes no test: compressed input waits in the inflater (inflated after
        each read, as far as there is room), a relay's pieces in ``_out``, else the buffer.
        Nowhere once the body is over: a method bound to this response is a cycle."""
        if self.state >= COMPLETE:
            self.on_body = _ignore
        elif self._inflater is not None:
            self.on_body = self._inflater.feed
        elif self.mode == RELAY:
            self.on_body = self._collect
        else:
            self.on_body = self._buffer

    def _collect(self, data: bytes) -> None:
        self._out.append(data)
        self._pieces = True

    def _buffer(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > self._limit:
            self.connection.pause()
        _wake(self._parked)

    def on_end(self) -> None:
        """The message's last byte arrived (the connection's end, for a close-delimited body)."""
        if self.state != BODY:
            return  # it failed already
        self.state = ENDED
        if self._inflater is None:
            # A relay's last read reaches the sink before the body is complete, so an error the
            # sink raises on it (a malformed stream) is still this response's failure.
            self.after_read()
            self._completed()
        # else: complete once the last input is inflated (``_pump``)

    def on_close(self, clean: bool) -> None:
        """The connection is gone (``clean``: without an error): the end of a body delimited
        by it, or a failure when the message was not over."""
        state = self.state
        if state == BODY and self.until_close and clean:
            self.on_end()
            self.after_read()
        elif state == BODY:
            self.fail(BadResponse("upstream closed the connection mid-body"))
        elif state == HEAD:
            self.fail(Disconnected("upstream closed before a response"))

    def after_read(self) -> None:
        """After one ``data_received``: relayed pieces leave in one write, input is inflated."""
        if self.mode == RELAY:
            self.last_data = _monotonic()
            if self._pieces:
                self._pieces = False
                out = self._out
                data = out[0] if len(out) == 1 else b"".join(out)
                out.clear()
                self._to_sink(data)
        if self._inflater is not None:
            self._pump()

    def on_chunks(self, data: bytes, size: int) -> None:
        """``data`` is whole chunks of a chunked body, ``size`` body bytes in all (from
        ``UpstreamConnection.data_received``): written on in their framing where the relay's
        sink takes it, to a relay's sink in one piece (as ``after_read`` would hand the
        pieces on), else handed on piece by piece as the parser would."""
        framed = self._framed
        if framed is not None:
            try:
                full = framed.write_framed(data, size)
            except Exception as exc:  # the client is gone: the relay raises it
                self.fail(exc)
                return
            if full:
                self._wait_for_drain()
        elif self.mode == RELAY and self._inflater is None:
            # Not through ``on_body`` and ``_out``: two objects of their own, each a cache
            # line missed per read of 1,000 streams.
            self._to_sink(chunk_payload(data))
        else:
            chunk_pieces(data, self.on_body)

    def _to_sink(self, data: bytes) -> None:
        try:
            full = self._sink(data)
        except Exception as exc:  # e.g. a malformed stream: the relay raises it
            self.fail(exc)
            return
        if full:
            self._wait_for_drain()

    def _wait_for_drain(self) -> None:
        """The sink is full: reading pauses, and the relay's task wakes to wait for the drain."""
        self.connection.pause()
        _wake(self._parked)

    def _pump(self) -> None:
        """Inflate what the consumer has room for; reading waits while input is left over."""
        inflater = self._inflater
        assert inflater is not None
        try:
            if self.mode == RELAY:
                full = self._sink_full
                while inflater.pending and self.state != FAILED:
                    if full():
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
                        _wake(self._parked)
            if inflater.pending:
                self.connection.pause()
            elif self.state == ENDED:
                tail = inflater.close()
                if tail:
                    if self.mode == RELAY:
                        self._to_sink(tail)
                    else:
                        self._chunks.append(tail)
                        self._buffered += len(tail)
                self._completed()
        except zlib.error as exc:
            self.fail(BadResponse(f"bad compressed body: {exc}"))

    def _completed(self) -> None:
        if self.state == FAILED:
            return
        self.state = COMPLETE
        self._stop_idle()
        self.on_body = _ignore  # no more pieces come; and the bound ``_buffer`` was a cycle
        _wake(self._parked)

    def fail(self, exc: BaseException) -> None:
        if self.state >= COMPLETE:
            return  # complete, or failed already
        self.state = FAILED
        self.error = exc
        self._stop_idle()
        self.on_body = _ignore
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved here: the caller may have stopped waiting
        _wake(self._parked)
        self.connection.abort()

    def finish(self) -> bool:
        """The caller is done with this response: its idle clock stops. Whether every body
        byte was handed on, so that its connection may carry another request. The failure is
        let go: its traceback holds the frames that raised it, which hold this response, a cycle
        only the (rarely run, see proxy.server.memory) collector would break."""
        self._stop_idle()
        self.error = None
        return self.state == COMPLETE

    # ---- head and timeouts

    async def wait_head(self, first_byte: float, clock: HeadClock) -> None:
        """Until the head is in; failed with ``ResponseTimeout`` after ``first_byte`` seconds,
        by ``clock``."""
        wait = clock.start(self, first_byte)
        try:
            await self.head
        finally:
            wait.end()

    def no_head(self, first_byte: float) -> None:
        # The failure is made when the wait is due, not for every response: an exception and a
        # float formatted into its message were a few thousand instructions a request.
        self.fail(ResponseTimeout(f"no response head from upstream within {first_byte} s"))

    def start_idle(self, idle: float) -> None:
        self._idle = idle
        self.last_data = _monotonic()
        if self.state < COMPLETE:
            self._idle_timer = self._loop.call_later(idle, self._check_idle)

    def _stop_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_since(self) -> float | None:
        """When the idle clock started, or None while it is stopped."""
        if self.state == ENDED:
            return None  # the upstream said all it had: what is left is the consumer's
        if self.mode == RELAY:
            return None if self.connection.paused else self.last_data
        if self._chunks or self._parked is None:
            return None  # the consumer is busy elsewhere: not the upstream's silence
        return self._waiting_since

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self.state >= COMPLETE:
            return
        since = self._idle_since()
        now = _monotonic()
        if since is not None and now - since >= self._idle:
            self.fail(ResponseTimeout(f"no data from upstream for {self._idle} s"))
            return
        start = since if since is not None else now
        self._idle_timer = self._loop.call_at(start + self._idle, self._check_idle)

    # ---- iterator mode

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        data = await self._next()
        if data is None:
            raise StopAsyncIteration
        return data

    async def _next(self) -> bytes | None:
        """The body bytes not taken yet, once there are some; None once the body is over."""
        inflater = self._inflater
        while not self._chunks:
            state = self.state
            if state == FAILED:
                assert self.error is not None
                raise self.error
            if inflater is not None and inflater.pending:
                self._pump()
                continue
            if state == COMPLETE:
                return None
            self.connection.resume()
            self._waiting_since = _monotonic()
            try:
                await self._park()
            finally:
                self._waiting_since = None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if inflater is None or not inflater.pending:
            self.connection.resume()
        return data

    async def read(self, limit: int) -> bytes:
        """The whole body; ``BodyTooLong`` the moment it grows past ``limit`` bytes. Not an
        ``async for``: its end, a StopAsyncIteration out of compiled code, costs two tracebacks
        (4,000 instructions, 1 % of a pass-through's)."""
        chunks: list[bytes] = []
        size = 0
        while (chunk := await self._next()) is not None:
            size += len(chunk)
            if size > limit:
                raise BodyTooLong(size)
            chunks.append(chunk)
        return b"".join(chunks)  # one chunk: that very object, no copy

    # ---- relay mode

    async def relay(
        self,
        sink: BodySink,
        paused: Callable[[], bool],
        drain: Callable[[], Awaitable[None]],
        framed: FramedSink | None = None,
    ) -> None:
        """Hand every body byte to ``sink`` from ``data_received``, until the body ends.

        ``sink`` returns whether its buffer is full after the write, and ``paused`` says the
        same between writes; reading then pauses, this task awaits ``drain()`` and
        resumes reading. ``drain`` must suspend until there is room, or raise (the sink's
        client is gone, which ends the relay at once): one that returns at once while the
        sink stays full would spin this loop and freeze the event loop. Raises the body's
        failure; cancelling it aborts the connection.

        With ``framed`` (a sink writing to a client in chunked framing), a read that is whole
        chunks of an uncompressed chunked body goes there as it came: neither parsed into
        pieces nor framed again.
        """
        self.mode = RELAY
        self._bind_body()
        self._sink = sink
        self._sink_full = paused
        self._framed = framed if self._inflater is None else None
        if self._chunks:  # anything read before the relay began
            data = b"".join(self._chunks)
            self._chunks.clear()
            self._buffered = 0
            if self.state == COMPLETE:
                sink(data)  # the whole body came first: an error the sink raises is raised here
            else:
                self._to_sink(data)
        inflater = self._inflater
        while True:
            state = self.state
            if state == FAILED:
                assert self.error is not None
                raise self.error
            if state == COMPLETE:
                return
            if paused():
                self.connection.pause()
                await drain()
                self.last_data = _monotonic()  # the idle clock stood still meanwhile
                continue
            if inflater is not None and inflater.pending:
                self._pump()
                continue
            self.connection.resume()
            await self._park()

    async def _park(self) -> None:
        """Until the parser side has more for the consumer, the body ends, or it fails."""
        self._parked = self._loop.create_future()
        try:
            await self._parked
        finally:
            self._parked = None


def _length_of(raw: str) -> int | None:
    try:
        return int(raw)
    except ValueError:
        return None


class HeadClock:
    """The waits for response heads on one loop, due ``first_byte`` seconds after each began.

    A timer made and cancelled for each request cost 3,900 instructions of a pass-through; the
    waits of one ``first_byte`` value instead stand in a line, in the order they began, which is
    the order they fall due, and one loop timer per line is set at its first running wait's
    deadline. A wait that ends (its head came, or its request went) is cleared where it stands;
    the timer, when it fires, fails the waits due and sets itself at the next running one. The
    line is cut as it grows: what ended before its first running wait goes, and when mostly
    ended waits stand behind a long one, the line is remade of the running ones."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lines: dict[float, _Line] = {}

    def start(self, response: UpstreamResponse, first_byte: float) -> _Wait:
        line = self._lines.get(first_byte)
        if line is None:
            line = self._lines[first_byte] = _Line(first_byte)
        line.tidy()
        wait = _Wait(response, _monotonic() + first_byte, line)
        line.waits.append(wait)
        line.running += 1
        if line.timer is None:
            line.timer = self.loop.call_later(first_byte, self._due, line)
        return wait

    def _due(self, line: _Line) -> None:
        line.timer = None
        now = _monotonic() + _EARLY
        waits = line.waits
        i = line.first
        while i < len(waits):
            wait = waits[i]
            response = wait.response
            if response is not None and wait.at > now:
                line.first = i
                line.timer = self.loop.call_later(wait.at - now + _EARLY, self._due, line)
                return
            i += 1
            if response is not None:
                wait.end()
                response.no_head(line.first_byte)
        if line.waits is waits:  # else a wait began meanwhile, and the line was remade
            line.waits = []
            line.first = 0


_EARLY: Final = 0.001  # a wait this close to its deadline is due: the loop's clock is in ms
_KEPT: Final = 64  # ended waits a line keeps before it is cut


class _Line:
    """The waits of one ``first_byte`` value, oldest first; those before ``first`` have ended."""

    def __init__(self, first_byte: float) -> None:
        self.first_byte = first_byte
        self.waits: list[_Wait] = []
        self.first = 0
        self.running = 0  # waits not ended
        self.timer: asyncio.TimerHandle | None = None

    def tidy(self) -> None:
        """Drop the ended waits at the front; remake the line when most of it has ended."""
        waits = self.waits
        first = self.first
        while first < len(waits) and waits[first].response is None:
            first += 1
        if first == len(waits):
            if first:
                self.waits = []
            first = 0
        elif len(waits) - first > _KEPT and len(waits) - first > 4 * self.running:
            self.waits = [wait for wait in waits[first:] if wait.response is not None]
            first = 0
        elif first > _KEPT and 2 * first > len(waits):
            del waits[:first]
            first = 0
        self.first = first


class _Wait:
    """One response's wait for its head; ``response`` is None once it ended."""

    def __init__(self, response: UpstreamResponse, at: float, line: _Line) -> None:
        self.response: UpstreamResponse | None = response
        self.at = at
        self.line = line

    def end(self) -> None:
        if self.response is not None:
            self.response = None
            self.line.running -= 1
