"""A client that leaves never freezes the proxy or strands what it held
(docs/behaviour.md#cancellation).

Clients reset their connection (SO_LINGER 0, then close) at many moments of a pass-through
stream, or close just after sending a fan-out; the proxy keeps answering, every handler ends,
and nothing stays held: upstream slots, replicas' outstanding counts, pooled connections.
The proxy runs on its own event loop in a thread, the default loop and uvloop both: a proxy
that spins freezes only its own thread, and the test, on another loop, sees it stop answering.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import orjson
import pytest
from aiohttp import web

from proxy.config.models import Config, single_upstream_config
from proxy.server.app import GENERATIONS, IN_FLIGHT, build_app
from tests.support.rawupstream import RawUpstream
from tests.support.rig import MakeRig
from tests.support.servers import Backend

WAIT = 10.0  # seconds: a bound on every wait, not a timing assertion
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENT = b"data: token\n\n"
CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
STREAM = b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
PIPELINED = b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n" * 40  # past aiohttp's queue of 32
LOOPS = ["asyncio", "uvloop"]
T = TypeVar("T")


async def idle(value: T) -> T:
    return value


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.new_event_loop  # type: ignore[no-any-return]
    return asyncio.new_event_loop


class ThreadedProxy:
    """The proxy app on its own event loop in a thread, as ``n-proxy`` runs it."""

    def __init__(self, config: Config, factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self.config = config
        self.loop = factory()
        self.app: web.Application | None = None
        self.port = 0
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:
            if not self._started.done():
                self._started.set_exception(exc)
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        app = build_app(self.config)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self.app, self.port = app, runner.addresses[0][1]
            self._started.set_result(None)
            await self._stop.wait()
        finally:
            await runner.cleanup()
            for _ in range(3):  # the transports closed last run their connection_lost
                await asyncio.sleep(0)

    async def start(self) -> None:
        self._thread.start()
        await asyncio.wrap_future(self._started)

    async def run(self, what: Callable[[web.Application], Coroutine[Any, Any, T]]) -> T:
        """``what(app)`` run on the proxy's own loop (bounded: a frozen loop fails)."""
        assert self.app is not None
        future = asyncio.run_coroutine_threadsafe(what(self.app), self.loop)
        async with asyncio.timeout(WAIT):
            return await asyncio.wrap_future(future)

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # its loop closed already
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(WAIT)
        if self._thread.is_alive() and self._thread.ident is not None:
            # A frozen loop never sees the stop: raise SystemExit in its thread, so that a
            # failing test leaves no thread spinning behind it for the rest of the suite.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._thread.ident), ctypes.py_object(SystemExit)
            )
            self._thread.join(WAIT)


class StreamingUpstream:
    """A raw upstream on the test's loop: ``/stream`` answers a chunked head and waits for the
    test to stream or stop; any other path answers ``ok`` and closes."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.streams: asyncio.Queue[socket.socket] = asyncio.Queue()
        self.open: set[socket.socket] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def start(self) -> None:
        self._accepting = asyncio.ensure_future(self._accept())

    async def stop(self) -> None:
        assert self._accepting is not None
        for task in (self._accepting, *self._tasks):
            task.cancel()
        await asyncio.gather(self._accepting, *self._tasks, return_exceptions=True)
        for conn in self.open:
            conn.close()
        self.listener.close()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self.listener)
            self.open.add(conn)
            task = asyncio.ensure_future(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        head = b""
        while b"\r\n\r\n" not in head:
            data = await loop.sock_recv(conn, 65536)
            if not data:
                self.close(conn)
                return
            head += data
        if head.split(b" ", 2)[1] == b"/stream":
            await self.streams.put(conn)
            return
        await loop.sock_sendall(conn, OK)
        self.close(conn)

    def close(self, conn: socket.socket) -> None:
        self.open.discard(conn)
        conn.close()


def reset(sock: socket.socket) -> None:
    """Leave as a client that is killed does: an RST, no FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.fixture(params=LOOPS)
async def rig(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[StreamingUpstream, ThreadedProxy]]:
    upstream = StreamingUpstream()
    upstream.start()
    proxy = ThreadedProxy(single_upstream_config(upstream.url), loop_factory(request.param))
    await proxy.start()
    yield upstream, proxy
    proxy.stop()
    await upstream.stop()


async def answers(port: int) -> bool:
    """Whether the proxy answers another request promptly (a frozen one never does)."""
    try:
        async with asyncio.timeout(WAIT):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = await reader.read()
            writer.close()
    except TimeoutError:
        return False
    return reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok")


async def receive(client: socket.socket, end: bytes) -> None:
    """Until what the proxy sent ends with ``end`` (a head, a chunk: each comes whole)."""
    got = b""
    while not got.endswith(end):
        data = await asyncio.get_running_loop().sock_recv(client, 65536)
        assert data, "the proxy closed the stream"
        got += data


def moments() -> Iterator[tuple[bool, int, float]]:
    """(pipelined, chunks the client reads first, seconds between the upstream's last write
    and the reset): the reset lands before, during and after the proxy writes the head or a
    chunk. Pipelined requests fill aiohttp's queue, which stops it reading the client's
    socket: a reset sent before the upstream's next write is then found by the proxy's write
    alone, the moment a freeze began. Unpipelined, the resets land mostly around the head,
    where that race is likeliest."""
    for chunks in (0, 1, 3):
        yield True, chunks, 0.0
    for _ in range(30):
        for delay in (0.0, 0.0, 5e-6, 1e-5, 2e-5, 3e-5):
            yield False, 0, delay
    for chunks in (1, 3):
        for step in range(20):
            yield False, chunks, step * 20e-6


async def test_clients_resetting_a_passthrough_stream_never_freeze_the_proxy(
    rig: tuple[StreamingUpstream, ThreadedProxy],
) -> None:
    upstream, proxy = rig
    loop = asyncio.get_running_loop()
    for pipelined, chunks, delay in moments():
        *before, last = [HEAD] + [CHUNK] * chunks
        with socket.socket() as client:
            client.setblocking(False)
            await loop.sock_connect(client, ("127.0.0.1", proxy.port))
            await loop.sock_sendall(client, STREAM + (PIPELINED if pipelined else b""))
            async with asyncio.timeout(WAIT):
                stream = await upstream.streams.get()
                for data in before:
                    stream.send(data)
                    await receive(client, b"\r\n\r\n" if data is HEAD else CHUNK)
            if pipelined:
                reset(client)
                stream.send(last)  # alone in its read: the proxy writes it into the reset
            else:
                stream.send(last)
                # Blocking on purpose: the reset lands while the proxy's thread writes.
                time.sleep(delay)  # noqa: ASYNC251
                reset(client)
                with contextlib.suppress(OSError):  # the proxy may have cut the stream
                    stream.send(CHUNK)  # its next write, if it still relays, meets the reset
        moment = f"{chunks} chunks, {delay} s, pipelined: {pipelined}"
        assert await answers(proxy.port), f"frozen after a reset at {moment}"
        upstream.close(stream)
    await proxy.run(lambda app: app[IN_FLIGHT].wait_idle())  # every handler ended
    assert not await proxy.run(lambda app: idle(app[GENERATIONS].upstreams.connections.in_use))


# --- the client gone as the head is written ---------------------------------------------------


async def leave_at_head(request: web.Request, response: web.StreamResponse) -> None:
    """An ``on_response_prepare`` hook: the client's transport closes just before the head is
    written, as when a write finds the client's reset (``connection_lost`` runs later)."""
    if request.headers.get("X-Leave") == "at-head":
        assert request.transport is not None
        request.transport.abort()


@pytest.fixture
async def leaving_proxy() -> AsyncIterator[Callable[[str], Awaitable[tuple[web.Application, int]]]]:
    runners: list[web.AppRunner] = []

    async def start(upstream_url: str) -> tuple[web.Application, int]:
        app = build_app(single_upstream_config(upstream_url))
        app.on_response_prepare.append(leave_at_head)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        runners.append(runner)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return app, runner.addresses[0][1]

    yield start
    for runner in runners:
        await runner.cleanup()


async def leave(port: int, method: str, path: str, body: bytes = b"") -> bytes:
    """Send one request the proxy will find us gone for; what came back (nothing)."""
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nX-Leave: at-head\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    async with asyncio.timeout(WAIT):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        try:
            return await reader.read()
        except ConnectionResetError:
            return b""
        finally:
            writer.close()


async def settled(app: web.Application) -> None:
    """Every handler ended and every upstream request let its connection, slot and replica go."""
    pool = app[GENERATIONS].upstreams
    await app[IN_FLIGHT].wait_idle()
    (upstream,) = pool.config.upstreams
    state = pool.state(upstream)
    assert not pool.connections.in_use  # a handler waits for its children to unwind
    assert state.slots.in_use == 0
    assert [r.outstanding for r in state.replicas] == [0]


@pytest.mark.parametrize("n", [1, 2])
async def test_a_stream_whose_client_is_gone_at_its_head_ends_quietly(
    make_backend: Callable[..., Awaitable[Backend]],
    leaving_proxy: Callable[[str], Awaitable[tuple[web.Application, int]]],
    n: int,
) -> None:
    """n=1 passes through (``_relay``), n=2 is stitched (``respond_stream``): no handler error
    (the autouse fixture fails the test on aiohttp's ERROR line), nothing held."""
    backend = await make_backend()
    app, port = await leaving_proxy(backend.url)
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}],
            "stream": True,
            "n": n,
            "max_tokens": 30,
            "x_demo": {"token_delay": 1.0},  # still generating when the client is found gone
        }
    )
    assert await leave(port, "POST", "/v1/chat/completions", body) == b""
    await settled(app)
    await backend.state.wait_for(lambda s: len(s.aborted) == n)  # each stream was cut


async def test_a_relayed_exact_head_whose_client_is_gone_ends_quietly(
    raw_upstream: RawUpstream,
    leaving_proxy: Callable[[str], Awaitable[tuple[web.Application, int]]],
) -> None:
    """A head with bytes that are not UTF-8 is written by ``ExactHead``: the same, there."""
    raw_upstream.scripts["/latin"] = (
        b"HTTP/1.1 200 OK\r\nX-Name: caf\xe9\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n"
    )
    app, port = await leaving_proxy(raw_upstream.url)
    assert await leave(port, "GET", "/latin") == b""
    await settled(app)


# --- clients that leave as their children connect ------------------------------------------


WAVES = 4
WAVE = 100  # streams per wave
K = 4  # children each


async def test_clients_closing_just_after_sending_a_fan_out_strand_nothing(
    make_rig: MakeRig,
) -> None:
    """Each client closes 0-4 ms after sending: its children are cancelled while they queue,
    connect or stream. A child whose cancellation came in the same loop turn as its connect
    once kept its slot, connection and replica count, and its handler, for ever."""
    rig = await make_rig(max_concurrency=WAVE * K, max_queue=WAVE)
    port = int(rig.proxy_url.rsplit(":", 1)[1])
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}],
            "n": K,
            "stream": True,
            "max_tokens": 30,
            "x_demo": {"token_delay": 0.05},
        }
    )
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )

    async def leave(j: int) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        await asyncio.sleep(j % 5 / 1000)
        writer.close()
        await writer.wait_closed()

    pool = rig.app[GENERATIONS].upstreams
    (upstream,) = pool.config.upstreams
    state = pool.state(upstream)
    for wave in range(WAVES):
        async with asyncio.timeout(WAIT):
            await asyncio.gather(*(leave(j) for j in range(WAVE)))
        try:
            async with asyncio.timeout(WAIT):
                await rig.app[IN_FLIGHT].wait_idle()
        except TimeoutError:
            pytest.fail(f"wave {wave}: {rig.app[IN_FLIGHT].requests} handlers never ended")
        held = (
            state.slots.in_use,
            [r.outstanding for r in state.replicas],
            len(pool.connections.in_use),
        )
        assert held == (0, [0], 0), f"wave {wave}: slots, outstanding, connections held"
