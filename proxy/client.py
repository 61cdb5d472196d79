"""A lean HTTP/1.1 client for the upstream hot path: an ``asyncio.Protocol`` around httptools.

One ``Connection`` per socket, kept alive in a ``ClientPool`` per origin. A ``Response`` body is
read either as an async iterator (fan-out children) or relayed straight from ``data_received``
into a sink (pass-through: no task, queue or iterator per chunk). Flow control is the
transport's: reading pauses past a buffer limit or when the sink is paused, and the idle clock
stops while it is paused (a slow client is not a silent upstream). Failures are the exceptions
aiohttp's client raises, so callers catch one set::

    aiohttp.ClientError
    ├── ClientConnectorError     connect refused or unreachable (also an OSError)
    ├── ConnectionTimeoutError   connect timeout (also a TimeoutError)
    ├── ServerDisconnectedError  closed before a complete head
    ├── ClientPayloadError       body cut short, malformed response, undecodable encoding
    └── ServerTimeoutError       connect, first byte or idle timeout (also a TimeoutError)
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp
import httptools
from multidict import CIMultiDict

Sink = Callable[[bytes], None]
BODY_BUFFER = 64 * 1024  # iterator mode: pause reading past this many unread body bytes
# An idle pooled connection older than this is closed, not reused: below uvicorn's (and so
# vLLM's) 5 s keep-alive, so the server rarely closes one just as a request goes out on it.
KEEPALIVE_SECONDS = 4.0
MAX_IDLE_PER_ORIGIN = 1024
MAX_HEAD = 256 * 1024  # status line and headers together
_NO_BODY_STATUS = frozenset({204, 304})


class BodyTooLong(Exception):
    """A body grew past the bytes the caller holds for one response."""


class _HeadDone(Exception):
    """Raised from the parser's callback to stop after a HEAD response's headers."""


class Response:
    """One upstream response: head fields at once, the body streamed.

    Also its own ``.response`` and ``.body`` so code written for aiohttp's ``ClientResponse``
    wrapped in a reply (``reply.response.status``, ``async for x in reply.body``) reads it as is.
    """

    def __init__(self, connection: Connection, method: str, limit: int, decompress: bool) -> None:
        self._connection = connection
        self._loop = connection.loop
        self.method = method
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self._limit = limit
        self._decompress = decompress
        self._decoder: zlib._Decompress | None = None
        self._head: asyncio.Future[None] = self._loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._waiting_since: float | None = None
        self.complete = False  # the whole body arrived
        self.error: BaseException | None = None
        self._sink: Sink | None = None
        self._sink_paused: Callable[[], bool] | None = None
        self._relay_done: asyncio.Future[None] | None = None
        self._out: list[bytes] = []
        self._last_data = 0.0
        self._idle = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self.until_close = False  # a body delimited by the connection closing

    @property
    def response(self) -> Response:
        return self

    @property
    def body(self) -> Response:
        return self

    @property
    def content_type(self) -> str:
        raw = self.headers.get("Content-Type")
        if not raw:
            return "application/octet-stream"
        return raw.split(";", 1)[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        raw = self.headers.get("Content-Length")
        if raw is None or ("Content-Encoding" in self.headers and self._decompress):
            return None
        try:
            return int(raw)
        except ValueError:
            return None

    # ---- parser side (called from Connection.data_received)

    def _on_head(self, status: int, until_close: bool) -> None:
        self.status = status
        self.until_close = until_close
        if self._decompress:
            encoding = self.headers.get("Content-Encoding", "").strip().lower()
            if encoding in ("gzip", "x-gzip"):
                self._decoder = zlib.decompressobj(wbits=31)
            elif encoding == "deflate":
                self._decoder = zlib.decompressobj(wbits=47)
            elif encoding not in ("", "identity"):
                self._fail(aiohttp.ClientPayloadError(f"cannot decode Content-Encoding {encoding}"))
                return
        if not self._head.done():
            self._head.set_result(None)

    def _on_body(self, data: bytes) -> None:
        if self._decoder is not None:
            try:
                data = self._decoder.decompress(data)
            except zlib.error as exc:
                self._fail(aiohttp.ClientPayloadError(f"bad compressed body: {exc}"))
                return
            if not data:
                return
        if self._sink is not None:
            self._out.append(data)
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > self._limit:
            self._connection.pause()
        _wake(self._waiter)

    def _on_complete(self) -> None:
        if self._decoder is not None:
            try:
                tail = self._decoder.flush()
            except zlib.error as exc:
                self._fail(aiohttp.ClientPayloadError(f"bad compressed body: {exc}"))
                return
            if tail:
                self._decoder = None
                self._on_body(tail)
        self.complete = True
        self._stop_idle()
        if self._relay_done is not None:
            _settle(self._relay_done)
        _wake(self._waiter)

    def _fail(self, exc: BaseException) -> None:
        if self.complete or self.error is not None:
            return
        self.error = exc
        self._stop_idle()
        if not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved here: the caller may have stopped waiting
        if self._relay_done is not None:
            _settle(self._relay_done, exc)
        _wake(self._waiter)
        self._connection.abort()

    def _flush(self) -> None:
        """After one ``data_received``: the relayed pieces leave in one write."""
        out = self._out
        if out and self._sink is not None:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            try:
                self._sink(data)
            except Exception as exc:  # e.g. a malformed stream: the relay raises it
                self._fail(exc)
                return
            paused = self._sink_paused
            if paused is not None and paused():
                self._connection.pause()
                if self._relay_done is not None:
                    _settle(self._relay_done)  # wakes the relay's task to wait for the drain

    # ---- head and timeouts

    async def _wait_head(self, first_byte: float) -> None:
        timer = self._loop.call_later(
            first_byte,
            self._fail,
            aiohttp.ServerTimeoutError(f"no response head from upstream within {first_byte} s"),
        )
        try:
            await self._head
        finally:
            timer.cancel()

    def _start_idle(self, idle: float) -> None:
        self._idle = idle
        self._last_data = self._loop.time()
        if not self.complete and self.error is None:
            self._idle_timer = self._loop.call_later(idle, self._check_idle)

    def _stop_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_since(self) -> float | None:
        """When the idle clock started, or None while it is stopped."""
        if self._sink is not None:
            return None if self._connection.paused else self._last_data
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
            self._fail(aiohttp.ServerTimeoutError(f"no data from upstream for {self._idle} s"))
            return
        start = since if since is not None else now
        self._idle_timer = self._loop.call_at(start + self._idle, self._check_idle)

    # ---- iterator mode

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        while not self._chunks:
            if self.error is not None:
                raise self.error
            if self.complete:
                raise StopAsyncIteration
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
        self._connection.resume()
        return data

    async def read(self, limit: int) -> bytes:
        return await read_capped(self, limit)

    # ---- relay mode

    async def relay(
        self, sink: Sink, paused: Callable[[], bool], drain: Callable[[], Awaitable[None]]
    ) -> None:
        """Hand every body byte to ``sink`` from ``data_received``, until the body ends.

        ``paused`` says the sink's buffer is full; this task then awaits ``drain()`` and
        resumes reading. Raises the body's failure; cancelling it aborts the connection.
        """
        self._sink = sink
        self._sink_paused = paused
        if self._chunks:  # anything read before the relay began
            data = b"".join(self._chunks)
            self._chunks.clear()
            self._buffered = 0
            sink(data)
        if not paused():
            self._connection.resume()
        else:
            self._connection.pause()
        self._last_data = self._loop.time()
        while True:
            if self.error is not None:
                raise self.error
            if self.complete:
                return
            if self._connection.paused:
                if paused():
                    await drain()
                self._last_data = self._loop.time()  # the idle clock stood still meanwhile
                self._connection.resume()
                continue
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


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def _settle(future: asyncio.Future[None], exc: BaseException | None = None) -> None:
    if not future.done():
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)
            future.exception()


class Connection(asyncio.Protocol):
    """One keep-alive socket to one origin; at most one response in flight."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: tuple[str, int]) -> None:
        self.loop = loop
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.paused = False
        self.lost = False
        self.reusable = False
        self.used = 0  # responses completed on it
        self.idle_since = 0.0
        self._head_size = 0
        self._received = False  # any byte of the current response

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.reusable = False
        response = self.response
        if response is None or response.complete or response.error is not None:
            return
        if response.until_close and exc is None and response._head.done():
            response._on_complete()  # a body delimited by the connection closing ended cleanly
        elif response._head.done():
            response._fail(aiohttp.ClientPayloadError("upstream closed the connection mid-body"))
        else:
            response._fail(aiohttp.ServerDisconnectedError("upstream closed before a response"))

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            self.abort()  # bytes nobody asked for: this connection is not safe to reuse
            return
        self._received = True
        if response._sink is not None:
            response._last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _HeadDone):
                self.reusable = False  # bytes after a HEAD's head are not ours to reparse
                response._on_complete()
                return
            response._fail(aiohttp.ClientPayloadError(f"malformed upstream response: {exc}"))
            return
        except httptools.HttpParserError as exc:
            response._fail(aiohttp.ClientPayloadError(f"malformed upstream response: {exc}"))
            return
        except httptools.HttpParserUpgrade:
            response._fail(aiohttp.ClientPayloadError("upstream switched protocols"))
            return
        response._flush()

    def pause_writing(self) -> None:
        pass  # request bodies are written whole; the kernel buffer takes them

    def resume_writing(self) -> None:
        pass

    # ---- httptools callbacks

    def on_message_begin(self) -> None:
        response = self.response
        if response is not None:
            response.headers = CIMultiDict()
        self._head_size = 0

    def on_status(self, status: bytes) -> None:
        if self.response is not None:
            self.response.reason = status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD:
            raise ValueError("response head too large")
        if self.response is not None:
            self.response.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:
                raise ValueError("upstream switched protocols")
            return  # an interim response: the real head follows
        headers = response.headers
        chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        no_body = response.method == "HEAD" or status in _NO_BODY_STATUS
        until_close = not no_body and not chunked and "Content-Length" not in headers
        response._on_head(status, until_close)
        if response.method == "HEAD":
            raise _HeadDone

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._on_body(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is None or not response._head.done():
            return  # the end of an interim (1xx) response
        self.reusable = self.parser.should_keep_alive() and not response.until_close
        response._on_complete()

    # ---- flow control and teardown

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.lost:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.lost:
            self.transport.abort()


def _origin(base_url: str) -> tuple[str, int, str]:
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the lean client speaks plain http only: {base_url}")
    port = parts.port or 80
    host_header = parts.hostname if port == 80 else f"{parts.hostname}:{port}"
    if ":" in parts.hostname:  # IPv6 literal
        host_header = f"[{parts.hostname}]" if port == 80 else f"[{parts.hostname}]:{port}"
    return parts.hostname, port, host_header


def _request_head(
    method: str,
    path_qs: str,
    host: str,
    headers: Mapping[str, str] | CIMultiDict[str],
    body: bytes | None,
) -> bytes:
    lines = [f"{method} {path_qs} HTTP/1.1\r\n", ""]
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


class ClientPool:
    """Keep-alive connections per origin; ``request`` returns once the response head is in."""

    def __init__(
        self,
        *,
        keepalive: float = KEEPALIVE_SECONDS,
        max_idle_per_origin: int = MAX_IDLE_PER_ORIGIN,
    ) -> None:
        self.keepalive = keepalive
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self.in_use: set[Connection] = set()
        self._origins: dict[str, tuple[str, int, str]] = {}
        self._closed = False

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def request(
        self,
        base_url: str,
        method: str,
        path_qs: str,
        headers: Mapping[str, str] | CIMultiDict[str],
        body: bytes | None,
        *,
        connect: float | None,
        first_byte: float | None,
        idle: float,
        decompress: bool = False,
        buffer: int = BODY_BUFFER,
    ) -> Response:
        """Send one request and wait for the head. The caller must ``release`` the response."""
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = _origin(base_url)
        host, port, host_header = origin
        data = _request_head(method, path_qs, host_header, headers, body)
        if body:
            data += body
        for attempt in range(2):
            connection, reused = await self._connect(host, port, connect)
            response = Response(connection, method, buffer, decompress)
            connection.response = response
            connection._received = False
            self.in_use.add(connection)
            try:
                assert connection.transport is not None
                connection.transport.write(data)
                await response._wait_head(first_byte if first_byte is not None else 86400.0)
            except aiohttp.ServerDisconnectedError:
                self._drop(connection)
                # A pooled connection the server had closed as we picked it: retry once, fresh.
                if reused and not connection._received and attempt == 0:
                    continue
                raise
            except BaseException:
                self._drop(connection)
                raise
            response._start_idle(idle)
            return response
        raise AssertionError("unreachable")  # pragma: no cover

    async def _connect(
        self, host: str, port: int, timeout: float | None
    ) -> tuple[Connection, bool]:
        if self._closed:
            raise aiohttp.ClientOSError(0, "the upstream client is closed")
        idle = self._idle.get((host, port))
        loop = asyncio.get_running_loop()
        now = loop.time()
        while idle:
            connection = idle.pop()
            if connection.lost or now - connection.idle_since > self.keepalive:
                connection.abort()
                continue
            return connection, True
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(lambda: Connection(loop, (host, port)), host, port),
                timeout,
            )
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(
                f"connecting to {host}:{port} timed out after {timeout} s"
            ) from None
        except OSError as exc:
            # aiohttp's own connect failure, so callers tell "never reached a server" apart.
            key = SimpleNamespace(host=host, port=port, ssl=None)
            raise aiohttp.ClientConnectorError(cast(Any, key), exc) from None
        return protocol, False

    def release(self, response: Response) -> None:
        """Back to the pool when its body was read to the end; closed (never reused) otherwise."""
        connection = response._connection
        response._stop_idle()
        self.in_use.discard(connection)
        if (
            response.complete
            and connection.reusable
            and not connection.lost
            and not self._closed
            and connection.response is response
        ):
            connection.response = None
            connection.used += 1
            connection.resume()
            connection.idle_since = asyncio.get_running_loop().time()
            pool = self._idle.setdefault(connection.origin, [])
            if len(pool) < self.max_idle_per_origin:
                pool.append(connection)
                return
        connection.response = None
        connection.abort()

    def _drop(self, connection: Connection) -> None:
        self.in_use.discard(connection)
        connection.response = None
        connection.abort()

    async def close(self) -> None:
        self._closed = True
        for pool in self._idle.values():
            for connection in pool:
                connection.abort()
        self._idle.clear()
        for connection in list(self.in_use):
            connection.abort()
        self.in_use.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost
