"""Hostile load: every limit and fault over real loopback servers (docs/behaviour.md#limits).

The proxy runs as the whole ``proxy.server.process.Server`` (its connection guard included) in
front of a recording fake upstream that can also answer without end.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import subprocess
import sys
import weakref
import zlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.config.models import ClientTimeouts, Config, Listen, Route, single_upstream_config
from proxy.server.connection import EveryPath, direct_route
from proxy.server.generations import Generations
from proxy.server.process import Server
from tests.support.client import leave
from tests.support.polling import until
from tests.support.rawhttp import parse_raw
from tests.support.servers import Servers, serving, with_upstream
from tests.support.upstreams import RecordingUpstream, Seen

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
UPSTREAM_SERVER = "fake-upstream/1.0"
CHUNK = b"x" * 65536


class Fake(RecordingUpstream):
    """Answers like a one-choice server; ``X-Fake`` picks an endless JSON or SSE body instead."""

    def __init__(self) -> None:
        super().__init__()
        self.endless_sent = 0
        self.endless_gone = asyncio.Event()
        self.endless_flowing = asyncio.Event()  # set at each chunk of an endless body written
        self.holding = asyncio.Event()  # set as a request to hold comes

    async def respond(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()  # the bytes as they came: never inflated
        headers = {"Server": UPSTREAM_SERVER}
        fake = request.headers.get("X-Fake")
        if fake == "hold":  # no answer until the fake stops
            self.holding.set()
            await asyncio.Event().wait()
        if fake == "long-content-length":
            return web.Response(body=b"{}" * 8, headers={**headers, "Content-Length": "16"})
        if fake in ("endless-json", "endless-sse"):
            sse = fake == "endless-sse"
            response = web.StreamResponse(
                headers={
                    **headers,
                    "Content-Type": "text/event-stream" if sse else "application/json",
                }
            )
            await response.prepare(request)
            try:
                await response.write(b"data: " if sse else b'{"choices": "')
                while True:
                    await response.write(CHUNK)
                    self.endless_sent += len(CHUNK)
                    self.endless_flowing.set()
            except ConnectionError:
                return response  # the proxy hung up: what it must do
            finally:
                self.endless_gone.set()
        if request.path not in (CHAT, COMPLETIONS):
            return web.json_response({"path": request.path}, headers=headers)
        if "Content-Encoding" in request.headers:
            return web.json_response({"encoded": True}, headers=headers)
        parsed = orjson.loads(body)
        choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}}
        choice["finish_reason"] = "stop"
        answer = {"id": "x", "created": 1, "model": "m", "choices": [choice]}
        answer["seed"] = parsed.get("seed")
        return web.json_response(answer, headers=headers)

    def parents(self, marker: str) -> list[Seen]:
        return [s for s in self.seen if marker.encode() in s.body or marker in s.target]


@pytest.fixture
async def fake(servers: Servers) -> Fake:
    return await servers.start(Fake())


@contextlib.asynccontextmanager
async def running(fake: Fake, **overrides: Any) -> AsyncIterator[Server]:
    """The whole server of one process in front of ``fake``, closed at the block's end: what it
    answered is over before the test looks at what the fake got."""
    config: Config = single_upstream_config(fake.url).model_copy(
        update={"listen": Listen(host="127.0.0.1", port=0), **overrides}
    )
    async with serving(config) as server:
        yield server


@dataclass
class Answer:
    status_line: str
    headers: CIMultiDict[str]
    body: bytes

    @property
    def status(self) -> int:
        return int(self.status_line.split()[1])

    def error(self) -> dict[str, Any]:
        body = orjson.loads(self.body)
        assert set(body) == {"error"}
        assert set(body["error"]) == {"message", "type", "param", "code"}
        return dict(body["error"])


async def exchange(port: int, data: bytes, *, wait: float = 20.0) -> Answer:
    """Send raw bytes and read the answer until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        raw = await asyncio.wait_for(reader.read(-1), wait)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return parse(raw)


def parse(raw: bytes) -> Answer:
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    if raw.startswith(interim):
        raw = raw[len(interim) :]
    return Answer(*parse_raw(raw))


def request(
    path: str, body: bytes, *headers: str, method: str = "POST", version: str = "1.1"
) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: x", "Connection: close", *headers]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def json_request(path: str, body: dict[str, Any] | bytes, *headers: str) -> bytes:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return request(path, raw, "Content-Type: application/json", *headers)


# --- max_children -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [f"m-{i}" for i in range(1025)], "n": 2}, "prompt"),  # 2,050
        ({"prompt": [f"m-{i}" for i in range(410)], "best_of": 5}, "prompt"),  # 2,050
        ({"prompt": [f"m-{i}" for i in range(100_000)], "n": 10}, "prompt"),  # 1,000,000
    ],
    ids=["prompts-x-n", "prompts-x-best_of", "100k-prompts-x-10"],
)
async def test_children_past_max_children_are_400_before_any_child(
    fake: Fake, body: dict[str, Any], param: str
) -> None:
    async with running(fake) as server:
        answer = await exchange(server.proxy_port, json_request(COMPLETIONS, body))
    assert answer.status == 400, answer
    error = answer.error()
    assert error["param"] == param
    assert "at most 2048" in error["message"]
    assert fake.parents("m-") == []


async def test_max_children_is_configurable_and_counts_n(fake: Fake) -> None:
    async with running(fake, max_children=4) as server:
        five = {"messages": [], "n": 5, "marker": "mc5"}
        answer = await exchange(server.proxy_port, json_request(CHAT, five))
        assert answer.status == 400
        assert answer.error()["param"] == "n"
        four = {"messages": [], "n": 4, "marker": "mc4"}
        assert (await exchange(server.proxy_port, json_request(CHAT, four))).status == 200
    assert fake.parents("mc5") == []
    assert len(fake.parents("mc4")) == 4


# --- max_response_bytes -----------------------------------------------------------------------


async def test_endless_child_json_body_is_502_and_its_connection_dropped(fake: Fake) -> None:
    limit = 1 << 20
    async with running(fake, max_response_bytes=limit) as server:
        body = {"messages": [], "n": 2}
        answer = await exchange(server.proxy_port, json_request(CHAT, body, "X-Fake: endless-json"))
        assert answer.status == 502, answer
        assert f"larger than {limit} bytes" in answer.error()["message"]
        await asyncio.wait_for(fake.endless_gone.wait(), 20)
    # What the upstream got out before the proxy hung up: the cap plus socket buffers.
    assert fake.endless_sent < 16 * limit


async def test_child_content_length_past_max_response_bytes_is_502_unread(fake: Fake) -> None:
    async with running(fake, max_response_bytes=8) as server:
        body = {"messages": [], "n": 2}
        answer = await exchange(
            server.proxy_port, json_request(CHAT, body, "X-Fake: long-content-length")
        )
    assert answer.status == 502
    assert "larger than 8 bytes" in answer.error()["message"]


async def test_endless_child_sse_line_ends_the_stream_with_one_error(fake: Fake) -> None:
    limit = 1 << 20
    async with running(fake, max_response_bytes=limit) as server:
        body = {"messages": [], "n": 2, "stream": True}
        answer = await exchange(
            server.proxy_port, json_request(CHAT, body, "X-Fake: endless-sse"), wait=60
        )
        await asyncio.wait_for(fake.endless_gone.wait(), 20)
    assert answer.status == 200
    events = [e for e in answer.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert b"max_event_bytes" in events[-2]
    # Two children, each cut at the cap (the SSE decoder's line limit follows it), plus buffers.
    assert fake.endless_sent < 2 * 16 * limit


# --- Content-Encoding ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT, {"messages": [], "marker": "gz1"}), ("/v1/embeddings", {"input": "gz1"})],
)
async def test_pass_through_forwards_an_encoded_body_byte_for_byte(
    fake: Fake, path: str, body: dict[str, Any]
) -> None:
    raw = gzip.compress(orjson.dumps(body))
    async with running(fake) as server:
        answer = await exchange(
            server.proxy_port, json_request(path, raw, "Content-Encoding: gzip")
        )
    assert answer.status == 200, answer
    (seen,) = [s for s in fake.seen if s.path == path]
    assert seen.body == raw
    assert seen.headers["Content-Encoding"] == "gzip"


@pytest.mark.parametrize(
    "encode",
    [
        pytest.param(gzip.compress, id="gzip"),
        pytest.param(zlib.compress, id="deflate-zlib"),
        pytest.param(lambda b: zlib.compress(b, wbits=-15), id="deflate-raw"),
    ],
)
async def test_fanout_inflates_the_body_and_children_get_plain_json(
    fake: Fake, encode: Any
) -> None:
    body = {"messages": [], "n": 2, "seed": 10, "marker": "gz2"}
    coding = "gzip" if encode is gzip.compress else "deflate"
    async with running(fake) as server:
        answer = await exchange(
            server.proxy_port,
            json_request(CHAT, encode(orjson.dumps(body)), f"Content-Encoding: {coding}"),
        )
    assert answer.status == 200, answer
    children = fake.parents("gz2")
    assert sorted(orjson.loads(c.body)["seed"] for c in children) == [10, 11]
    for child in children:
        assert "Content-Encoding" not in child.headers


@pytest.mark.parametrize("path", [CHAT, "/v1/embeddings"])
async def test_a_body_that_came_with_its_head_is_capped_at_max_body_bytes_exactly(
    fake: Fake, path: str
) -> None:
    """A small body arrives in the head's packet and is taken as it lies, not read: the cap
    holds there too, at the byte, on a fan-out path and a passed-through one alike."""
    limit = 64
    at_limit = b'{"n": 2, "messages": [], "pad": "' + b"x" * (limit - 35) + b'"}'
    assert len(at_limit) == limit
    async with running(fake, max_body_bytes=limit) as server:
        over = await exchange(server.proxy_port, json_request(path, at_limit + b" "))
        assert over.status == 413
        assert f"larger than {limit} bytes" in over.error()["message"]
        assert fake.seen == []
        whole = await exchange(server.proxy_port, json_request(path, at_limit))
        assert whole.status == 200
    assert {s.path for s in fake.seen} == {path}  # the body at the limit went upstream


async def test_gzip_bomb_on_a_fanout_path_is_413_and_never_inflated_whole(fake: Fake) -> None:
    bomb = gzip.compress(b'{"n": 2, "pad": "' + b"0" * (32 << 20) + b'"}')
    async with running(fake, max_body_bytes=1 << 20) as server:
        answer = await exchange(
            server.proxy_port, json_request(CHAT, bomb, "Content-Encoding: gzip")
        )
    assert answer.status == 413
    assert "once inflated" in answer.error()["message"]
    assert fake.seen == []


@pytest.mark.parametrize(
    ("coding", "body", "status"),
    [("br", b"\x0b\x02\x80{}\x03", 415), ("gzip, zstd", b"{}", 415), ("gzip", b"{not gz", 400)],
)
async def test_unknown_or_broken_encoding_on_a_fanout_path_is_rejected(
    fake: Fake, coding: str, body: bytes, status: int
) -> None:
    async with running(fake) as server:
        answer = await exchange(
            server.proxy_port, json_request(CHAT, body, f"Content-Encoding: {coding}")
        )
        passed = await exchange(
            server.proxy_port, json_request("/v1/embeddings", body, f"Content-Encoding: {coding}")
        )
    assert answer.status == status
    assert answer.error()["type"] == "invalid_request_error"
    assert passed.status == 200  # elsewhere the proxy does not read it: forwarded as it came
    assert [s.body for s in fake.seen] == [body]


# --- client timeouts and max_connections -----------------------------------------------------


QUICK = ClientTimeouts(headers=0.5, body=0.5)


async def test_slow_request_body_is_408_and_the_connection_closed(fake: Fake) -> None:
    async with running(fake, client_timeouts=QUICK) as server:
        head = json_request(CHAT, b"x" * 100)[:-90]  # headers and 10 of the 100 body bytes
        answer = await exchange(server.proxy_port, head)
        assert answer.status == 408
        assert answer.error()["type"] == "invalid_request_error"
        assert server.metrics.client_timeouts.labels("body")._value.get() == 1
        # A prompt client on the same proxy is unaffected.
        whole = json_request(CHAT, {"messages": [], "n": 2})
        assert (await exchange(server.proxy_port, whole)).status == 200
    assert len(fake.seen) == 2


@pytest.mark.parametrize("case", ["first-request", "next-request", "nothing-sent"])
async def test_trickled_request_headers_are_cut_with_408(fake: Fake, case: str) -> None:
    async with running(fake, client_timeouts=QUICK) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.proxy_port)
        try:
            if case == "next-request":
                writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                line = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
                assert line.startswith(b"HTTP/1.1 200")
                length = int(parse(line).headers["Content-Length"])
                await reader.readexactly(length)
            if case != "nothing-sent":
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            raw = await asyncio.wait_for(reader.read(-1), 20)  # the server closes the connection
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        assert server.metrics.client_timeouts.labels("headers")._value.get() == 1
    answer = parse(raw)
    assert answer.status == 408
    assert answer.headers["Server"] == "n-proxy"
    assert answer.error()["type"] == "invalid_request_error"


async def test_connections_past_max_connections_are_closed_at_accept(fake: Fake) -> None:
    async with running(fake, max_connections=3) as server:
        held = [await asyncio.open_connection("127.0.0.1", server.proxy_port) for _ in range(3)]
        try:
            # The fourth is accepted by the kernel, then closed by the proxy before it reads.
            reader, writer = await asyncio.open_connection("127.0.0.1", server.proxy_port)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(reader.read(-1), 20) == b""
            writer.close()
            assert server.metrics.connections_refused._value.get() == 1
        finally:
            for _, held_writer in held:
                held_writer.close()
        # Once the held connections are gone, new ones are served again.
        for _ in range(400):  # the held connections' ends reach the proxy in a moment
            if server.metrics.client_connections._value.get() == 0:
                break
            await asyncio.sleep(0.05)
        answer = await exchange(server.proxy_port, request("/v1/models", b"", method="GET"))
        assert answer.status == 200
    assert [s.path for s in fake.seen] == ["/v1/models"]


# Run in a child process: the open-file limit is the process's own.
_FD_LIMIT = """
import json, logging, resource
from proxy.config.models import single_upstream_config
from proxy.server.process import _raise_fd_limit

events = []
handler = logging.Handler()
handler.emit = lambda record: events.append((record.getMessage(), record.fields))
logger = logging.getLogger("n_proxy")
logger.addHandler(handler)
logger.setLevel(logging.INFO)
config = single_upstream_config("http://127.0.0.1:1", max_connections=1000)
config = config.model_copy(update={"upstreams": (config.upstreams[0].model_copy(
    update={"max_concurrency": 10}),)})
out = {}
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 2000))
_raise_fd_limit(config)
out["raised"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
_raise_fd_limit(config)
out["capped"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
out["events"] = events
print(json.dumps(out))
"""


def test_start_raises_the_open_file_limit_to_fit_or_logs_once_that_it_cannot() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FD_LIMIT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = orjson.loads(done.stdout)
    # Room for every client connection, every upstream slot and the spare ones (admin, logs...).
    assert out["raised"] == 1000 + 10 + 256
    assert out["capped"] == 300  # the hard limit: it cannot, and says so once
    ((message, fields),) = out["events"]
    assert "open-file limit is below max_connections" in message
    assert fields == {"fd_limit": 300, "needed": 1266}


# --- one JSON policy --------------------------------------------------------------------------


BIG = b"123456789012345678901234567890"


@pytest.mark.parametrize(
    "value", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400"], ids=lambda v: v.decode()
)
@pytest.mark.parametrize("n", [1, 2])
async def test_non_finite_numbers_are_400_even_beside_a_big_integer(
    fake: Fake, value: bytes, n: int
) -> None:
    body = b'{"messages": [], "n": %d, "big": %s, "temperature": %s, "marker": "nan"}' % (
        n,
        BIG,
        value,
    )
    async with running(fake) as server:
        answer = await exchange(server.proxy_port, json_request(CHAT, body))
    assert answer.status == 400, answer
    assert "not valid JSON" in answer.error()["message"]
    assert fake.seen == []


async def test_leading_bom_is_400_even_beside_a_big_integer(fake: Fake) -> None:
    body = b'\xef\xbb\xbf{"messages": [], "n": 2, "big": %s}' % BIG
    async with running(fake) as server:
        answer = await exchange(server.proxy_port, json_request(CHAT, body))
    assert answer.status == 400
    assert fake.seen == []


async def test_big_integers_reach_every_child_exactly(fake: Fake) -> None:
    body = b'{"messages": [], "n": 2, "big": %s, "neg": -%s, "marker": "bigint"}' % (BIG, BIG)
    async with running(fake) as server:
        answer = await exchange(server.proxy_port, json_request(CHAT, body))
    assert answer.status == 200
    children = fake.parents("bigint")
    assert len(children) == 2
    for child in children:
        assert b'"big":%s' % BIG in child.body
        assert b'"neg":-%s' % BIG in child.body


async def test_model_routing_holds_a_pass_through_body_to_the_same_policy(fake: Fake) -> None:
    routes = (Route(upstream="default", model="m*"),)
    async with running(fake, routes=routes) as server:
        nan = b'{"model": "m1", "input": NaN}'
        answer = await exchange(server.proxy_port, json_request("/v1/embeddings", nan))
        fine = b'{"model": "m1", "input": "x"}'
        passed = await exchange(server.proxy_port, json_request("/v1/embeddings", fine))
    assert answer.status == 400
    assert passed.status == 200
    assert [s.body for s in fake.seen] == [fine]


# --- Expect, malformed request lines, the Server header ----------------------------------------


@pytest.mark.parametrize("n", [1, 2])
async def test_expect_is_never_forwarded(fake: Fake, n: int) -> None:
    body = {"messages": [], "n": n, "marker": f"expect{n}"}
    async with running(fake) as server:
        answer = await exchange(server.proxy_port, json_request(CHAT, body, "Expect: 100-continue"))
    assert answer.status == 200
    children = fake.parents(f"expect{n}")
    assert len(children) == n
    for child in children:
        assert "Expect" not in child.headers


@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect"])
async def test_the_proxys_requests_skip_the_router_but_for_one_with_expect(
    fake: Fake, monkeypatch: pytest.MonkeyPatch, expect: bool
) -> None:
    """The proxy app's one route is reached without aiohttp's router
    (``proxy.server.connection.direct_route``), the app's ``on_response_prepare`` still run; a
    request with ``Expect`` goes through the app, for its ``100 Continue``."""
    routed: list[str] = []  # the clients' requests the router saw (the fake's have its host)
    resolve = web.UrlDispatcher.resolve

    async def counted(self: web.UrlDispatcher, request: web.Request) -> Any:
        if request.host == "x":
            routed.append(request.path)
        return await resolve(self, request)

    monkeypatch.setattr(web.UrlDispatcher, "resolve", counted)
    headers = ("Expect: 100-continue",) if expect else ()
    async with running(fake) as server:
        for n in (1, 2):
            body: dict[str, Any] = {"messages": [], "n": n}
            answer = await exchange(server.proxy_port, json_request(CHAT, body, *headers))
            assert answer.status == 200
            assert len(orjson.loads(answer.body)["choices"]) == n
            # The app's on_response_prepare ran: the proxy's Server header, but on a pass-through
            server_header = UPSTREAM_SERVER if n == 1 else "n-proxy"
            assert answer.headers["Server"] == server_header
    assert routed == ([CHAT, CHAT] if expect else [])


def test_only_an_app_of_one_every_path_route_without_middleware_is_routed_directly() -> None:
    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response()

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        return await handler(request)  # type: ignore[no-any-return]

    def app(*middlewares: Any, every: bool = True) -> web.Application:
        made = web.Application(middlewares=middlewares)
        if every:
            resource = EveryPath("/")
            made.router.register_resource(resource)
            resource.add_route("*", handle)
        else:
            made.router.add_get("/livez", handle)  # as the admin app's routes
        return made

    assert direct_route(app(), handle) is not None
    assert direct_route(app(middleware), handle) is None  # a middleware must see each request
    assert direct_route(app(every=False), handle) is None
    assert direct_route(None, handle) is None


@pytest.mark.parametrize(
    "line",
    [
        b"GET /v1/models\r\n",  # HTTP/0.9 as it is: one line end, then the answer is awaited
        b"GET /v1/models\n",
        b"GET /v1/models\r\n\r\n",
        b"GET /v1/models HTTP/0.9\r\n\r\n",
    ],
    ids=["0.9-real", "0.9-lf", "bare", "0.9"],
)
async def test_http_0_9_request_line_is_400_at_once_before_any_upstream_contact(
    fake: Fake, line: bytes
) -> None:
    # The header deadline far off: the answer must not wait for it.
    async with running(fake, client_timeouts=ClientTimeouts(headers=600)) as server:
        answer = await exchange(server.proxy_port, line)
    assert answer.status == 400
    assert answer.error()["type"] == "invalid_request_error"
    assert fake.seen == []


async def test_http_0_9_split_across_reads_is_400_and_http_1_split_alike_is_served(
    fake: Fake,
) -> None:
    async with running(fake, client_timeouts=ClientTimeouts(headers=600)) as server:
        for pieces, status in (
            ([b"GE", b"T /v1/mo", b"dels\r", b"\n"], 400),
            (
                [b"GET /v1/mo", b"dels HT", b"TP/1.1\r\nHost: x\r\n", b"Connection: close\r\n\r\n"],
                200,
            ),
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.proxy_port)
            try:
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.02)  # separate reads, not a timing assertion
                raw = await asyncio.wait_for(reader.read(-1), 20)
            finally:
                writer.close()
            assert parse(raw).status == status


async def test_every_response_the_proxy_writes_says_server_n_proxy(fake: Fake) -> None:
    async with running(fake) as server:
        port = server.proxy_port
        answers = {
            "fan-out": await exchange(port, json_request(CHAT, {"messages": [], "n": 2})),
            "bad n": await exchange(port, json_request(CHAT, {"messages": [], "n": 0})),
            "413": await exchange(port, json_request(CHAT, b"x" * (17 << 20))),
            "no Host": await exchange(port, b"GET /v1/models HTTP/1.1\r\n\r\n"),
            "bad header": await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"),
            "pass-through": await exchange(port, request("/v1/models", b"", method="GET")),
        }
    assert {k: a.status for k, a in answers.items()} == {
        "fan-out": 200,
        "bad n": 400,
        "413": 413,
        "no Host": 400,
        "bad header": 400,
        "pass-through": 200,
    }
    for name, answer in answers.items():
        expected = UPSTREAM_SERVER if name == "pass-through" else "n-proxy"
        assert answer.headers.getall("Server") == [expected], name
        if answer.status >= 400:
            assert answer.error()["type"] == "invalid_request_error", name


# --- the connection's loop over its requests ----------------------------------------------------


async def _answer_on(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
) -> Answer:
    """One request on a kept-alive connection, its answer read by its length."""
    writer.write(data)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    answer = parse(head)
    answer.body = await asyncio.wait_for(
        reader.readexactly(int(answer.headers["Content-Length"])), 20
    )
    return answer


async def test_a_connections_requests_are_handled_one_by_one_in_its_own_task(
    fake: Fake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No task is made per request (``ClientConnection.start``): each connection's requests run
    in that connection's task, one after the other, pipelined ones in the order they came."""
    handled: list[tuple[int, asyncio.Task[Any] | None]] = []
    dispatch = Generations.dispatch

    def recorded(self: Generations, request: web.Request) -> Awaitable[web.StreamResponse]:
        handled.append((int(request.headers["X-Nth"]), asyncio.current_task()))
        return dispatch(self, request)

    monkeypatch.setattr(Generations, "dispatch", recorded)

    def nth(k: int) -> bytes:
        body = orjson.dumps({"messages": [], "n": 1 + k % 2})
        return json_request(CHAT, body, f"X-Nth: {k}").replace(b"Connection: close\r\n", b"")

    async with running(fake) as server:
        connections = [await asyncio.open_connection("127.0.0.1", server.proxy_port) for _ in "ab"]
        try:
            for k, (reader, writer) in enumerate(connections * 2):
                assert (await _answer_on(reader, writer, nth(k))).status == 200
            reader, writer = connections[0]
            writer.write(nth(4) + nth(5))  # pipelined: both in one write
            for _ in range(2):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
                await reader.readexactly(int(parse(head).headers["Content-Length"]))
        finally:
            for _, writer in connections:
                writer.close()
    assert [k for k, _ in handled] == [0, 1, 2, 3, 4, 5]
    tasks = [task for _, task in handled]
    assert tasks[0] is tasks[2] is tasks[4] is tasks[5]
    assert tasks[1] is tasks[3]
    assert tasks[0] is not tasks[1]


async def test_a_body_left_unread_is_drained_and_the_connection_serves_the_next_request(
    fake: Fake,
) -> None:
    """A body past ``max_body_bytes`` that comes after its head is 413 once the cap is read; the
    rest, sent after the answer, is read and dropped (aiohttp's lingering close), and the same
    connection serves the next request."""
    limit = 1000
    async with running(fake, max_body_bytes=limit) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.proxy_port)
        try:
            body = b'{"pad": "' + b"x" * 4 * limit + b'"}'
            head = json_request(CHAT, body)[: -len(body)].replace(b"Connection: close\r\n", b"")
            writer.write(head)
            await writer.drain()
            await asyncio.sleep(0.05)  # the head alone first: the body is read, not taken whole
            over = await _answer_on(reader, writer, body[: 2 * limit])
            assert over.status == 413
            writer.write(body[2 * limit :])
            again = json_request(CHAT, {"messages": [], "n": 2}).replace(
                b"Connection: close\r\n", b""
            )
            whole = await _answer_on(reader, writer, again)
            assert whole.status == 200
            assert len(orjson.loads(whole.body)["choices"]) == 2
        finally:
            writer.close()
    assert len(fake.seen) == 2


# --- a client that leaves ---------------------------------------------------------------------


async def _freed(held: list[weakref.ref[Any]]) -> None:
    """Every object ``held`` names goes within a moment (not a collection)."""
    await until(lambda: all(ref() is None for ref in held), what="freed without the collector")


def _watch(monkeypatch: pytest.MonkeyPatch) -> tuple[list[weakref.ref[Any]], asyncio.Event]:
    """Each request the proxy handles (but one marked ``X-Holder``) and the task that handles
    it, watched through weak references; the event is set as each is handled."""
    held: list[weakref.ref[Any]] = []
    entered = asyncio.Event()
    dispatch = Generations.dispatch

    def recorded(self: Generations, request: web.Request) -> Awaitable[web.StreamResponse]:
        if "X-Holder" not in request.headers:
            held.extend((weakref.ref(request), weakref.ref(asyncio.current_task())))
            entered.set()
        return dispatch(self, request)

    monkeypatch.setattr(Generations, "dispatch", recorded)
    return held, entered


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """The cyclic collector off for the block, after one last collection."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize(
    ("n", "stream", "fake_body"),
    [(1, True, "endless-sse"), (2, True, "endless-sse"), (2, False, "endless-json")],
    ids=["pass-through", "fan-out-stream", "fan-out-json"],
)
@pytest.mark.parametrize("rst", [True, False], ids=["rst", "fin"])
async def test_a_request_whose_client_left_is_freed_without_the_collector(
    fake: Fake, monkeypatch: pytest.MonkeyPatch, n: int, stream: bool, fake_body: str, rst: bool
) -> None:
    """A client that leaves mid-request cancels its connection's task, and each failure's
    traceback holds the frames it passed through. Nothing those frames hold may lead back to the
    failure (an upstream response keeping the failure it raised did, and so did the request's
    body keeping the transport's error; a local of ``ClientConnection.start`` naming the
    connection's task would), or the task, the request and the connection wait for the cyclic
    collector, which the proxy runs rarely (``proxy.server.memory``)."""
    held, _ = _watch(monkeypatch)
    body = orjson.dumps({"messages": [], "stream": stream, "n": n})
    async with running(fake) as server:
        with _collector_off():
            for _ in range(3):
                fake.endless_gone.clear()
                fake.endless_flowing.clear()
                _, writer = await asyncio.open_connection("127.0.0.1", server.proxy_port)
                writer.write(json_request(CHAT, body, f"X-Fake: {fake_body}"))
                async with asyncio.timeout(20):
                    await fake.endless_flowing.wait()  # the proxy is reading the stream
                await leave(writer, rst)
                async with asyncio.timeout(20):
                    await fake.endless_gone.wait()  # the proxy saw the client leave and hung up
                await _freed(held)
    assert len(held) == 2 * 3
    assert len(fake.seen) == 3 * n


@pytest.mark.parametrize("where", ["body", "head", "fan-out-head", "queued"])
async def test_a_request_whose_client_left_early_is_freed_without_the_collector(
    fake: Fake, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The same, for a client that leaves before any answer: mid-body, while the upstream has
    not answered (one child, or two), or while its request waits for an upstream's slot."""
    held, entered = _watch(monkeypatch)  # the request that takes the one slot is not watched
    config = single_upstream_config(fake.url).model_copy(
        update={"listen": Listen(host="127.0.0.1", port=0)}
    )
    async with serving(with_upstream(config, max_concurrency=1)) as server:
        slots = server.upstreams.state(server.upstreams.config.upstreams[0]).slots
        holder = None
        if where == "queued":  # the one slot taken by a request the upstream never answers
            holder = await asyncio.open_connection("127.0.0.1", server.proxy_port)
            holder[1].write(json_request(CHAT, {"messages": []}, "X-Fake: hold", "X-Holder: 1"))
            async with asyncio.timeout(20):
                await fake.holding.wait()
        try:
            with _collector_off():
                for _ in range(3):
                    entered.clear()
                    fake.holding.clear()
                    _, writer = await asyncio.open_connection("127.0.0.1", server.proxy_port)
                    n = 2 if where == "fan-out-head" else 1
                    data = json_request(CHAT, {"messages": [], "n": n}, "X-Fake: hold")
                    writer.write(data[:-2] if where == "body" else data)
                    async with asyncio.timeout(20):
                        await entered.wait()
                        if where in ("head", "fan-out-head"):
                            await fake.holding.wait()
                    if where == "queued":
                        await until(lambda: slots.queued > 0)
                    await leave(writer, rst=True)
                    await _freed(held)
        finally:
            if holder is not None:
                holder[1].close()
    assert len(held) == 2 * 3


async def test_a_client_that_leaves_while_its_unread_body_is_drained_is_freed_without_the_collector(
    fake: Fake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that leaves while the proxy reads and drops the body it did not need (after a
    413) cancels the drain; the connection's task and the request go at once all the same."""
    held, _ = _watch(monkeypatch)
    limit = 1000
    body = b'{"pad": "' + b"x" * 4 * limit + b'"}'
    head = json_request(CHAT, body)[: -len(body)].replace(b"Connection: close\r\n", b"")
    async with running(fake, max_body_bytes=limit) as server:
        with _collector_off():
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.proxy_port)
                writer.write(head)
                await writer.drain()
                over = await _answer_on(reader, writer, body[: 2 * limit])
                assert over.status == 413  # the rest of the body is now read and dropped
                await leave(writer, rst=True)
                await _freed(held)
    assert len(held) == 2 * 3
    assert not fake.seen
