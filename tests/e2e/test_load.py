"""Load and leaks: hundreds of concurrent fan-outs lose nothing, leavers leak nothing, slow
readers hold the upstream back instead of growing the proxy's buffers.
"""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.config.models import Timeouts
from proxy.devserver import generate
from tests.support.client import sse_payloads
from tests.support.rig import MakeRig, Rig
from tests.support.servers import Proxy

CHAT = "/v1/chat/completions"
REQUESTS = 500
LEAVERS = 200
K = 4
TOKENS = 6


def load_body(j: int, max_tokens: int = TOKENS, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"load {j}"}],
        "n": K,
        "seed": 1000 * j,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


def expected_deltas(j: int, i: int) -> list[tuple[dict[str, Any], str | None]]:
    """Choice i of request j, chunk by chunk, as the backend generates it for seed + i."""
    tokens = generate(f"load {j}", 1000 * j + i, TOKENS, may_stop=False).tokens
    return [
        ({"role": "assistant", "content": ""}, None),
        *(({"content": t.text}, None) for t in tokens),
        ({}, "length"),
    ]


async def fetch(rig: Rig, j: int) -> bytes:
    async with rig.client.post(
        rig.proxy_url + CHAT, json=load_body(j), headers={"X-Request-Id": f"load{j}"}
    ) as response:
        assert response.status == 200
        return await response.read()


async def test_500_concurrent_streaming_fanouts_lose_duplicate_or_misindex_nothing(
    make_rig: MakeRig,
) -> None:
    rig = await make_rig(max_concurrency=REQUESTS * K, max_queue=REQUESTS)
    async with asyncio.timeout(60):
        bodies = await asyncio.gather(*(fetch(rig, j) for j in range(REQUESTS)))

    for j, raw in enumerate(bodies):
        payloads = sse_payloads(raw)
        assert payloads[-1] == "[DONE]"
        assert payloads.count("[DONE]") == 1
        *chunks, usage_chunk = payloads[:-1]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == K * TOKENS
        got: list[list[tuple[dict[str, Any], str | None]]] = [[] for _ in range(K)]
        for chunk in chunks:
            assert chunk["id"] == f"chatcmpl-load{j}"
            (choice,) = chunk["choices"]
            got[choice["index"]].append((choice["delta"], choice["finish_reason"]))
        assert got == [expected_deltas(j, i) for i in range(K)], f"request {j}"
    assert len(rig.state.finished) == REQUESTS * K
    await rig.assert_no_leaks(requests=REQUESTS)


async def test_200_clients_leaving_mid_stream_abort_every_child_and_leak_nothing(
    make_rig: MakeRig,
) -> None:
    rig = await make_rig(max_concurrency=LEAVERS * K, max_queue=LEAVERS)
    # One token a second for a minute: every child is still generating when its client leaves.
    # (The backend draws all tokens up front, so max_tokens stays modest.)
    body = load_body(0, max_tokens=60, x_demo={"token_delay": 1.0}, ignore_eos=True)
    responses: list[aiohttp.ClientResponse] = []

    async def open_stream(j: int) -> None:
        response = await rig.client.post(
            rig.proxy_url + CHAT, json={**body, "seed": j}, headers={"X-Request-Id": f"gone{j}"}
        )
        responses.append(response)
        assert response.status == 200
        assert (await response.content.readuntil(b"\n\n")).startswith(b"data: {")

    async with asyncio.timeout(120):  # 200 streams on a machine whose cores others may hold
        await asyncio.gather(*(open_stream(j) for j in range(LEAVERS)))
    children = {f"{i}_gone{j}" for j in range(LEAVERS) for i in range(K)}
    await rig.state.wait_for(lambda s: children <= set(s.active), timeout=60)
    for response in responses:
        response.close()
    # Every child aborted as its client left (docs/behaviour.md#cancellation): long before any
    # could finish. Within a second on an idle machine; the bound is for a loaded one.
    await rig.state.wait_for(lambda s: children <= set(s.aborted), timeout=20)
    assert not rig.state.finished
    await rig.assert_no_leaks(requests=LEAVERS)
    assert {line["status"] for line in rig.log.lines} == {499}


# --- a slow reader --------------------------------------------------------------------------


PIECE = 16 * 1024  # content bytes per upstream chunk
FLOWING = 1 << 20  # bytes the upstream writes before the client's stall begins to matter
# Kernel socket buffers alone may hold tens of MiB on loopback (tcp_rmem autotuning): the bound
# is generous, while a proxy without backpressure would pass it within the window below.
BOUND = 64 << 20
WINDOW = 1.5  # seconds the upstream is given to overrun BOUND; it must not
BUDGET = 1 << 30  # per child: a proxy buffering without bound meets BOUND long before this


@dataclass
class Firehose:
    """An upstream that streams chunks as fast as it may, counting the bytes it got written."""

    written: int = 0
    chunks: dict[str, int] = field(default_factory=dict)  # per child request id
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    _progress: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.path == "/health":
            return web.Response(text="ok")
        rid = request.headers["X-Request-Id"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent = 0
        while not self.stop.is_set() and sent < BUDGET:
            content = f"{rid}:{self.chunks.get(rid, 0)}|".ljust(PIECE, "x")
            self.chunks[rid] = self.chunks.get(rid, 0) + 1
            data = b"data: " + orjson.dumps(chunk(rid, {"content": content}, None)) + b"\n\n"
            await response.write(data)
            sent += len(data)
            self.written += len(data)
            self._progress.set()
        await response.write(b"data: " + orjson.dumps(chunk(rid, {}, "stop")) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def wait_written(self, at_least: int, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while self.written < at_least:
                self._progress.clear()
                await self._progress.wait()


def chunk(rid: str, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": f"chatcmpl-{rid}", "created": 1, "model": "m", "choices": [choice]}


@pytest.fixture
async def firehose() -> AsyncIterator[tuple[Firehose, str]]:
    hose = Firehose()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hose.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield hose, f"http://127.0.0.1:{runner.addresses[0][1]}"
    hose.stop.set()
    await runner.cleanup()


@pytest.mark.parametrize("n", [1, 2])
async def test_slow_reader_holds_the_upstream_back_and_then_gets_every_chunk(
    make_rig: MakeRig, firehose: tuple[Firehose, str], n: int
) -> None:
    hose, url = firehose
    # A short idle timeout too: an upstream held back by a slow client is not an idle one.
    rig = await make_rig(upstream_url=url, timeouts=Timeouts(connect=5, first_byte=5, idle=0.5))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # no autotuned window
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, tuple(_host_port(rig.proxy_url)))
    reader, writer = await asyncio.open_connection(sock=sock)
    body = orjson.dumps(
        {"model": "m", "messages": [], "stream": True, **({"n": n} if n > 1 else {})}
    )
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: slow\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()

    await hose.wait_written(FLOWING, timeout=10)
    with pytest.raises(TimeoutError):  # the client reads nothing: the upstream must stall
        await hose.wait_written(BOUND, timeout=WINDOW)
    stalled_at = hose.written
    assert stalled_at < BOUND

    hose.stop.set()
    async with asyncio.timeout(30):
        raw = await _read_response(reader)
    writer.close()
    await writer.wait_closed()
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    seqs: dict[str, list[int]] = {}
    finished = 0
    for payload in payloads[:-1]:
        assert "error" not in payload, payload
        (choice,) = payload["choices"]
        if choice["finish_reason"] is not None:
            finished += 1
            continue
        if choice["delta"] == {"role": "assistant", "content": ""}:
            continue  # the stitched stream's opening announcement (docs/behaviour.md#opening)
        rid, seq = choice["delta"]["content"].split("|")[0].split(":")
        assert rid == (f"{choice['index']}_slow" if n > 1 else "slow")
        seqs.setdefault(rid, []).append(int(seq))
    assert finished == n
    # Every chunk the upstream wrote reached the client, once and in order.
    assert {rid: len(s) for rid, s in seqs.items()} == hose.chunks
    for got in seqs.values():
        assert got == list(range(len(got)))
    await rig.assert_no_leaks(requests=1)


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    """The de-chunked body of one HTTP/1.1 response."""
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in head.lower()
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)


async def test_an_answered_request_leaves_nothing_for_the_cyclic_collector(
    http: aiohttp.ClientSession, proxy: Proxy
) -> None:
    """Each request's objects go by reference counting as it ends: none of the proxy's is left in
    a reference cycle, which only a collection (a pause, under load) would free. The served
    process collects young objects rarely (proxy.server.memory), so a cycle per request would
    pile up between collections."""

    async def each_kind() -> None:
        chat = {"model": "m", "messages": [{"role": "user", "content": "cycles"}], "max_tokens": 4}
        for body in ({}, {"n": 3}, {"stream": True}, {"n": 3, "stream": True}):
            async with http.post(proxy.url + CHAT, json={**chat, **body}) as response:
                assert response.status == 200
                await response.read()
        async with http.get(proxy.url + "/v1/models") as response:
            assert response.status == 200

    await each_kind()  # pools, caches and lazy imports, made once
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await each_kind()
        await asyncio.sleep(0.1)  # the handlers' last callbacks
        gc.collect()
        left = [o for o in gc.garbage if type(o).__module__.startswith("proxy.")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not left, sorted({type(o).__qualname__ for o in left})
