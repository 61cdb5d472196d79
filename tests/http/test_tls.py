"""https upstreams on the proxy's own client: a real TLS server on loopback.

``trustme`` makes a CA and the server's certificate; the proxy trusts that CA through
``SSL_CERT_FILE``, as a deployment with a private CA would.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import orjson
import pytest
import trustme
from aiohttp import web

from proxy.config.models import Config, Discovery, Upstream
from proxy.server.app import GENERATIONS, build_app

Start = Callable[..., Awaitable[tuple[str, int]]]
CHAT = "/v1/chat/completions"


class TlsUpstream:
    """An aiohttp server behind TLS that answers health checks and single-choice chats."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []  # (path, Host header)
        self.health = asyncio.Event()  # a health check came

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.seen.append((request.path, request.headers.get("Host", "")))
        if request.path == "/health":
            self.health.set()
            return web.Response(text="ok")
        choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}}
        body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m"}
        return web.json_response({**body, "choices": [{**choice, "finish_reason": "stop"}]})


@pytest.fixture
def ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> trustme.CA:
    authority = trustme.CA()
    path = tmp_path / "ca.pem"
    authority.cert_pem.write_to_path(str(path))
    monkeypatch.setenv("SSL_CERT_FILE", str(path))
    return authority


@pytest.fixture
async def start_tls(ca: trustme.CA) -> AsyncIterator[Start]:
    runners: list[web.AppRunner] = []

    async def start(upstream: TlsUpstream, *names: str) -> tuple[str, int]:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert(*names).configure_cert(context)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", upstream.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
        runners.append(runner)
        return "127.0.0.1", runner.addresses[0][1]

    yield start
    for runner in runners:
        await runner.cleanup()


async def _proxy(config: Config, resolver: object = None) -> tuple[web.AppRunner, str]:
    app = build_app(config, resolver=resolver)  # type: ignore[arg-type]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _chat(url: str, n: int) -> tuple[int, dict[str, object]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    body = orjson.dumps({"model": "m", "messages": [], "n": n})
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: p\r\nConnection: close\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (CHAT.encode(), len(body), body)
    )
    async with asyncio.timeout(30):
        raw = await reader.read()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), orjson.loads(payload)


async def test_https_upstream_is_served_by_the_proxys_own_pool(start_tls: Start) -> None:
    upstream = TlsUpstream()
    host, port = await start_tls(upstream, "127.0.0.1")
    config = Config(upstreams=(Upstream(name="u", urls=(f"https://{host}:{port}/",)),))
    runner, url = await _proxy(config)
    try:
        for n in (1, 3):
            status, body = await _chat(url, n)
            assert status == 200, body
            assert len(body["choices"]) == n  # type: ignore[arg-type]
        connections = runner.app[GENERATIONS].upstreams.connections
        assert connections.idle_connections() >= 1  # the TLS connections are the pool's own
        await asyncio.wait_for(upstream.health.wait(), 30)
        assert ("/health", f"{host}:{port}") in upstream.seen
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("cert_name", "status"), [("upstream.test", 200), ("other.test", 502)])
async def test_a_replica_reached_by_address_verifies_the_configured_host_name(
    start_tls: Start, cert_name: str, status: int
) -> None:
    upstream = TlsUpstream()
    host, port = await start_tls(upstream, cert_name)

    async def resolver(name: str, _: int) -> list[str]:
        assert name == "upstream.test"
        return [host]

    source = Upstream(
        name="u",
        urls=(f"https://upstream.test:{port}",),
        discovery=Discovery(dns=True, interval=60.0),
        retries=0,
    )
    runner, url = await _proxy(Config(upstreams=(source,)), resolver)
    try:
        pool = runner.app[GENERATIONS].upstreams
        state = pool.state(source)
        await state.wait_for(lambda: state.replicas.urls == [f"https://{host}:{port}"], 30)
        got, body = await _chat(url, 2)
        assert got == status, body
        if status == 200:
            assert ("/v1/chat/completions", f"upstream.test:{port}") in upstream.seen
        else:
            assert not [p for p, _ in upstream.seen if p == CHAT]
    finally:
        await runner.cleanup()
