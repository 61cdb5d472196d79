"""Pass-through (docs/behaviour.md#pass-through, #headers): n=1 and every other path, byte for
byte, both ways, streamed."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.config.models import Listen, single_upstream_config
from proxy.observe import Observer, Observers, RequestRecord
from proxy.request.responses import WholeAnswer
from proxy.server.app import IN_FLIGHT
from proxy.server.connection import ClientConnection
from tests.support.polling import until
from tests.support.rawupstream import RawUpstream, exchange, get_request
from tests.support.servers import Backend, Proxy, Servers
from tests.support.upstreams import RecordingUpstream

# Deliberately odd SSE bytes: CRLF, a comment, no space after "data:", spacing the proxy must keep.
ODD_STREAM = (
    b': hello\r\n\r\ndata:{"id":"x","choices":[{"index":0,"delta":{"content":"a"}}]}\r\n\r\n'
    b'data: {"id":"x",  "choices":[]}\n\ndata: [DONE]\n\n'
)


class Recorder(RecordingUpstream):
    """Answers fixed bytes per path: an odd SSE stream, a stream held half-way, a binary 418."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.first_part_sent = asyncio.Event()

    async def respond(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/slow-stream":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: part1\n\n")
            self.first_part_sent.set()
            async with asyncio.timeout(30):
                await self.release.wait()
            await response.write(b"data: part2\n\n")
            await response.write_eof()
            return response
        if request.path == "/v1/chat/completions":
            response = web.StreamResponse(
                status=200,
                headers={
                    "Content-Type": "text/event-stream",
                    "X-Upstream": "yes",
                    "Connection": "keep-alive, X-Hop",
                    "X-Hop": "1",
                },
            )
            await response.prepare(request)
            for piece in (ODD_STREAM[:30], ODD_STREAM[30:77], ODD_STREAM[77:]):
                await response.write(piece)
            await response.write_eof()
            return response
        return web.Response(
            status=418,
            body=b"\x00\x01teapot",
            headers={"X-Upstream": "yes"},
            content_type="application/octet-stream",
        )


@pytest.fixture
async def rec(servers: Servers) -> AsyncIterator[Recorder]:
    recorder = await servers.start(Recorder())
    yield recorder
    recorder.release.set()


async def test_n1_request_and_response_bytes_pass_unchanged(
    http: aiohttp.ClientSession, make_proxy: Any, rec: Recorder
) -> None:
    proxy: Proxy = await make_proxy(single_upstream_config(rec.url))
    raw_body = b'{"model":"m",  "n": 1, "seed": 5, "stream": true, "messages":[]}'
    headers = {
        "X-Request-Id": "keep-me",
        "Content-Type": "application/json",
        "Authorization": "Bearer k",
    }
    async with http.post(
        proxy.url + "/v1/chat/completions?x=1", data=raw_body, headers=headers
    ) as response:
        assert response.status == 200
        assert response.headers["X-Upstream"] == "yes"
        assert "X-Hop" not in response.headers
        assert await response.read() == ODD_STREAM
    seen = rec.seen[0]
    assert (seen.method, seen.target, seen.body) == ("POST", "/v1/chat/completions?x=1", raw_body)
    assert seen.headers["X-Request-Id"] == "keep-me"
    assert seen.headers["Authorization"] == "Bearer k"
    assert seen.headers["Host"] == rec.url.removeprefix("http://")


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
async def test_other_methods_and_paths_keep_status_body_and_query(
    http: aiohttp.ClientSession, make_proxy: Any, rec: Recorder, method: str
) -> None:
    proxy: Proxy = await make_proxy(single_upstream_config(rec.url))
    async with http.request(
        method, proxy.url + "/tokenize/a%20b?q=1&q=2", data=b"payload" if method != "GET" else None
    ) as response:
        assert response.status == 418
        assert await response.read() == b"\x00\x01teapot"
        assert response.headers["X-Upstream"] == "yes"
    assert (rec.seen[0].method, rec.seen[0].target) == (method, "/tokenize/a%20b?q=1&q=2")


async def test_hop_by_hop_request_headers_are_not_forwarded(
    http: aiohttp.ClientSession, make_proxy: Any, rec: Recorder
) -> None:
    proxy: Proxy = await make_proxy(single_upstream_config(rec.url))
    headers = {
        "Connection": "keep-alive, X-Private",
        "X-Private": "1",
        "Keep-Alive": "timeout=5",
        "Proxy-Authorization": "x",
        "TE": "trailers",
        "X-End": "ok",
    }
    async with http.get(proxy.url + "/v1/models", headers=headers) as response:
        await response.read()
    seen = rec.seen[0].headers
    assert seen["x-end"] == "ok"
    for name in ("x-private", "keep-alive", "proxy-authorization", "te"):
        assert name not in seen


async def test_pass_through_streams_without_buffering(
    http: aiohttp.ClientSession, make_proxy: Any, rec: Recorder
) -> None:
    proxy: Proxy = await make_proxy(single_upstream_config(rec.url))
    async with http.get(proxy.url + "/slow-stream") as response:
        # part1 arrives while the upstream is still holding part2 back
        assert await response.content.readline() == b"data: part1\n"
        rec.release.set()
        assert await response.read() == b"\ndata: part2\n\n"


async def test_n1_through_demo_backend_equals_direct_call(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "seed": 3,
        "max_tokens": 5,
    }
    async with http.post(
        backend.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "d"}
    ) as r:
        direct = orjson.loads(await r.read())
    async with http.post(
        proxy.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "d"}
    ) as r:
        proxied = orjson.loads(await r.read())
    direct.pop("created")
    proxied.pop("created")
    assert proxied == direct
    assert [rid for rid, _, _ in backend.state.seen] == ["d", "d"]


async def test_absolute_uri_and_host_never_choose_the_destination(
    make_proxy: Any, rec: Recorder
) -> None:
    proxy: Proxy = await make_proxy(single_upstream_config(rec.url))
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"GET http://evil.example/steal?x=1 HTTP/1.1\r\n"
        b"Host: evil.example\r\nConnection: close\r\n\r\n"
    )
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    assert reply.startswith(b"HTTP/1.1 418")
    assert rec.seen[0].target == "/steal?x=1"
    assert rec.seen[0].headers["Host"] == rec.url.removeprefix("http://")


async def test_body_over_limit_is_413(
    http: aiohttp.ClientSession, make_proxy: Any, rec: Recorder
) -> None:
    proxy: Proxy = await make_proxy(single_upstream_config(rec.url, max_body_bytes=1000))
    async with http.post(proxy.url + "/v1/chat/completions", data=b"x" * 2000) as response:
        assert response.status == 413
        assert (await response.json())["error"]["type"] == "invalid_request_error"
    assert rec.seen == []


@pytest.mark.parametrize(
    "target",
    [b"/v1/models%0Aforged", b"/a%0D%0Ab?q=%0A", b"/%0A", b"/x/%0a%0d/y%00"],
)
async def test_a_path_with_an_encoded_line_break_is_forwarded_as_the_client_wrote_it(
    raw_upstream: RawUpstream, make_proxy: Any, target: bytes
) -> None:
    proxy: Proxy = await make_proxy(single_upstream_config(raw_upstream.url))
    port = int(proxy.url.rsplit(":", 1)[1])
    request = b"GET %s HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n" % target
    reply = await exchange(port, request)
    assert reply.startswith(b"HTTP/1.1 200 ")  # the upstream's answer, not aiohttp's own 404
    (seen,) = [s for s in raw_upstream.seen if not s.path.endswith("/health")]
    request_line = seen.head.split(b"\r\n", 1)[0]
    assert request_line == b"GET %s HTTP/1.1" % target  # still encoded: no raw CR or LF


async def test_a_body_held_behind_a_request_pauses_its_connection_then_passes_whole(
    raw_upstream: RawUpstream, servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body that piles up unread (its request pipelined behind one still answering) pauses the
    connection; reading it resumes it (``ClientConnection.resume_reading`` resumes only a paused
    one), and every byte arrives."""
    paused: list[bool] = []
    pause = ClientConnection.pause_reading

    def counted(self: ClientConnection) -> None:
        paused.append(True)
        pause(self)

    monkeypatch.setattr(ClientConnection, "pause_reading", counted)
    raw_upstream.scripts["/held"] = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n"
    raw_upstream.later["/held"] = b"held"  # once released
    raw_upstream.scripts["/upload"] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    config = single_upstream_config(raw_upstream.url, listen=Listen(host="127.0.0.1", port=0))
    server = await servers.server(config)
    body = bytes(range(256)) * (32 << 10)  # 8 MiB
    held = b"GET /held HTTP/1.1\r\nHost: proxy\r\n\r\n"
    upload = b"POST /upload HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n"
    upload += b"Content-Length: %d\r\n\r\n" % len(body)

    def send() -> bytes:  # from another thread: the proxy's loop stays free to read
        with socket.create_connection(("127.0.0.1", server.proxy_port), timeout=30) as client:
            client.sendall(held + upload + body)
            return b"".join(iter(lambda: client.recv(65536), b""))

    sent = asyncio.ensure_future(asyncio.to_thread(send))
    await until(lambda: bool(paused), what="the unread body pausing its connection")
    raw_upstream.release.set()
    async with asyncio.timeout(30):  # a bound, not a timing assertion
        reply = await sent
    first, second = reply.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert first.endswith(b"\r\n\r\nheld")
    assert second.endswith(b"\r\n\r\nok")
    (seen,) = raw_upstream.requests("/upload")
    assert seen.body == body


_SHAPES = {
    "whole": b"Content-Length: 2\r\n\r\n{}",  # a WholeAnswer
    "streamed": b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "exact head": b"X-Latin: caf\xe9\r\nContent-Length: 2\r\n\r\n{}",  # not UTF-8: ExactHead
}


@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize("server", [b"upstream/1.0", None], ids=["upstream's", "none"])
async def test_a_pass_through_keeps_its_upstreams_server_header_else_gets_the_proxys(
    raw_upstream: RawUpstream, make_proxy: Any, shape: str, server: bytes | None
) -> None:
    """docs/behaviour.md#headers: every answer says ``Server: n-proxy`` but a passed-through
    one whose upstream named itself, whatever way it is relayed."""
    named = b"Server: %s\r\n" % server if server is not None else b""
    raw_upstream.scripts["/x"] = b"HTTP/1.1 200 OK\r\n" + named + _SHAPES[shape]
    proxy: Proxy = await make_proxy(single_upstream_config(raw_upstream.url))
    reply = await exchange(int(proxy.url.rsplit(":", 1)[1]), get_request("/x"))
    head = reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    assert head[0] == b"HTTP/1.1 200 OK"
    said = [line.split(b":", 1)[1].strip() for line in head if line.lower().startswith(b"server:")]
    assert said == [server if server is not None else b"n-proxy"]


@pytest.mark.parametrize("path", ["/small", "/slow-stream"])
async def test_the_request_line_counts_a_passed_through_body_whole_or_streamed(
    http: aiohttp.ClientSession,
    make_proxy: Any,
    rec: Recorder,
    caplog: pytest.LogCaptureFixture,
    path: str,
) -> None:
    """A small body of known length leaves whole with its head, a stream chunk by chunk:
    ``bytes_out`` is the body's size either way."""
    rec.release.set()
    proxy: Proxy = await make_proxy(single_upstream_config(rec.url))
    with caplog.at_level(logging.INFO, logger="n_proxy"):
        async with http.get(proxy.url + path) as response:
            body = await response.read()
        await proxy_idle(proxy)
    (line,) = [r for r in caplog.records if r.getMessage() == "request"]
    assert len(body) > 0
    assert line.__dict__["fields"]["bytes_out"] == len(body)


async def proxy_idle(proxy: Proxy) -> None:
    """Until the request's handler ended (its log line is written as it ends)."""
    async with asyncio.timeout(30):
        await proxy.app[IN_FLIGHT].wait_idle()


# --- a whole answer leaves as aiohttp's own Response would -------------------------------------

HOOKED = "X-Prepared"  # set by the app's on_response_prepare, as the proxy's Server header is


@pytest.fixture
async def both_answers() -> AsyncIterator[int]:
    """An app answering ``/{whole|aiohttp}/{status}/{body}``: a ``WholeAnswer`` or aiohttp's own
    ``web.Response``, with the same status, headers and body; its port."""
    bodies = {"empty": (b"", {}), "typed": (b'{"a":1}', {"Content-Type": "application/json"}),
              "bare": (b"x" * 300, {}), "served": (b"ok", {"Server": "upstream/1.0"})}  # fmt: skip

    async def answer(request: web.Request) -> web.StreamResponse:
        kind, status, name = (
            request.match_info["kind"],
            int(request.match_info["status"]),
            (request.match_info["body"]),
        )
        body, headers = bodies[name]
        made = WholeAnswer if kind == "whole" else web.Response
        return made(status=status, body=body, headers={"X-Upstream": "yes", **headers})

    async def hook(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[HOOKED] = response.headers.get("Content-Length", "none")

    app = web.Application()
    app.router.add_route("*", "/{kind}/{status}/{body}", answer)
    app.on_response_prepare.append(hook)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert runner.addresses
    yield int(runner.addresses[0][1])
    await runner.cleanup()


async def _kept_or_not(
    port: int, request: bytes, closing: bytes, bodiless: bool
) -> tuple[bytes, bytes]:
    """The answer to ``request`` (``bodiless``: its head alone), then what came after it on
    that connection when ``closing`` (a request that asks for the close) was sent: its answer
    if the server kept the connection, else nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(30):  # a bound, not a timing assertion
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0 if bodiless else int(next(
                line.split(b":", 1)[1] for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ))  # fmt: skip
            first = head + await reader.readexactly(length)
            try:
                writer.write(closing)
                after = await reader.read()  # until the server's close
            except ConnectionError:
                after = b""
            return first, after
    finally:
        writer.close()


def _undated(answer: bytes) -> bytes:
    return re.sub(rb"\r\nDate: [^\r]*", b"\r\nDate: -", answer)


@pytest.mark.parametrize("version", ["1.1", "1.0"])
@pytest.mark.parametrize("connection", [None, "close", "keep-alive"])
@pytest.mark.parametrize("body", ["empty", "typed", "bare", "served"])
@pytest.mark.parametrize("status", [200, 204, 304, 404, 503])
@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_a_whole_answer_leaves_byte_for_byte_as_aiohttps_response_would(
    both_answers: int, version: str, connection: str | None, body: str, status: int, method: str
) -> None:
    """Same head (the date aside) and body, and the connection kept or closed alike, whatever
    the request's HTTP version and Connection header; an answer that must have no body (to a
    HEAD, a 204 or 304) as aiohttp writes it."""
    bodiless = method == "HEAD" or status in (204, 304)
    got = {}
    for kind in ("whole", "aiohttp"):
        request = f"{method} /{kind}/{status}/{body} HTTP/{version}\r\nHost: x\r\n"
        closing = (request + "Connection: close\r\n\r\n").encode()
        if connection is not None:
            request += f"Connection: {connection}\r\n"
        sent = (request + "\r\n").encode()
        first, after = await _kept_or_not(both_answers, sent, closing, bodiless)
        got[kind] = (_undated(first), _undated(after))
    assert got["whole"] == got["aiohttp"]
    first, after = got["whole"]
    assert f" {status} ".encode() in first.split(b"\r\n", 1)[0]
    assert f"\r\n{HOOKED}: ".encode() in first  # the app's hook ran before the head was written


class _Ends(Observer):
    """Each request's record as it ends, with what its connection had been written by then."""

    def __init__(self) -> None:
        self.requests: dict[str, web.Request] = {}
        self.seen: list[tuple[str, int]] = []

    def ended(self, record: RequestRecord) -> None:
        self.seen.append((record.path, self.requests[record.path].writer.output_size))


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/written"), ("HEAD", "/written"), ("GET", "/closing"), ("GET", "/prepared")],
    ids=["written", "head", "closing", "prepared"],
)
async def test_a_whole_answer_ends_the_record_it_takes_once_after_its_write(
    servers: Servers, method: str, path: str
) -> None:
    """``WholeAnswer.ends``: a record handed over is ended once, by ``prepare``, after the
    answer's one write; also when that answer takes aiohttp's steps (to a HEAD) or cannot be
    written (its connection closing). An answer already prepared takes none."""
    ends = _Ends()
    observers = Observers([ends])
    taken: list[bool] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        ends.requests[request.path] = request
        record = RequestRecord(observers, request.method, request.path, request.headers)
        made = WholeAnswer(status=200, body=b"whole")
        if request.path == "/closing":
            assert request.transport is not None
            request.transport.close()
        if request.path == "/prepared":
            await made.prepare(request)
        taken.append(made.ends(record))
        if not taken[-1]:
            record.ended()  # the handler's, as ever
        return made

    app = await servers.start(RecordingUpstream(answer))
    reader, writer = await asyncio.open_connection("127.0.0.1", int(app.url.rsplit(":", 1)[1]))
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    async with asyncio.timeout(30):  # a bound, not a timing assertion
        got = await reader.read()
    writer.close()
    assert taken == [path != "/prepared"]
    assert [p for p, _ in ends.seen] == [path]
    written = ends.seen[0][1]
    if path == "/closing":
        assert got == b""
    elif method == "HEAD":
        assert got.startswith(b"HTTP/1.1 200 OK\r\n")
        assert got.endswith(b"\r\n\r\n")
    else:
        assert got.startswith(b"HTTP/1.1 200 OK\r\n")
        assert got.endswith(b"\r\n\r\nwhole")
        assert written == len(got)  # the whole answer written before the record ended
