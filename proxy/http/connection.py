"""One HTTP/1.1 connection to an upstream: an ``asyncio.Protocol`` around httptools' parser.

At most one response is in flight, and the parser stops at its end: a byte past the final
message (a Content-Length shorter than the body sent, a 204 with a body, a second response)
is never delivered nor parsed as the next answer; it spoils the connection, which is closed,
never pooled. The head is capped on raw bytes as they arrive, partial lines included.
A request body goes out as the transport takes it (``pause_writing``), and a connection whose
request was not all written when its answer ended is never pooled either: the server may read
the rest as a request of its own. Failures are ``proxy.http.errors``'.

A connection is in one ``ConnectionState`` at a time::

    IDLE ──begin──▶ HEAD ──final head──▶ BODY ──end, keep-alive──▶ REUSABLE ──park──▶ IDLE
                     │                     └────end, otherwise──▶ SPENT
                     └──a HEAD request's head──────────────────▶ SPENT
    any ──the server's EOF, connection lost, abort, spoil, discard──▶ CLOSED (never left)

Reading and writing pauses are flow control, not states: they mirror the transport's.

The response on a connection (``UpstreamResponse``) has its head at once and its body iterated or
relayed, inflated in bounded steps: one exchange on one connection in one module, as httpcore's
``http11.py``. The connection's parser hands body bytes in; the consumer takes them out, either
as an async iterator (fan-out JSON) or through a sink called from ``data_received`` (relays: no
task, queue or iterator per chunk). A read of nothing but whole chunks, from between two, skips
the parser (``_whole_chunks``): to a relay whose client is chunked too, it goes on as it came.
Nothing is held further than ``limit`` bytes ahead of the consumer, compressed input included:
reading pauses instead. The idle clock runs only while the proxy waits on the upstream, never
while it waits on its own client.

A response is in one ``ResponseState`` at a time, and read in one ``Mode``::

    HEAD ──head──▶ BODY ──last byte in──▶ ENDED ──last byte handed on──▶ COMPLETE
    any but COMPLETE ──fail──▶ FAILED           (without inflation, ENDED is COMPLETE at once)
    ITERATE ──relay()──▶ RELAY
"""

from __future__ import annotations

import asyncio
import select
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from enum import IntEnum
from typing import Final, Protocol, cast

import httptools
from multidict import CIMultiDict

from proxy.core.encoding import INFLATED, Inflater
from proxy.http.errors import BadResponse, BodyTooLong, Disconnected, ResponseTimeout


def _wake(future: asyncio.Future[None] | None) -> None:
    """Let whoever waits on ``future`` run on; a future already done is left as it is."""
    if future is not None and not future.done():
        future.set_result(None)


# ---- the response


BodyPiece = Callable[[bytes], None]  # takes one parsed piece of a body
# Takes relayed bytes; True when it is full now, so reading pauses until its drain (one call
# per read: the write and the test that follows it are one).
BodySink = Callable[[bytes], bool]
# The same for bytes that are whole chunks in chunked framing, as the upstream sent them, with
# the number of body bytes they hold: a relay to a chunked client writes them on as they are.
FramedSink = Callable[[bytes, int], bool]


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
HEAD: Final = 0  # ResponseState.HEAD, and ConnectionState.HEAD as well
BODY: Final = 1  # ResponseState.BODY, and ConnectionState.BODY as well
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


class UpstreamResponse:
    def __init__(self, connection: Reading, method: str, limit: int, inflate: bool) -> None:
        self.connection = connection  # the one it arrives on, for ``ConnectionPool.release``
        self._loop = connection.loop
        self.method = method
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        # A header value or the reason held bytes that are not UTF-8: see
        # proxy.request.passthrough.ExactHead.
        self.escaped = False
        self.state = HEAD  # a ResponseState, as its int
        self.error: BaseException | None = None  # why it FAILED
        self.mode = ITERATE  # a Mode, as its int
        self.until_close = False  # a body delimited by the connection closing
        self._limit = limit
        self._inflate = inflate
        self._inflater: Inflater | None = None
        self.head: asyncio.Future[None] = self._loop.create_future()
        self._chunks: deque[bytes] = deque()  # ITERATE: bytes the consumer has not taken
        self._buffered = 0
        self._parked: asyncio.Future[None] | None = None  # the consumer's task, waiting for more
        self._waiting_since: float | None = None  # ITERATE: when the consumer began to wait
        self._sink: BodySink = _nowhere  # RELAY: where bytes go as they arrive
        self._sink_full: Callable[[], bool] = _never
        self._framed: FramedSink | None = None  # RELAY: where whole chunks go as they came
        self._out: list[bytes] = []  # RELAY: this read's pieces, written in one go after it
        self.last_data = 0.0  # RELAY: when bytes last came
        self._idle = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self.on_body: BodyPiece = self._buffer  # a body piece parsed (``_bind_body``)

    def __repr__(self) -> str:
        state, mode = ResponseState(self.state).name, Mode(self.mode).name
        return f"<UpstreamResponse {self.method} {self.status} {state} {mode}>"

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
        each read, as far as there is room), a relay's pieces in ``_out``, else the buffer."""
        if self._inflater is not None:
            self.on_body = self._inflater.feed
        elif self.mode == RELAY:
            self.on_body = self._out.append
        else:
            self.on_body = self._buffer

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
            self.last_data = self._loop.time()
            out = self._out
            if out:
                data = out[0] if len(out) == 1 else b"".join(out)
                out.clear()
                self._to_sink(data)
        if self._inflater is not None:
            self._pump()

    def on_chunks(self, data: bytes, size: int) -> None:
        """``data`` is whole chunks of a chunked body, ``size`` body bytes in all (from
        ``UpstreamConnection.data_received``): written on in their framing where the relay's
        sink takes it, else handed on piece by piece as the parser would."""
        framed = self._framed
        if framed is None:
            _chunk_pieces(data, self.on_body)
            return
        try:
            full = framed(data, size)
        except Exception as exc:  # the client is gone: the relay raises it
            self.fail(exc)
            return
        if full:
            self._wait_for_drain()

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
        byte was handed on, so that its connection may carry another request."""
        self._stop_idle()
        return self.state == COMPLETE

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
            state = self.state
            if state == FAILED:
                assert self.error is not None
                raise self.error
            if inflater is not None and inflater.pending:
                self._pump()
                continue
            if state == COMPLETE:
                raise StopAsyncIteration
            self.connection.resume()
            self._waiting_since = self._loop.time()
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
        return await read_capped(self, limit)

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
                self.last_data = self._loop.time()  # the idle clock stood still meanwhile
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


# ---- the connection


MAX_HEAD = 256 * 1024  # status line and headers together, interim (1xx) heads included
_NO_BODY_STATUS = frozenset({204, 304})
_CRLF: Final = b"\r\n"
_CHUNKED_END = 4  # a chunked body and a head both end in CRLF CRLF after a visible byte
# Request body bytes handed to the transport at a time: past its high-water mark the rest waits
# for ``resume_writing``, so an upload to a slow reader holds about this much in the transport.
WRITE_PIECE = 64 * 1024


class ConnectionState(IntEnum):
    """Where a connection is (the module docstring draws the transitions). The order matters:
    bytes from the server are welcome only up to ``BODY``; past it, the message is over."""

    HEAD = 0  # a request went out; its final head is not all in: reads are head bytes, capped
    BODY = 1  # the final head is in: reads go straight to the parser
    IDLE = 2  # no exchange: just connected, or pooled between requests
    REUSABLE = 3  # the message ended and the connection may carry the next request
    SPENT = 4  # the message ended; the connection must not carry another (released: closed)
    CLOSED = 5  # the server sent its EOF, the transport is gone, or this side aborted


# ``UpstreamConnection.state`` holds these plain ints, as a response's state (above); HEAD and
# BODY are the same two numbers there.
IDLE: Final = 2
REUSABLE: Final = 3
SPENT: Final = 4
CLOSED: Final = 5


class _HeadDone(Exception):
    """Raised from the parser's callback to stop after a HEAD response's headers."""


class _Beyond(Exception):
    """Raised from the parser's callback: a message began after the final one ended."""


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive socket to one origin (``key``: host, port, TLS name)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int, str | None]) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.state = IDLE  # a ConnectionState, as its int
        self.paused = False  # reading paused (``pause``)
        self.idle_since = 0.0
        self._head_room = MAX_HEAD
        self._last_body = b""  # the last body piece parsed: how the message ends
        self._recent = b""  # the last bytes received: at least 8, unless fewer came
        self._chunked = False  # the final head's framing: the message ends in CRLF CRLF
        # A chunked body's reads: the parser's last step was the head's or a chunk's end
        # (``_edge``), and the last read ended right there (``_at_boundary``: the next read may
        # skip the parser, ``_whole_chunks``).
        self._edge = False
        self._at_boundary = False
        self._unsent: memoryview | None = None  # request body bytes not handed to the transport
        self._writing_paused = False  # the transport's buffer is past its high-water mark

    def __repr__(self) -> str:
        return f"<UpstreamConnection {self.key} {ConnectionState(self.state).name}>"

    # ---- the exchange's transitions

    def begin(self, response: UpstreamResponse) -> None:
        """A new exchange on this connection; its request is about to be written. One that
        closed as it connected stays closed: its response waits for the first-byte bound."""
        self.response = response
        if self.state != CLOSED:
            self.state = HEAD
        self._head_room = MAX_HEAD
        self._last_body = b""
        self._recent = b""
        self._edge = self._at_boundary = False
        self._unsent = None

    def _head_in(self) -> None:
        """The final (not interim) head arrived."""
        if self.state == HEAD:
            self.state = BODY

    def _message_ended(self, reusable: bool) -> None:
        if self.state != CLOSED:
            self.state = REUSABLE if reusable else SPENT

    def park(self, now: float) -> None:
        """Between requests, in the pool: the response let go, reading on for the server's EOF."""
        assert self.state == REUSABLE
        self.state = IDLE
        self.response = None
        self.resume()
        self.idle_since = now

    def _enter_closed(self) -> None:
        """Never reused from here on, and nothing more of the request is written."""
        self.state = CLOSED
        self._unsent = None

    def send(self, head: bytes, body: bytes | None) -> None:
        """Write the request: whole when small (one write), else piece by piece as the
        transport takes it; the rest goes out from ``resume_writing``, no task needed."""
        transport = self.transport
        assert transport is not None
        if not body:
            transport.write(head)
        elif len(body) <= WRITE_PIECE:
            transport.write(head + body)
        else:
            transport.write(head)
            self._unsent = memoryview(body)
            self._write_more()

    def _write_more(self) -> None:
        transport = self.transport
        unsent = self._unsent
        while unsent is not None and not self._writing_paused and self.state != CLOSED:
            assert transport is not None
            piece = unsent[:WRITE_PIECE]
            unsent = self._unsent = unsent[WRITE_PIECE:] or None
            transport.write(piece)  # may pause writing at once

    @property
    def answered(self) -> bool:
        """Whether any byte of an answer to the current request arrived (every one is counted
        against the head's cap first)."""
        return self._head_room < MAX_HEAD

    def stale(self) -> bool:
        """Whether this idle connection is unfit to reuse: closed, or readable, with an EOF or
        bytes nobody asked for already in its socket that the loop has not read yet (the
        check urllib3 makes; TLS polls its raw socket). One ``poll`` with no wait."""
        if self.state == CLOSED or self.transport is None:
            return True
        raw = self.transport.get_extra_info("socket")
        if raw is None:
            return False
        poller = select.poll()
        poller.register(raw.fileno(), select.POLLIN)
        return bool(poller.poll(0))  # POLLIN, POLLHUP or POLLERR: the server is done with it

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter_closed()
        if self.response is not None:
            self.response.on_close(clean=exc is None)

    def eof_received(self) -> bool | None:
        # The server is done with this connection: never hand it out again, whatever the
        # response in flight still delivers. Narrows the keep-alive race to the wire's delay.
        self._enter_closed()
        return None  # close our side too

    def data_received(self, data: bytes) -> None:
        response = self.response
        state = self.state
        if response is None or state > BODY:
            self.spoil()  # bytes nobody asked for: this connection is not safe to reuse
            return
        # A message's end split over tiny reads is still told from CR/LF after it (below).
        self._recent = data if len(data) >= 8 else self._recent[-8:] + data
        error: BaseException | None = None
        try:
            if state == BODY and self._at_boundary and (size := _whole_chunks(data)) > 0:
                # Nothing but whole chunks, from where the parser stands between two: it would
                # stand there again after them, so it need not see them.
                response.on_chunks(data, size)
            else:
                if state == BODY:
                    self.parser.feed_data(data)
                else:
                    error = self._feed_head(data)
                self._at_boundary = self._edge and data.endswith(_CRLF)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            error = self._parse_failed(exc)
        else:
            if self.state == REUSABLE and _crlf_after_end(self._recent, self._own_crlf()):
                self.spoil()
        response.after_read()  # every valid byte of this read leaves first
        if error is not None:
            response.fail(error)

    def _parse_failed(self, exc: Exception) -> BaseException | None:
        """What a parser error means: the end of a HEAD's head, bytes after the message (the
        connection is spoiled, the response stands), or a malformed response (returned)."""
        cause = exc.__context__
        response = self.response
        if isinstance(cause, _HeadDone) and response is not None:
            self._message_ended(reusable=False)  # bytes after a HEAD's head are not ours
            response.on_end()
            return None
        if isinstance(cause, _Beyond) or self.state > BODY:
            self.spoil()  # what follows the message is not a message of ours
            return None
        if isinstance(exc, httptools.HttpParserUpgrade):
            return BadResponse("upstream switched protocols")
        return BadResponse(f"malformed upstream response: {exc}")

    def _feed_head(self, data: bytes) -> BaseException | None:
        """Feed no more than the head may still take; a head past the cap fails the response."""
        room = self._head_room
        if len(data) <= room:
            self._head_room = room - len(data)
            self.parser.feed_data(data)
            return None
        self._head_room = 0
        self.parser.feed_data(data[:room])
        if self.state == HEAD:  # the final head is not all in yet
            return BadResponse(f"upstream response head is over {MAX_HEAD} bytes")
        self.parser.feed_data(data[room:])
        return None

    def _own_crlf(self) -> int | None:
        """How many CR and LF bytes the message itself ends with; None when not known."""
        if self._chunked or not self._last_body:
            return _CHUNKED_END
        body = self._last_body
        run = _crlf_run(body, len(body))
        return None if run == len(body) else run

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._unsent is not None:
            self._write_more()

    # ---- httptools callbacks

    def on_message_begin(self) -> None:
        if self.state > BODY:
            raise _Beyond
        response = self.response
        if response is not None:
            response.headers = CIMultiDict()

    def on_status(self, status: bytes) -> None:
        if self.response is not None:
            self.response.reason = self._text(status)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers.add(self._text(name), self._text(value))

    def _text(self, raw: bytes) -> str:
        """Header bytes as aiohttp's server writes them back unchanged: UTF-8. Bytes that are
        not UTF-8 are kept as surrogate escapes and the head is marked for ``ExactHead``."""
        try:
            return raw.decode()
        except UnicodeDecodeError:
            if self.response is not None:
                self.response.escaped = True
            return raw.decode("utf-8", "surrogateescape")

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:
                raise ValueError("upstream switched protocols")
            return  # an interim response: the real head follows
        headers = response.headers
        self._chunked = self._edge = "chunked" in headers.get("Transfer-Encoding", "").lower()
        no_body = response.method == "HEAD" or status in _NO_BODY_STATUS
        until_close = not no_body and not self._chunked and "Content-Length" not in headers
        self._head_in()
        response.on_head(status, until_close)
        if response.method == "HEAD":
            raise _HeadDone

    def on_body(self, body: bytes) -> None:
        self._last_body = body
        if self.response is not None:
            self.response.on_body(body)

    def on_chunk_header(self) -> None:
        self._edge = False

    def on_chunk_complete(self) -> None:
        self._edge = True

    def on_message_complete(self) -> None:
        response = self.response
        if response is None or self.state == HEAD:
            return  # the end of an interim (1xx) response
        # The whole request left this process before the answer ended, or the connection is
        # never reused (as nginx): a server that answered early (a 413 to an upload) may read
        # what follows as the next request, and its answers would go to other clients. The
        # rest of such a body is not sent.
        transport = self.transport
        written = (
            self._unsent is None and transport is not None and not transport.get_write_buffer_size()
        )
        self._unsent = None
        self._message_ended(
            self.parser.should_keep_alive() and not response.until_close and written
        )
        response.on_end()

    # ---- flow control and teardown

    def pause(self) -> None:
        if not self.paused and self.transport is not None and self.state != CLOSED:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and self.state != CLOSED:
            self.paused = False
            self.transport.resume_reading()

    def spoil(self) -> None:
        """Never reuse this connection: close it now. The response in flight keeps what it
        has already received."""
        self.abort()

    def abort(self) -> None:
        if self.state != CLOSED:
            self._enter_closed()
            if self.transport is not None:
                self.transport.abort()

    def discard(self) -> None:
        """Never reuse this connection, and let its response go first: the response keeps
        what it has and fails no further when the transport goes."""
        self.response = None
        self.abort()


_MAX_CHUNK_DIGITS: Final = 8  # a longer chunk size is the parser's to judge


def _whole_chunks(data: bytes) -> int:
    """The body bytes in ``data`` when it is nothing but whole chunks, each ``HEX CRLF data
    CRLF`` with no extension, none the last (zero-sized) chunk; else 0, and the parser reads
    it. What passes here is a part of the chunked framing the parser accepts."""
    end = len(data)
    at = 0
    total = 0
    while at < end:
        size = 0
        start = at
        while at < end and at - start <= _MAX_CHUNK_DIGITS:
            c = data[at]
            if 48 <= c <= 57:  # 0-9
                size = size * 16 + c - 48
            elif 97 <= c <= 102:  # a-f
                size = size * 16 + c - 87
            elif 65 <= c <= 70:  # A-F
                size = size * 16 + c - 55
            else:
                break
            at += 1
        if size == 0 or at - start > _MAX_CHUNK_DIGITS:
            return 0
        if at + 2 > end or data[at] != 13 or data[at + 1] != 10:
            return 0
        at += 2 + size
        if at + 2 > end or data[at] != 13 or data[at + 1] != 10:
            return 0
        at += 2
        total += size
    return total


def _chunk_pieces(data: bytes, into: BodyPiece) -> None:
    """Each chunk's data of ``data``, which ``_whole_chunks`` passed, to ``into``."""
    at = 0
    end = len(data)
    while at < end:
        size = 0
        c = data[at]
        while c != 13:
            size = size * 16 + (c - 48 if c <= 57 else (c | 32) - 87)
            at += 1
            c = data[at]
        at += 2
        into(data[at : at + size])
        at += size + 2


def _crlf_after_end(data: bytes, own: int | None) -> bool:
    """Whether the bytes ending in the final message's end may hold CR or LF bytes after it.

    llhttp skips CR and LF between messages without a callback (RFC 9112 §2.2 leniency), so
    they are counted here: the run of them ending ``data`` must be the message's own (``own``
    bytes). A run that fills all of ``data`` or an unknown ``own`` cannot be told apart:
    treated as extra, since a spoiled connection costs one reconnect at most.
    """
    if not data or data[-1] not in _CRLF:
        return False
    if own is None:
        return True
    run = _crlf_run(data, own + 1)
    return run > own or run == len(data)


def _crlf_run(data: bytes, most: int) -> int:
    """How many CR and LF bytes end ``data``, counting no further than ``most``."""
    run = 0
    end = len(data) - 1
    while run < most and end >= 0 and data[end] in _CRLF:
        run += 1
        end -= 1
    return run


def request_head(
    method: str,
    target: str,
    host: str,
    headers: Mapping[str, str] | CIMultiDict[str],
    body: bytes | None,
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1\r\n", ""]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break")
        lower = name.lower()
        if lower == "host":
            host = value  # a replica reached by address keeps the configured host name
        elif lower not in ("content-length", "transfer-encoding", "connection"):
            lines.append(f"{name}: {value}\r\n")
    lines[1] = f"Host: {host}\r\n"
    if body is not None:
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    # aiohttp's server decodes header bytes as UTF-8 with surrogate escapes: this is the inverse.
    return "".join(lines).encode("utf-8", "surrogateescape")
