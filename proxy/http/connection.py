"""One HTTP/1.1 connection to an upstream: an ``asyncio.Protocol`` around httptools' parser, and
the request's head as it goes on the wire.

At most one response is in flight (``proxy.http.response``), and the parser stops at its end: a
byte past the final message (a Content-Length shorter than the body sent, a 204 with a body, a
second response) is never delivered nor parsed as the next answer; it spoils the connection,
which is closed, never pooled. The head is capped on raw bytes as they arrive, partial lines
included. A request body goes out as the transport takes it (``pause_writing``), and a
connection whose request was not all written when its answer ended is never pooled either: the
server may read the rest as a request of its own. Failures are ``proxy.http.errors``'.

A connection is in one ``ConnectionState`` at a time::

    IDLE ──begin──▶ HEAD ──final head──▶ BODY ──end, keep-alive──▶ REUSABLE ──park──▶ IDLE
                     │                     └────end, otherwise──▶ SPENT
                     └──a HEAD request's head──────────────────▶ SPENT
    any ──the server's EOF, connection lost, abort, spoil, discard──▶ CLOSED (never left)

Reading and writing pauses are flow control, not states: they mirror the transport's. A read
of nothing but whole chunks, from between two, skips the parser (``proxy.http.chunks``).
"""

from __future__ import annotations

import asyncio
import select
from collections.abc import Callable, Mapping
from enum import IntEnum
from typing import Any, Final, cast

import httptools
from multidict import CIMultiDict, istr

from proxy.core import Remembered
from proxy.http.chunks import CHUNKED, UNFRAMED, framing, whole_chunks
from proxy.http.errors import BadResponse
from proxy.http.response import UpstreamResponse

MAX_HEAD = 256 * 1024  # status line and headers together, interim (1xx) heads included
_NO_BODY_STATUS: Final = frozenset({204, 304})
_CRLF: Final = b"\r\n"
_TRANSFER_ENCODING: Final = istr("Transfer-Encoding")  # its lower case made once
_CHUNKED_END = 4  # a chunked body and a head both end in CRLF CRLF after a visible byte
# Request body bytes handed to the transport at a time: past its high-water mark the rest waits
# for ``resume_writing``, so an upload to a slow reader holds about this much in the transport.
WRITE_PIECE = 64 * 1024
# A kept-alive connection the server closes sooner than this after its answer ended was not kept
# alive: the server closes after every answer, whatever its headers said (llama.cpp's
# llama-server says ``Keep-Alive: timeout=5`` and closes each stream's connection). Well below
# any keep-alive timeout a server sets (uvicorn 5 s, gunicorn 2 s, nginx 75 s).
EARLY_CLOSE = 1.0


class ConnectionState(IntEnum):
    """Where a connection is (the module docstring draws the transitions). The order matters:
    bytes from the server are welcome only up to ``BODY``; past it, the message is over."""

    HEAD = 0  # a request went out; its final head is not all in: reads are head bytes, capped
    BODY = 1  # the final head is in: reads go straight to the parser
    IDLE = 2  # no exchange: just connected, or pooled between requests
    REUSABLE = 3  # the message ended and the connection may carry the next request
    SPENT = 4  # the message ended; the connection must not carry another (released: closed)
    CLOSED = 5  # the server sent its EOF, the transport is gone, or this side aborted


# ``UpstreamConnection.state`` holds these plain ints, compared on every read (as a response's
# state does, proxy.http.response): Final, so that the compiled build inlines them;
# tests/http/test_pool.py checks that each equals its member.
HEAD: Final = 0
BODY: Final = 1
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

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        key: tuple[str, int, str | None],
        closed_early: Callable[[tuple[str, int, str | None]], None] | None = None,
    ) -> None:
        # First what every read reads, side by side at the object's start (as the response's).
        self.response: UpstreamResponse | None = None
        self.state = IDLE  # a ConnectionState, as its int
        # A chunked body's reads: the parser's last step was the head's or a chunk's end
        # (``_edge``), and the last read ended right there (``_at_boundary``: the next read may
        # skip the parser, ``_whole_chunks``).
        self._edge = False
        self._at_boundary = False
        self._recent = b""  # the last bytes received: at least 8, unless fewer came
        self.loop = loop
        self.key = key
        self.closed_early = closed_early  # told when the server closes it just after an answer
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.paused = False  # reading paused (``pause``)
        self.idle_since = 0.0
        self._head_room = MAX_HEAD
        self._last_body = b""  # the last body piece parsed: how the message ends
        self._chunked = False  # the final head's framing: the message ends in CRLF CRLF
        self._unsent: memoryview | None = None  # request body bytes not handed to the transport
        self._writing_paused = False  # the transport's buffer is past its high-water mark
        self._poller: Any = None  # its socket's select.poll, made at its first reuse (``stale``)

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
        if self.state == CLOSED or self.transport is None or self.transport.is_closing():
            return True
        poller = self._poller
        if poller is None:  # once per connection, not at every reuse: its socket is its own
            raw = self.transport.get_extra_info("socket")
            if raw is None:
                return False
            poller = self._poller = select.poll()
            poller.register(raw.fileno(), select.POLLIN)
        return bool(poller.poll(0))  # POLLIN, POLLHUP or POLLERR: the server is done with it

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed_by_server()
        self._enter_closed()
        if self.response is not None:
            self.response.on_close(clean=exc is None)

    def eof_received(self) -> bool | None:
        # The server is done with this connection: never hand it out again, whatever the
        # response in flight still delivers. Narrows the keep-alive race to the wire's delay.
        self._closed_by_server()
        self._enter_closed()
        return None  # close our side too

    def just_answered(self, now: float) -> bool:
        """Whether its last answer ended (and it was pooled) less than ``EARLY_CLOSE`` ago."""
        return self.idle_since > 0.0 and now - self.idle_since < EARLY_CLOSE

    def _closed_by_server(self) -> None:
        """Pooled, and closed by the server (an abort here enters ``CLOSED`` first) within
        ``EARLY_CLOSE`` of its answer's end: the pool is told."""
        closed_early = self.closed_early
        if self.state == IDLE and closed_early is not None and self.just_answered(self.loop.time()):
            closed_early(self.key)

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
            if state == BODY and self._at_boundary and (size := whole_chunks(data)) > 0:
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
        if isinstance(cause, BadResponse):
            return cause  # a head the proxy refuses (``on_headers_complete``)
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
            response.fields = []

    def on_status(self, status: bytes) -> None:
        if self.response is not None:
            self.response.reason = self._text(status)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.fields.append((self._text(name), self._text(value)))

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
        headers = response.headers = CIMultiDict(response.fields)  # one call, not one a header
        no_body = response.method == "HEAD" or status in _NO_BODY_STATUS
        chunked = False
        coded = headers.getall(_TRANSFER_ENCODING, None)
        if coded is not None and not no_body:
            # One decision, the parser's: the whole-chunk fast path runs only on a body it
            # reads as chunked, and a coding the proxy cannot relay fails before any byte
            # reaches the client (docs/behaviour.md#errors).
            framed = framing(coded)
            if framed == UNFRAMED:
                raise BadResponse(
                    f"upstream Transfer-Encoding the proxy cannot frame: {', '.join(coded)}"
                )
            chunked = framed == CHUNKED
        self._chunked = self._edge = chunked
        until_close = not no_body and not chunked and "Content-Length" not in headers
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


# A header name's part in a request head: copied, the Host, or left out (the framing is the
# proxy's own); remembered by the name as it came, a dict lookup where a ``str.lower`` and
# comparisons were.
_COPY: Final = 0
_HOST: Final = 1
_OMIT: Final = 2


def _part(name: str) -> int:
    lower = name.lower()
    if lower == "host":
        return _HOST
    if lower in ("content-length", "transfer-encoding", "connection"):
        return _OMIT
    return _COPY


_parts: Final = Remembered(_part, 512, 128)


def request_head(
    method: str,
    target: str,
    host: str,
    headers: Mapping[str, str] | CIMultiDict[str],
    body: bytes | None,
) -> bytes:
    # The head's pieces, joined once: a header's four pieces are appended as they are, not
    # built into a line of their own first. ``breaks``: the line breaks the pieces hold. The
    # Host line's value is set once every header is seen.
    pieces = [method, " ", target, " HTTP/1.1\r\nHost: ", "", "\r\n"]
    breaks = 2
    for name, value in headers.items():
        part = _parts.of(name)
        if part == _COPY:
            pieces.append(name)
            pieces.append(": ")
            pieces.append(value)
            pieces.append("\r\n")
            breaks += 1
        elif part == _HOST:
            host = value  # a replica reached by address keeps the configured host name
    pieces[4] = host
    if body is not None:
        pieces.append(f"Content-Length: {len(body)}\r\n\r\n")
        breaks += 2
    else:
        pieces.append("\r\n")
        breaks += 1
    text = "".join(pieces)
    # Each line ends in the one line break it was given: one count over the head, not four
    # searches a header.
    if text.count("\n") != breaks or text.count("\r") != breaks:
        _refuse_line_break(method, target, host, headers)
    # aiohttp's server decodes header bytes as UTF-8 with surrogate escapes: this is the inverse.
    return text.encode("utf-8", "surrogateescape")


def _refuse_line_break(
    method: str, target: str, host: str, headers: Mapping[str, str] | CIMultiDict[str]
) -> None:
    """Which part of a head holds a line break, raised: a header's, or the request line's."""
    for name, value in [*headers.items(), ("Host", host)]:
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break")
    raise ValueError(f"the request line {method!r} {target!r} has a line break")


def stream_path_compiled() -> bool:
    """Whether the modules every relayed or stitched chunk runs through are the mypyc build's
    (setup.py ``COMPILED``): each is compiled, or none is, so this module's own file tells."""
    return not __file__.endswith(".py")
