"""Keep-alive HTTP/1.1 connections to the upstreams, http and https alike; the proxy's only
upstream client (``proxy.http.connection`` per connection, ``proxy.http.response`` per answer).

A request is sent once: a failure is the caller's to retry or not (``retry_on``), so the pool
never repeats one behind its back, with one exception: a safe request (GET, HEAD, OPTIONS,
TRACE) on a reused connection that fails before any byte of an answer is sent once more on a
fresh connection, as nginx and Go do (RFC 9110 §9.2.2): the server had closed that connection
as the request went out. An origin seen closing connections just after their answers while
saying keep-alive (``EARLY_CLOSE``) gets only connections that have stayed open that long, until
one does: the next request would often go out on a connection the server is closing, and a POST
there is lost. Connections to one origin are opened at most ``max_connecting`` at a
time; the rest wait in line for a freed turn or a connection released meanwhile. Failures are
``proxy.http.errors``' tree, under ``HTTPClientError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import Mapping

from multidict import CIMultiDict

from proxy.core import Origin, parse_origin
from proxy.http.connection import (
    EARLY_CLOSE,
    ConnectionState,
    UpstreamConnection,
    request_head,
)
from proxy.http.errors import ClientClosed, ConnectFailed, ConnectTimeout, Disconnected
from proxy.http.response import HeadClock, UpstreamResponse
from proxy.observe import log_event

BODY_BUFFER = 64 * 1024  # bytes read ahead of the consumer at most, inflated bytes included
# An idle pooled connection older than this is closed, not reused: below uvicorn's (and so
# vLLM's) 5 s keep-alive, so the server rarely closes one just as a request goes out on it.
KEEPALIVE_SECONDS = 4.0
MAX_IDLE_PER_ORIGIN = 1024
# Connects in progress to one origin at most: a burst of children queues here rather than
# overflowing the upstream's accept queue (a SYN dropped there costs a 1 s retransmission).
MAX_CONNECTING_PER_ORIGIN = 64
# Safe methods (RFC 9110 §9.2.1), sent once more when a reused connection fails before any
# byte of an answer; others (POST above all) stay sent once: the server may have acted on them.
RESENDABLE = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
Key = tuple[str, int, str | None]  # host, port, TLS server name (None: plain http)


class ConnectionPool:
    """Keep-alive connections per origin; ``request`` returns once the response head is in."""

    def __init__(
        self,
        *,
        keepalive: float = KEEPALIVE_SECONDS,
        max_idle_per_origin: int = MAX_IDLE_PER_ORIGIN,
        max_connecting: int = MAX_CONNECTING_PER_ORIGIN,
    ) -> None:
        self.keepalive = keepalive
        self.max_idle_per_origin = max_idle_per_origin
        self.max_connecting = max_connecting
        self._idle: dict[Key, list[UpstreamConnection]] = {}
        self.in_use: set[UpstreamConnection] = set()
        self.connecting: dict[Key, int] = {}  # connects in progress per origin
        self._turns: dict[Key, deque[asyncio.Future[None]]] = {}  # waiting to connect, FIFO
        self.resent = 0  # safe requests sent once more after a reused connection failed
        # Origins seen closing kept-alive connections within EARLY_CLOSE of an answer's end.
        self.closers: set[Key] = set()
        self._origins: dict[str, Origin] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False
        self._clock: HeadClock | None = None  # the waits for heads, on the connections' loop

    def idle_connections(self) -> int:
        """How many idle connections are kept alive for reuse, every origin's together (the
        census counts them apart from those ``in_use``)."""
        return sum(len(v) for v in self._idle.values())

    async def request(
        self,
        url: str,
        method: str,
        path_qs: str,
        headers: Mapping[str, str] | CIMultiDict[str],
        body: bytes | None,
        *,
        connect: float | None,
        first_byte: float | None,
        idle: float,
        inflate: bool = False,
        buffer: int = BODY_BUFFER,
        tls_name: str | None = None,
    ) -> UpstreamResponse:
        """Send one request to ``url``'s path + ``path_qs`` and wait for the head.

        ``tls_name``: the name an https certificate must carry when ``url`` holds an address.
        The caller must ``release`` the response.
        """
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = parse_origin(url)
        head = request_head(method, origin.base_path + path_qs, origin.host_header, headers, body)
        fresh = False
        while True:
            # An idle connection, the common case, is taken without a coroutine to await.
            pooled = None if fresh or self._closed else self._take_idle(_key(origin, tls_name))
            if pooled is not None:
                connection, reused = pooled, True
            else:
                connection, reused = await self._connect(origin, connect, tls_name, fresh)
            # From here to the ``try``, no await: the connection is in_use or dropped.
            response = UpstreamResponse(connection, method, buffer, inflate)
            connection.begin(response)
            self.in_use.add(connection)
            try:
                connection.send(head, body)
                await response.wait_head(
                    first_byte if first_byte is not None else 86400.0, self._head_clock(connection)
                )
            except Disconnected:
                self._drop(connection)
                if (
                    reused
                    and not connection.answered
                    and connection.just_answered(connection.loop.time())
                ):
                    # Its server closed it just after the answer before: as a close seen idle.
                    self._closed_early(connection.key)
                if not reused or connection.answered or method not in RESENDABLE:
                    raise
                self.resent += 1
                log_event("upstream stale connection", replica=url, method=method, resent=True)
                fresh = True
                continue
            except BaseException:
                self._drop(connection)
                raise
            response.start_idle(idle)
            return response

    def _head_clock(self, connection: UpstreamConnection) -> HeadClock:
        clock = self._clock
        if clock is None or clock.loop is not connection.loop:
            clock = self._clock = HeadClock(connection.loop)
        return clock

    async def _connect(
        self, origin: Origin, timeout: float | None, tls_name: str | None, fresh: bool = False
    ) -> tuple[UpstreamConnection, bool]:
        """A connection to ``origin`` and whether it is a reused one: an idle one unless
        ``fresh``, else a new one once fewer than ``max_connecting`` are being opened to it.
        ``timeout`` covers the wait in line and the connect."""
        if self._closed:
            raise ClientClosed("the upstream client is closed")
        key = _key(origin, tls_name)
        host, port = origin.host, origin.port
        if not fresh:
            connection = self._take_idle(key)
            if connection is not None:
                return connection, True
        try:
            async with asyncio.timeout(timeout):
                return await self._open(key, origin, fresh)
        except TimeoutError:
            raise ConnectTimeout(
                f"connecting to {host}:{port} timed out after {timeout} s"
            ) from None

    def _take_idle(self, key: Key) -> UpstreamConnection | None:
        """The most recently pooled connection still fit to reuse; the unfit are closed."""
        idle = self._idle.get(key)
        if not idle:
            return None
        now = idle[-1].loop.time()  # not asyncio.get_running_loop(): a getpid(2) per call on 3.11
        if key in self.closers:
            return self._take_settled(key, idle, now)
        while idle:
            connection = idle.pop()
            if self._unfit(connection, now):
                connection.abort()
                continue
            return connection
        return None

    def _take_settled(
        self, key: Key, idle: list[UpstreamConnection], now: float
    ) -> UpstreamConnection | None:
        """For an origin that closes connections after their answers: the most recently pooled
        connection that has stayed open ``EARLY_CLOSE`` since its answer; younger ones wait in
        the pool (their server's close is seen there), the unfit are closed. One taken shows
        the origin keeps connections alive again."""
        i = len(idle)
        while i:
            i -= 1
            connection = idle[i]
            if self._unfit(connection, now):
                del idle[i]
                connection.abort()
            elif not connection.just_answered(now):
                del idle[i]
                self.closers.discard(key)
                return connection
        return None

    def _unfit(self, connection: UpstreamConnection, now: float) -> bool:
        """Idle past ``keepalive``, or closed or readable (``stale``): closed, never reused."""
        return now - connection.idle_since > self.keepalive or connection.stale()

    def _closed_early(self, key: Key) -> None:
        """A pooled connection to ``key`` was closed by its server just after its answer."""
        if key not in self.closers:
            self.closers.add(key)
            log_event(
                "upstream closes kept-alive connections",
                host=key[0],
                port=key[1],
                reused_after=EARLY_CLOSE,
            )

    async def _open(self, key: Key, origin: Origin, fresh: bool) -> tuple[UpstreamConnection, bool]:
        """In line for this origin's connects (FIFO): an idle connection released meanwhile,
        or a new connection in a turn of our own, given back whatever happens."""
        queued = False
        while True:
            if self._closed:
                raise ClientClosed("the upstream client is closed")
            if not fresh:
                connection = self._take_idle(key)
                if connection is not None:
                    if queued and self.connecting.get(key, 0) < self.max_connecting:
                        self._pass_turn(key)  # the turn that woke us is unused: the next one's
                    return connection, True
            # A newcomer goes behind those already waiting; a waiter woken keeps its place.
            if self.connecting.get(key, 0) < self.max_connecting and (
                queued or key not in self._turns
            ):
                break
            await self._wait_turn(key, front=queued)
            queued = True
        self.connecting[key] = self.connecting.get(key, 0) + 1
        try:
            return await self._create(key, origin), False
        finally:
            left = self.connecting[key] - 1
            if left:
                self.connecting[key] = left
            else:
                del self.connecting[key]
            self._pass_turn(key)

    async def _wait_turn(self, key: Key, front: bool) -> None:
        """Until a connect to ``key`` ends or one of its connections is pooled."""
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line = self._turns.setdefault(key, deque())
        if front:
            line.appendleft(turn)
        else:
            line.append(turn)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self._pass_turn(key)  # woken, then cancelled before it ran: the next one's
            else:
                with contextlib.suppress(ValueError):  # _pass_turn skipped it already
                    line.remove(turn)
                if not line and self._turns.get(key) is line:
                    del self._turns[key]
            raise

    def _pass_turn(self, key: Key) -> None:
        """Wake the first of ``key``'s waiters still waiting."""
        line = self._turns.get(key)
        while line:
            turn = line.popleft()
            if not turn.done():
                turn.set_result(None)
                break
        if line is not None and not line:
            del self._turns[key]

    async def _create(self, key: Key, origin: Origin) -> UpstreamConnection:
        """A new connection. Cancelled at any point, it leaves nothing open: the loop's
        ``create_connection`` closes what it made, and nothing here awaits after it."""
        loop = asyncio.get_running_loop()
        host, port, name = key
        context = self._context() if origin.tls else None
        try:
            _, protocol = await loop.create_connection(
                lambda: UpstreamConnection(loop, key, self._closed_early),
                host,
                port,
                ssl=context,
                server_hostname=name,
            )
        except TimeoutError:
            raise  # the OS's connect timeout: a ConnectTimeout, as our own (``_connect``)
        except OSError as exc:  # refused, unreachable, a TLS handshake or certificate failure
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from None
        return protocol

    def _context(self) -> ssl.SSLContext:
        """The system's trust store (``SSL_CERT_FILE``/``SSL_CERT_DIR`` replace it), made once."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
            self._tls.set_alpn_protocols(["http/1.1"])
        return self._tls

    def release(self, response: UpstreamResponse) -> None:
        """Back to the pool when its body was read to the end; closed (never reused) otherwise."""
        connection = response.connection
        assert isinstance(connection, UpstreamConnection)  # the one request() made
        complete = response.finish()
        self.in_use.discard(connection)
        if (
            complete
            and connection.state == ConnectionState.REUSABLE
            and not self._closed
            and connection.response is response
        ):
            pool = self._idle.setdefault(connection.key, [])
            if len(pool) < self.max_idle_per_origin:
                connection.park(connection.loop.time())
                pool.append(connection)
                if connection.key in self._turns:
                    self._pass_turn(connection.key)  # the first in line takes it
                return
        connection.discard()

    def _drop(self, connection: UpstreamConnection) -> None:
        self.in_use.discard(connection)
        connection.discard()

    async def close(self) -> None:
        self._closed = True
        for line in self._turns.values():
            for turn in line:
                if not turn.done():
                    turn.set_result(None)  # each sees the pool closed
        self._turns.clear()
        for pool in self._idle.values():
            for connection in pool:
                connection.abort()
        self._idle.clear()
        for connection in list(self.in_use):
            connection.abort()
        self.in_use.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost


def _key(origin: Origin, tls_name: str | None) -> Key:
    """The pool an origin's connections share: host, port and, for https, the TLS name."""
    return (origin.host, origin.port, (tls_name or origin.host) if origin.tls else None)
