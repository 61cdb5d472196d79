"""Writing a response straight into the client's transport, past aiohttp's writer.

The relay (pass-through) and the stitched stream (fan-out) both write here, through
``proxy.request.body``'s writer: one ``transport.write`` per piece, chunked framing done in
place, no coroutine per chunk, the bytes counted for the request's record. "The client left" is
``ClientGone``. The response's head is aiohttp's, sent first (``ExactHead``'s when its bytes
are not UTF-8); its ``write_eof`` still ends the body.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from aiohttp import web

from proxy.core.errors import ClientGone
from proxy.observe.record import RequestRecord
from proxy.request.body import BodyWriter


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


_FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # as aiohttp's writer (RFC 9110 §5.5)


class ExactHead(web.StreamResponse):
    """A relayed response whose head holds bytes that are not UTF-8 (a Latin-1 header value).

    Such bytes reach the proxy as surrogate escapes; aiohttp's writer encodes a head as UTF-8,
    and its C writer drops surrogates. This head is written here instead, each byte as the
    upstream sent it; the body then goes through ``client_sink`` as for any relay.
    """

    async def _write_headers(self) -> None:  # aiohttp's step that serialises the head
        request = self._req
        assert request is not None
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ClientGone()
        version = request.version
        parts = [f"HTTP/{version.major}.{version.minor} {self.status} {self.reason}"]
        parts += [f"{name}: {value}" for name, value in self.headers.items()]
        for part in parts:
            if _FORBIDDEN.search(part):
                raise ValueError("a control character in a response header")
        head = "\r\n".join(parts) + "\r\n\r\n"
        transport.write(head.encode("utf-8", "surrogateescape"))
