"""The client's side of every relayed and stitched chunk: writing a response body straight into
the client's transport, past aiohttp's writer; compiled with the rest of the stream path
(setup.py).

The relay (pass-through) and a fan-out stream's writer (``proxy.request.writer``) both write
here: one ``transport.write`` per piece, chunked framing done in place, no coroutine per chunk.
What the request's record needs (the bytes written, the first write's time) is kept by
``BodyWriter`` and handed to the record once, when the body is over (``Sink.settle``): no
attribute of a Python object is touched per chunk. "The client left" is ``ClientGone``. The
response's head is aiohttp's, sent first; its ``write_eof`` still ends the body.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import NamedTuple, Protocol

from aiohttp import web

from proxy.core import TAIL_BYTES, ClientGone
from proxy.http import FramedSink
from proxy.observe import RequestRecord


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
    # with their body bytes' count (its ``write_framed``); None when the response is not chunked.
    framed: FramedSink | None


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
        if record.route != "other":  # an LLM answer: what it says of its usage is in its end
            record.tail = body.tail()

    return Sink(body.write, full, drain, settle, body if chunked else None)


class Transport(Protocol):
    """What the writer uses of an ``asyncio.WriteTransport``."""

    def write(self, data: bytes) -> None: ...
    def is_closing(self) -> bool: ...
    def get_write_buffer_size(self) -> int: ...


class BodyWriter(FramedSink):
    """Writes a body into ``transport``, framed as chunks when ``chunked``. Each write says
    whether the transport is past its high-water mark ``high`` or closing now: the one test
    per chunk. With ``stamp``, the first write's time is kept (``first_at``, else -1). A relay
    hands it whole chunks directly (``FramedSink``)."""

    def __init__(self, transport: Transport, high: int, chunked: bool, stamp: bool) -> None:
        # The transport's methods, taken once from its class: a method called on an object of a
        # class mypyc did not compile is looked up on its type at every call, three times a
        # chunk here. Its class's own functions, not methods bound to it: those would be three
        # objects of each writer's, a cache miss a chunk at 1,000 streams; these, every
        # writer's.
        kind = type(transport)
        self._transport = transport
        self._send: Callable[[Transport, bytes], None] = kind.write
        self._closing: Callable[[Transport], bool] = kind.is_closing
        self._buffered: Callable[[Transport], int] = kind.get_write_buffer_size
        self._high = high
        self._chunked = chunked
        self._stamp = stamp
        self.written = 0  # body bytes, not the chunked framing's
        self.first_at = -1.0
        # The last two writes, as they went: an answer's usage is in its last events.
        self._before_last = b""
        self._last = b""

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
        closing = self._closing
        if closing(transport):
            raise ClientGone()
        if self._stamp:
            self._stamp = False
            self.first_at = perf_counter()
        self.written += size
        self._before_last = self._last
        self._last = data
        self._send(transport, data)
        return self._buffered(transport) > self._high or closing(transport)

    def tail(self) -> bytes:
        """The body's last bytes written, at most ``TAIL_BYTES`` of each of the last two writes
        (with the chunked framing of whole chunks written on as they came)."""
        return self._before_last[-TAIL_BYTES:] + self._last[-TAIL_BYTES:]
