"""A response body written straight into the client's transport: the client's side of every
relayed and stitched chunk, compiled with the rest of the stream path (setup.py).

One ``transport.write`` per piece, chunked framing done in place, no coroutine per chunk. What
the request's record needs (the bytes written, the first write's time) is kept here and handed
to it once, when the body is over (``proxy.request.sink``'s ``settle``): no attribute of a
Python object is touched per chunk.
"""

from __future__ import annotations

from time import perf_counter
from typing import Protocol

from proxy.core.errors import ClientGone


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
        transport = self._transport
        if transport.is_closing():
            raise ClientGone()
        if self._stamp:
            self._stamp = False
            self.first_at = perf_counter()
        size = len(data)
        self.written += size
        if self._chunked:
            transport.write(b"%x\r\n%b\r\n" % (size, data))
        else:
            transport.write(data)
        return transport.get_write_buffer_size() > self._high or transport.is_closing()

    def write_framed(self, data: bytes, size: int) -> bool:
        """``data`` is whole chunks in chunked framing already, holding ``size`` body bytes:
        written as it is, to a chunked response only. As ``write`` otherwise."""
        transport = self._transport
        if transport.is_closing():
            raise ClientGone()
        if self._stamp:
            self._stamp = False
            self.first_at = perf_counter()
        self.written += size
        transport.write(data)
        return transport.get_write_buffer_size() > self._high or transport.is_closing()
