"""Writing a response body straight into the client's transport, past aiohttp's writer.

The relay (pass-through) and the stitched stream (fan-out) both write here: one
``transport.write`` per piece, chunked framing done in place, no coroutine per chunk. The
response's head is aiohttp's, sent first; its ``write_eof`` still ends the body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from aiohttp import web


class Sink(NamedTuple):
    write: Callable[[bytes], None]
    full: Callable[[], bool]  # the transport's high-water mark, or the client gone
    drain: Callable[[], Awaitable[None]]  # until below the low-water mark again


def client_sink(request: web.Request, transport: asyncio.Transport) -> Sink:
    """For a response already prepared: its body's bytes go to ``transport`` directly.

    Writing once the client is gone raises ``ConnectionResetError``, the error callers handle
    (uvloop itself would raise ``RuntimeError`` on a transport whose connection is lost).
    """
    writer = request.writer
    send_headers = getattr(writer, "send_headers", None)  # aiohttp >= 3.12 holds the head back
    if send_headers is not None:
        send_headers()
    protocol = request.protocol
    closing = transport.is_closing
    send = transport.write

    def full() -> bool:
        return protocol.writing_paused or closing()

    if getattr(writer, "chunked", False):

        def write(data: bytes) -> None:
            if closing():
                raise ConnectionResetError("the client left")
            send(b"%x\r\n%b\r\n" % (len(data), data))

    else:

        def write(data: bytes) -> None:
            if closing():
                raise ConnectionResetError("the client left")
            send(data)

    return Sink(write, full, writer.drain)
