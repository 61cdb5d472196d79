"""The upstream connection pool against real loopback servers that answer with literal bytes."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from proxy.http import (
    BodyTooLong,
    ClientClosed,
    ConnectFailed,
    ConnectionPool,
    Disconnected,
    UpstreamResponse,
)
from proxy.http.connection import (
    EARLY_CLOSE,
    WRITE_PIECE,
    ConnectionState,
    UpstreamConnection,
    _crlf_after_end,
)
from proxy.http.errors import BadResponse, ConnectTimeout, ResponseTimeout
from proxy.http.response import Mode, ResponseState
from tests.support.polling import until

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
Serve = Callable[[Handler], Awaitable[tuple["Raw", str]]]
WAIT = 5.0  # seconds: a bound on every wait, not a timing assertion
LIMIT = 1 << 30  # bytes: read() holds the whole body up to this


class Raw:
    """A loopback server running ``handler(reader, writer, connection_number)`` per connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed = asyncio.Event()  # a connection ended (the peer closed or aborted)
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.closed.set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def pool() -> AsyncIterator[ConnectionPool]:
    pool = ConnectionPool()
    yield pool
    await pool.close()


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[Raw] = []

    async def start(handler: Handler) -> tuple[Raw, str]:
        raw = Raw(handler)
        servers.append(raw)
        return raw, await raw.start()

    yield start
    for raw in servers:
        await raw.stop()


def into(got: list[bytes], full: Callable[[], bool] = lambda: False) -> Callable[[bytes], bool]:
    """A relay's sink that keeps what it is given and is ``full()`` after each write."""

    def sink(data: bytes) -> bool:
        got.append(data)
        return full()

    return sink


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


def answering(*answers: bytes, close: bool = False) -> Handler:
    """Answer each request on a connection with the next literal bytes."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        for answer in answers:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()
        if not close:
            await reader.read()  # until the client closes

    return handler


async def get(
    pool: ConnectionPool, url: str, method: str = "GET", *, idle: float = WAIT, **kw: float
) -> UpstreamResponse:
    return await pool.request(
        url, method, "/x", {"Accept": "*/*"}, None, connect=kw.get("connect", WAIT),
        first_byte=kw.get("first_byte", WAIT), idle=idle,
    )  # fmt: skip


async def fetch(
    pool: ConnectionPool, url: str, method: str = "GET"
) -> tuple[UpstreamResponse, bytes]:
    response = await get(pool, url, method)
    try:
        return response, await response.read(LIMIT)
    finally:
        pool.release(response)


async def test_content_length_body_and_keep_alive_reuse(pool: ConnectionPool, serve: Serve) -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: 5\r\n\r\nhello"
    )
    raw, url = await serve(answering(answer, answer, answer))
    for _ in range(3):
        response, body = await fetch(pool, url)
        assert (response.status, response.reason, body) == (200, "OK", b"hello")
        assert response.content_type == "text/plain"
        assert response.content_length == 5
    assert raw.connections == 1
    assert pool.idle_connections() == 1


async def test_read_stops_at_its_limit_and_the_connection_is_not_reused(
    pool: ConnectionPool, serve: Serve
) -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b"x" * 1024
    _raw, url = await serve(answering(chunked + b"\r\n" * 1 + b"400\r\n" + b"y" * 1024 + b"\r\n"))
    response = await get(pool, url)
    with pytest.raises(BodyTooLong):
        await response.read(1500)
    pool.release(response)  # the body was left unread: its connection must go, not idle
    assert pool.idle_connections() == 0


async def test_request_carries_host_length_and_headers(pool: ConnectionPool, serve: Serve) -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await reader.read()

    _, url = await serve(handler)
    response = await pool.request(
        url, "POST", "/v1/x?a=1", {"X-A": "b", "Host": "evil", "Content-Length": "9"}, b"{}",
        connect=WAIT, first_byte=WAIT, idle=WAIT,
    )  # fmt: skip
    assert await response.read(LIMIT) == b""
    pool.release(response)
    head, body = seen[0]
    assert head.startswith(b"POST /v1/x?a=1 HTTP/1.1\r\n")
    assert b"\r\nHost: evil\r\n" in head
    assert b"\r\nX-A: b\r\n" in head
    assert b"evil" in head  # a Host the caller sets wins (replicas found by DNS)
    assert head.count(b"Host:") == 1
    assert head.count(b"Content-Length") == 1
    assert b"Content-Length: 2\r\n" in head
    assert body == b"{}"


@pytest.mark.parametrize("split", [1, 2, 7, 16])
async def test_heads_and_bodies_split_anywhere(
    pool: ConnectionPool, serve: Serve, split: int
) -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"v" * 40 + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n"
    )

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        for i in range(0, len(answer), split):
            writer.write(answer[i : i + split])
            await writer.drain()
            await asyncio.sleep(0)
        await reader.read()

    _, url = await serve(handler)
    response, body = await fetch(pool, url)
    assert response.headers["X-Long"] == "v" * 40
    assert body == b"abc0123456789abcdef"
    assert pool.idle_connections() == 1


async def test_chunked_with_extensions_and_trailers(pool: ConnectionPool, serve: Serve) -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'5;name=value;q="x"\r\nhello\r\n1;ext\r\n!\r\n0\r\nX-Trailer: yes\r\n\r\n'
    )
    _, url = await serve(answering(answer, answer))
    for _ in range(2):
        _, body = await fetch(pool, url)
        assert body == b"hello!"
    assert pool.idle_connections() == 1


async def test_close_delimited_body_ends_at_close_and_is_not_reused(
    pool: ConnectionPool, serve: Serve
) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it until the end"
    _, url = await serve(answering(answer, close=True))
    response, body = await fetch(pool, url)
    assert response.content_length is None
    assert body == b"all of it until the end"
    assert pool.idle_connections() == 0


async def test_server_closing_mid_body_is_a_bad_response(
    pool: ConnectionPool, serve: Serve
) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this"
    _, url = await serve(answering(answer, close=True))
    response = await get(pool, url)
    with pytest.raises(BadResponse):
        await response.read(LIMIT)
    pool.release(response)
    assert pool.idle_connections() == 0


async def test_chunked_cut_mid_body_is_a_bad_response(pool: ConnectionPool, serve: Serve) -> None:
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
    _, url = await serve(answering(answer, close=True))
    response = await get(pool, url)
    assert await response.__anext__() == b"hello"
    with pytest.raises(BadResponse):
        await response.__anext__()
    pool.release(response)


async def test_closed_before_any_head_is_disconnected(pool: ConnectionPool, serve: Serve) -> None:
    _, url = await serve(answering(b"", close=True))
    with pytest.raises(Disconnected):
        await get(pool, url)
    assert not pool.in_use


async def test_garbage_is_a_bad_response(pool: ConnectionPool, serve: Serve) -> None:
    _, url = await serve(answering(b"NOT HTTP AT ALL\r\n\r\n"))
    with pytest.raises(BadResponse):
        await get(pool, url)
    assert not pool.in_use


def dropping_the_second_request(seen: list[bytes]) -> Handler:
    """The first connection answers once, then drops the next request on it unanswered (the
    server closing a kept-alive connection as a request goes out); later ones answer."""
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(ok)
        await writer.drain()
        head, _ = await read_request(reader)
        seen.append(head.split(b" ", 1)[0])
        if n == 1:
            writer.transport.abort()
            return
        writer.write(ok)
        await reader.read()

    return handler


async def test_reset_on_a_reused_connection_fails_a_post_without_a_hidden_retry(
    pool: ConnectionPool, serve: Serve
) -> None:
    """The server drops a kept-alive connection as a POST goes out on it: the pool does not
    send it again behind the caller's back (the server may have acted on it; ``retry_on``
    decides)."""
    seen: list[bytes] = []
    raw, url = await serve(dropping_the_second_request(seen))
    _, body = await fetch(pool, url)
    assert body == b"ok"
    with pytest.raises(Disconnected):
        await pool.request(url, "POST", "/x", {}, b"{}", connect=WAIT, first_byte=WAIT, idle=WAIT)
    assert (raw.connections, seen, pool.resent) == (1, [b"POST"], 0)
    assert not pool.in_use


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
async def test_a_safe_request_on_a_reused_connection_reset_before_any_answer_goes_once_more(
    pool: ConnectionPool, serve: Serve, method: str
) -> None:
    """RFC 9110 §9.2.2, as nginx and Go: sent once more, on a fresh connection, and counted."""
    seen: list[bytes] = []
    raw, url = await serve(dropping_the_second_request(seen))
    await fetch(pool, url)
    response, _ = await fetch(pool, url, method)
    assert response.status == 200
    assert (raw.connections, pool.resent) == (2, 1)
    assert seen[0] == method.encode()  # the reused connection got it first
    assert not pool.in_use


async def test_pooled_connection_closed_while_idle_is_not_reused(
    pool: ConnectionPool, serve: Serve
) -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    raw, url = await serve(answering(ok, close=True))
    await fetch(pool, url)
    await asyncio.wait_for(raw.closed.wait(), WAIT)
    raw.closed.clear()
    for _ in range(100):  # bounded: until the client has seen the close
        if not pool.idle_connections() or all(
            c.state == ConnectionState.CLOSED for c in pool._idle[next(iter(pool._idle))]
        ):
            break
        await asyncio.sleep(0.01)
    _, body = await fetch(pool, url)
    assert body == b"ok"
    assert raw.connections == 2


async def test_a_connection_kept_through_reuses_still_sees_bytes_nobody_asked_for(
    pool: ConnectionPool, serve: Serve
) -> None:
    """``stale`` makes its socket's poll once, at the first reuse, and polls it at each one
    after: bytes the server sends unasked, and then its close, are still seen while the loop
    has not read them (reading paused here, as between two of the loop's passes)."""
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    unasked = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        for _ in range(3):
            await read_request(reader)
            writer.write(ok)
            await writer.drain()
        await unasked.wait()
        writer.write(b"HTTP/1.1 200 OK\r\n")
        await writer.drain()
        writer.close()

    raw, url = await serve(handler)
    for _ in range(3):  # the poll made at the first reuse serves the next ones
        _, body = await fetch(pool, url)
        assert body == b"ok"
    assert raw.connections == 1
    (connection,) = next(iter(pool._idle.values()))
    assert connection._poller is not None
    assert not connection.stale()
    assert connection.transport is not None
    connection.transport.pause_reading()
    unasked.set()
    for _ in range(500):  # bounded: until the bytes are in its socket
        if connection.stale():
            break
        await asyncio.sleep(0.01)
    assert connection.stale()
    connection.transport.resume_reading()


async def test_head_has_no_body_despite_its_length(pool: ConnectionPool, serve: Serve) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"
    _, url = await serve(answering(answer))
    response, body = await fetch(pool, url, "HEAD")
    assert (response.status, body, response.content_length) == (200, b"", 1234)


@pytest.mark.parametrize("status", [204, 304])
async def test_no_body_statuses_then_reuse(pool: ConnectionPool, serve: Serve, status: int) -> None:
    empty = f"HTTP/1.1 {status} X\r\nETag: a\r\n\r\n".encode()
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    raw, url = await serve(answering(empty, ok))
    response, body = await fetch(pool, url)
    assert (response.status, body) == (status, b"")
    _, body = await fetch(pool, url)
    assert body == b"ok"
    assert raw.connections == 1


async def test_interim_1xx_responses_are_skipped(pool: ConnectionPool, serve: Serve) -> None:
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\ndone"
    )
    _, url = await serve(answering(answer))
    response, body = await fetch(pool, url)
    assert (response.status, response.reason, body) == (201, "Created", b"done")
    assert "Link" not in response.headers


async def test_gzip_body_is_decoded_when_asked(pool: ConnectionPool, serve: Serve) -> None:
    packed = gzip.compress(b"data: x\n\n" * 100)
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(packed)
        + packed
    )
    _, url = await serve(answering(answer))
    response = await pool.request(
        url, "GET", "/", {}, None, connect=WAIT, first_byte=WAIT, idle=WAIT, inflate=True
    )
    assert response.content_length is None  # the decoded length is not the header's
    assert await response.read(LIMIT) == b"data: x\n\n" * 100
    pool.release(response)


async def test_refused_connection_is_a_connect_failure(pool: ConnectionPool, serve: Serve) -> None:
    raw, url = await serve(answering())
    await raw.stop()
    with pytest.raises(ConnectFailed) as failure:
        await get(pool, url)
    assert type(failure.value) is ConnectFailed  # not a timeout: refused at once
    assert_nothing_held(pool)


async def test_a_closed_pool_sends_nothing_more(serve: Serve) -> None:
    raw, url = await serve(answering(OK))
    pool = ConnectionPool()
    await pool.close()
    with pytest.raises(ClientClosed):
        await get(pool, url)
    assert raw.connections == 0


async def test_silent_upstream_hits_the_first_byte_timeout(
    pool: ConnectionPool, serve: Serve
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await reader.read()

    raw, url = await serve(handler)
    with pytest.raises(ResponseTimeout):
        await get(pool, url, first_byte=0.2)
    await asyncio.wait_for(raw.closed.wait(), WAIT)  # the connection was dropped
    assert not pool.in_use


async def test_body_going_silent_hits_the_idle_timeout(pool: ConnectionPool, serve: Serve) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"
    raw, url = await serve(answering(answer))
    response = await get(pool, url, idle=0.2)
    assert await response.__anext__() == b"half"
    with pytest.raises(ResponseTimeout):
        await response.__anext__()
    pool.release(response)
    await asyncio.wait_for(raw.closed.wait(), WAIT)


async def test_abandoned_body_closes_the_connection(pool: ConnectionPool, serve: Serve) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"
    raw, url = await serve(answering(answer))
    response = await get(pool, url)

    async def read_all() -> bytes:
        return await response.read(LIMIT)

    task = asyncio.ensure_future(read_all())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pool.release(response)
    await asyncio.wait_for(raw.closed.wait(), WAIT)
    assert pool.idle_connections() == 0
    assert not pool.in_use


async def test_iterator_pauses_reading_past_its_buffer(pool: ConnectionPool, serve: Serve) -> None:
    size = 4 * 1024 * 1024
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size
    sent = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        sent.set()
        await reader.read()

    _, url = await serve(handler)
    response = await pool.request(
        url, "GET", "/", {}, None, connect=WAIT, first_byte=WAIT, idle=WAIT, buffer=16384
    )
    for _ in range(50):  # let the client read what it will
        await asyncio.sleep(0.01)
    assert response.connection.paused
    assert response._buffered < 1024 * 1024  # bounded: not the 4 MiB the server wants to send
    assert len(await response.read(LIMIT)) == size
    pool.release(response)


async def test_relay_writes_from_data_received_and_waits_for_drain(
    pool: ConnectionPool, serve: Serve
) -> None:
    pieces = [b"data: %d\n\n" % i for i in range(20)]
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(
        b"%x\r\n%s\r\n" % (len(p), p) for p in pieces
    )
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(answer[:200])
        await writer.drain()
        await asyncio.wait_for(release.wait(), WAIT)
        writer.write(answer[200:] + b"0\r\n\r\n")
        await reader.read()

    _, url = await serve(handler)
    response = await get(pool, url, idle=0.2)
    got: list[bytes] = []
    drained = asyncio.Event()

    async def drain() -> None:
        # The sink stays "full" for longer than the idle timeout: the clock must not run.
        await asyncio.sleep(0.5)
        release.set()
        drained.set()

    def full() -> bool:
        return not drained.is_set()

    relay = asyncio.ensure_future(response.relay(into(got, full), full, drain))
    await asyncio.wait_for(relay, WAIT)
    assert b"".join(got) == b"".join(pieces)
    pool.release(response)
    assert pool.idle_connections() == 1


async def test_relay_cancelled_closes_the_connection(pool: ConnectionPool, serve: Serve) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"
    raw, url = await serve(answering(answer))
    response = await get(pool, url)
    got: list[bytes] = []
    relay = asyncio.ensure_future(
        response.relay(into(got), lambda: False, lambda: asyncio.sleep(0))
    )
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.01)
    relay.cancel()
    with pytest.raises(asyncio.CancelledError):
        await relay
    pool.release(response)
    await asyncio.wait_for(raw.closed.wait(), WAIT)
    assert got == [b"half"]


async def test_a_sink_that_raises_fails_the_relay_and_drops_the_connection(
    pool: ConnectionPool, serve: Serve
) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"
    raw, url = await serve(answering(answer))
    response = await get(pool, url)

    def sink(data: bytes) -> bool:
        raise ValueError("malformed")

    with pytest.raises(ValueError, match="malformed"):
        await asyncio.wait_for(response.relay(sink, lambda: False, lambda: asyncio.sleep(0)), WAIT)
    pool.release(response)
    await asyncio.wait_for(raw.closed.wait(), WAIT)


async def test_bytes_after_the_end_in_a_later_read_are_nobodys_and_spoil_the_connection(
    pool: ConnectionPool, serve: Serve
) -> None:
    """The answer ended; more bytes come while the caller still holds it (before release)."""
    more = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        await writer.drain()
        await asyncio.wait_for(more.wait(), WAIT)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled")
        await reader.read()

    raw, url = await serve(handler)
    response = await get(pool, url)
    more.set()
    await asyncio.wait_for(raw.closed.wait(), WAIT)  # the client closed it at the extra bytes
    assert await response.read(LIMIT) == b"hello"
    pool.release(response)
    assert pool.idle_connections() == 0


@pytest.mark.parametrize(
    ("data", "own", "after"),
    [
        (b"hello", 0, False),
        (b"0\r\n\r\n", 4, False),
        (b"0\r\n\r\n\r\n", 4, True),
        (b"x\n", 1, False),
        (b"x\n\n", 1, True),
        (b"\r\n", 4, True),  # all of it CR/LF: the message's end cannot be told apart
        (b"x\r\n", None, True),
        (b"", 4, False),
    ],
)
def test_crlf_after_a_message_end_is_counted(data: bytes, own: int | None, after: bool) -> None:
    assert _crlf_after_end(data, own) is after


# --- cancellation, connect turns, request writing and stale connections ---------------------


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
EVERY = (OK,) * 1000  # an answer to each request on a connection, bounded


async def post(pool: ConnectionPool, url: str, body: bytes = b"{}") -> UpstreamResponse:
    return await pool.request(url, "POST", "/x", {}, body, connect=WAIT, first_byte=WAIT, idle=WAIT)


def assert_nothing_held(pool: ConnectionPool) -> None:
    assert not pool.in_use
    assert pool.connecting == {}
    assert not pool._turns


async def test_a_connect_that_completes_as_its_caller_is_cancelled_leaves_nothing_open(
    pool: ConnectionPool, serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancellation and the connect's completion in one loop turn (CPython gh-86296,
    where ``wait_for`` returned the connection and dropped the cancellation)."""
    raw, url = await serve(answering(OK))
    loop = asyncio.get_running_loop()
    connect = loop.create_connection
    victim: asyncio.Task[UpstreamResponse] | None = None

    async def cancelled_as_it_connects(*args: Any, **kwargs: Any) -> Any:
        made = await connect(*args, **kwargs)
        assert victim is not None
        victim.cancel()  # in the same turn as the connect's result
        return made

    monkeypatch.setattr(loop, "create_connection", cancelled_as_it_connects)
    victim = asyncio.ensure_future(get(pool, url))
    with pytest.raises(asyncio.CancelledError):
        await victim
    await asyncio.wait_for(raw.closed.wait(), WAIT)  # the connection made was closed
    assert_nothing_held(pool)
    assert pool.idle_connections() == 0


class Connects:
    """``loop.create_connection`` counted: how many are in progress, and the most at once;
    each waits for ``go`` before connecting when it is cleared."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.real = loop.create_connection
        self.now = self.peak = self.started = 0
        self.go = asyncio.Event()
        self.go.set()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.now += 1
        self.started += 1
        self.peak = max(self.peak, self.now)
        try:
            await self.go.wait()
            return await self.real(*args, **kwargs)
        finally:
            self.now -= 1


@pytest.fixture
async def connects(monkeypatch: pytest.MonkeyPatch) -> Connects:
    loop = asyncio.get_running_loop()
    counted = Connects(loop)
    monkeypatch.setattr(loop, "create_connection", counted)
    return counted


async def test_a_burst_to_one_origin_opens_at_most_max_connecting_at_once(
    serve: Serve, connects: Connects
) -> None:
    pool = ConnectionPool(max_connecting=8)
    try:
        raw, url = await serve(answering(*EVERY))
        async with asyncio.timeout(WAIT * 3):
            bodies = await asyncio.gather(*(fetch(pool, url) for _ in range(200)))
        assert [body for _, body in bodies] == [b"ok"] * 200
        assert connects.peak == 8  # the bound, reached
        assert raw.connections == connects.started  # later ones took pooled connections too
        assert_nothing_held(pool)
    finally:
        await pool.close()


async def test_a_connect_or_its_wait_in_line_past_the_connect_bound_is_a_connect_timeout(
    serve: Serve, connects: Connects
) -> None:
    pool = ConnectionPool(max_connecting=1)
    try:
        _, url = await serve(answering(*EVERY))
        connects.go.clear()  # every connect hangs until told
        with pytest.raises(ConnectTimeout, match=r"timed out after 0\.2 s") as failure:
            await get(pool, url, connect=0.2)  # in the connect itself
        assert isinstance(failure.value, TimeoutError)
        assert_nothing_held(pool)
        first = asyncio.ensure_future(get(pool, url))  # takes the one connect turn
        for _ in range(3):
            await asyncio.sleep(0)
        assert connects.now == 1
        with pytest.raises(ConnectTimeout, match=r"timed out after 0\.2 s"):
            await get(pool, url, connect=0.2)  # in line behind ``first``
        assert connects.started == 2  # the one that waited in line never connected
        connects.go.set()
        response = await asyncio.wait_for(first, WAIT)
        assert await response.read(LIMIT) == b"ok"
        pool.release(response)
        assert_nothing_held(pool)
    finally:
        await pool.close()


async def test_cancelled_waiters_for_a_connect_turn_leave_nothing_held(
    serve: Serve, connects: Connects
) -> None:
    pool = ConnectionPool(max_connecting=2)
    try:
        _, url = await serve(answering(*EVERY))
        connects.go.clear()  # the first two connects hang; the rest wait in line
        tasks = [asyncio.ensure_future(get(pool, url)) for _ in range(20)]
        for _ in range(3):
            await asyncio.sleep(0)
        assert connects.now == 2
        assert len(pool._turns[next(iter(pool._turns))]) == 18
        for task in tasks[::2]:  # two connecting and eight in line
            task.cancel()
        await asyncio.sleep(0)
        connects.go.set()
        for task in tasks[1::2]:  # the others get their answers, in turn
            response = await asyncio.wait_for(task, WAIT)
            assert await response.read(LIMIT) == b"ok"
            pool.release(response)
        for task in tasks[::2]:
            assert task.cancelled()
        assert_nothing_held(pool)
        assert connects.peak == 2
    finally:
        await pool.close()


async def test_a_waiter_cancelled_as_its_turn_comes_passes_the_turn_on(
    serve: Serve, connects: Connects
) -> None:
    pool = ConnectionPool(max_connecting=1)
    try:
        _, url = await serve(answering(*EVERY))
        connects.go.clear()
        first, second, third = (asyncio.ensure_future(get(pool, url)) for _ in range(3))
        for _ in range(3):
            await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        real = connects.real

        async def then_cancel_the_next(*args: Any, **kwargs: Any) -> Any:
            made = await real(*args, **kwargs)
            # Runs once the turn is given to ``second`` and before ``second`` runs.
            loop.call_soon(second.cancel)
            return made

        connects.real = then_cancel_the_next
        connects.go.set()
        # ``first`` keeps its connection meanwhile: only the turn passed on lets ``third`` in.
        for task in (third, first):
            response = await asyncio.wait_for(task, WAIT)
            assert await response.read(LIMIT) == b"ok"
            pool.release(response)
        with pytest.raises(asyncio.CancelledError):
            await second
        assert_nothing_held(pool)
    finally:
        await pool.close()


BIG = 32 << 20  # an upload far past what the kernel's socket buffers hold on loopback


async def test_an_upload_to_a_slow_reader_is_written_as_the_transport_takes_it(
    pool: ConnectionPool, serve: Serve
) -> None:
    reading = asyncio.Event()
    got: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reading.wait()  # reads nothing until told
        got.append(len(await reader.readexactly(BIG)))
        writer.write(OK)
        await reader.read()

    _, url = await serve(handler)
    upload = asyncio.ensure_future(post(pool, url, b"u" * BIG))
    (connection,) = await until(lambda: pool.in_use, 5.0)
    transport = connection.transport
    assert transport is not None
    for _ in range(20):  # while the server reads nothing, the proxy holds about one piece
        await asyncio.sleep(0.01)
        assert transport.get_write_buffer_size() <= 2 * WRITE_PIECE
    reading.set()
    response = await asyncio.wait_for(upload, WAIT)
    assert got == [BIG]
    assert await response.read(LIMIT) == b"ok"
    pool.release(response)
    assert pool.idle_connections() == 1  # written whole before the answer: reusable


async def test_an_answer_before_the_upload_was_written_never_pools_its_connection(
    pool: ConnectionPool, serve: Serve
) -> None:
    """A 413 with keep-alive before reading the body: the server may take the rest of the
    body as requests, so the connection is closed and the next request gets a new one."""
    too_large = b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(too_large if n == 1 else OK)
        await reader.read()

    raw, url = await serve(handler)
    response = await post(pool, url, b"u" * BIG)
    assert response.status == 413
    assert await response.read(LIMIT) == b""
    pool.release(response)
    assert pool.idle_connections() == 0
    _, body = await fetch(pool, url)
    assert (body, raw.connections) == (b"ok", 2)


async def test_a_pooled_connection_whose_fin_is_already_queued_is_not_reused(
    pool: ConnectionPool, serve: Serve
) -> None:
    """A server that says keep-alive and closes after every answer: its FIN is in the socket
    before the next request goes out, unread by the loop yet. The poll sees it, so neither a
    GET nor a POST goes out on that connection."""
    closing = b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(closing)
        writer.write_eof()  # the FIN right behind the answer
        await reader.read()

    raw, url = await serve(handler)
    for i in range(20):
        if i % 2:
            response = await post(pool, url)
            body = await response.read(LIMIT)
            pool.release(response)
        else:
            _, body = await fetch(pool, url)
        assert body == b"ok", i
    assert (raw.connections, pool.resent) == (20, 0)  # never reused, never resent
    assert_nothing_held(pool)


def closing_late(*, after: float, kept: Callable[[int], bool] = lambda n: False) -> Handler:
    """A server that says keep-alive and closes each connection ``after`` seconds after its
    answer, reading nothing more (llama-server's HTTP thread, slow to close on a busy machine);
    connection ``n`` is kept alive if ``kept(n)``."""
    answer = b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5, max=100\r\nContent-Length: 2\r\n\r\nok"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()
            if not kept(n):
                await asyncio.sleep(after)
                return  # Raw closes the connection

    return handler


async def test_an_origin_closing_connections_just_after_answers_gets_no_young_one(
    pool: ConnectionPool, serve: Serve
) -> None:
    """Its FIN comes after the next request could go out on the connection: once the pool has
    seen one such close, it reuses none of that origin's connections younger than
    ``EARLY_CLOSE``, so POSTs sent right after each answer all go on fresh connections."""
    raw, url = await serve(closing_late(after=0.05))
    key = ("127.0.0.1", int(url.rsplit(":", 1)[1]), None)
    response = await post(pool, url)
    assert await response.read(LIMIT) == b"ok"
    pool.release(response)
    await until(lambda: key in pool.closers, 5.0)  # the pooled connection closed 50 ms after
    for i in range(20):
        response = await post(pool, url)  # right after the last answer: no time to close
        assert await response.read(LIMIT) == b"ok", i
        pool.release(response)
    assert (raw.connections, pool.resent) == (21, 0)
    assert_nothing_held(pool)


async def test_a_post_lost_on_a_connection_closed_just_after_its_answer_marks_the_origin(
    pool: ConnectionPool, serve: Serve
) -> None:
    """The race itself: the request went out before the server's FIN came. It fails (a POST
    is not sent again) and the origin is marked: the next one goes on a fresh connection."""
    seen: list[bytes] = []
    raw, url = await serve(dropping_the_second_request(seen))
    await fetch(pool, url)
    with pytest.raises(Disconnected):
        await post(pool, url)
    assert pool.closers == {("127.0.0.1", int(url.rsplit(":", 1)[1]), None)}
    _, body = await fetch(pool, url)
    assert (body, raw.connections) == (b"ok", 2)


async def test_an_origin_seen_closing_early_is_reused_again_once_a_connection_stays_open(
    pool: ConnectionPool, serve: Serve
) -> None:
    """Only its first connection closes after the answer; later ones are kept alive. A
    connection that has stayed open ``EARLY_CLOSE`` is reused, and the origin's mark goes."""
    raw, url = await serve(closing_late(after=0.0, kept=lambda n: n > 1))
    key = ("127.0.0.1", int(url.rsplit(":", 1)[1]), None)
    await fetch(pool, url)
    await until(lambda: key in pool.closers, 5.0)
    await fetch(pool, url)  # connection 2
    await fetch(pool, url)  # connection 3: 2 is too young to trust
    assert raw.connections == 3
    await asyncio.sleep(EARLY_CLOSE + 0.1)  # both stay open: settled
    for _ in range(3):
        await fetch(pool, url)  # a settled one, then the same one right away: unmarked
    assert (raw.connections, pool.closers) == (3, set())


async def test_an_origin_keeping_connections_alive_is_never_marked(
    pool: ConnectionPool, serve: Serve
) -> None:
    raw, url = await serve(closing_late(after=0.0, kept=lambda n: True))
    for _ in range(5):
        await fetch(pool, url)
    await pool.close()  # its own closes say nothing of the server
    assert (raw.connections, pool.closers) == (1, set())


# --- the connection's and the response's states ----------------------------------------------


async def test_a_kept_alive_exchange_walks_head_body_reusable_idle(
    pool: ConnectionPool, serve: Serve
) -> None:
    body_now = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(body_now.wait(), WAIT)
        writer.write(b"hello")
        await reader.read()

    _, url = await serve(handler)
    response = await get(pool, url)
    connection = response.connection
    assert isinstance(connection, UpstreamConnection)
    assert (connection.state, response.state) == (ConnectionState.BODY, ResponseState.BODY)
    body_now.set()
    assert await response.read(LIMIT) == b"hello"
    assert (connection.state, response.state) == (ConnectionState.REUSABLE, ResponseState.COMPLETE)
    pool.release(response)
    assert connection.state == ConnectionState.IDLE
    assert connection.response is None
    assert pool.idle_connections() == 1


async def test_a_head_request_spends_its_connection(pool: ConnectionPool, serve: Serve) -> None:
    _, url = await serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n"))
    response = await get(pool, url, "HEAD")
    connection = response.connection
    assert isinstance(connection, UpstreamConnection)
    assert (connection.state, response.state) == (ConnectionState.SPENT, ResponseState.COMPLETE)
    pool.release(response)
    assert connection.state == ConnectionState.CLOSED
    assert pool.idle_connections() == 0


async def test_a_body_cut_short_fails_the_response_and_closes_the_connection(
    pool: ConnectionPool, serve: Serve
) -> None:
    _, url = await serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nhalf", close=True))
    response = await get(pool, url)
    got: list[bytes] = []
    with pytest.raises(BadResponse, match="mid-body"):
        await response.relay(into(got), lambda: False, lambda: asyncio.sleep(0))
    connection = response.connection
    assert isinstance(connection, UpstreamConnection)
    assert (response.state, response.mode) == (ResponseState.FAILED, Mode.RELAY)
    assert connection.state == ConnectionState.CLOSED
    assert b"".join(got) == b"half"
    pool.release(response)
    assert_nothing_held(pool)


def test_the_state_numbers_are_their_members_values() -> None:
    """The connection and the response compare plain ints on every read: each is its enum
    member's value, in the module of its own state machine."""
    from proxy.http import connection as c
    from proxy.http import response as r

    assert tuple(ResponseState) == (r.HEAD, r.BODY, r.ENDED, r.COMPLETE, r.FAILED)
    assert tuple(Mode) == (r.ITERATE, r.RELAY)
    assert tuple(ConnectionState) == (c.HEAD, c.BODY, c.IDLE, c.REUSABLE, c.SPENT, c.CLOSED)
