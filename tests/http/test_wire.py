"""The wire never mixes two answers: hostile upstream bytes, end to end.

Each hostile answer goes to one client through the proxy; that client gets what the table says,
and the next two requests, sent on the same upstream pool, each get their own answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from proxy.config.models import Timeouts, single_upstream_config
from proxy.server.app import GENERATIONS
from tests.support.rawhttp import parse_raw
from tests.support.rawupstream import (
    WAIT,
    RawUpstream,
    exchange,
    framed_whole,
    get_request,
    post_request,
)
from tests.support.servers import start_proxy, with_upstream

OK5 = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
SMUGGLED = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
BIG = 300_000


@dataclass(frozen=True)
class Hostile:
    answer: bytes
    status: int
    body: bytes | None  # None: any body (an error body of the proxy's)
    whole: bool = True  # False: the client must see a truncated answer (a cut connection)
    later: bytes = b""  # sent once the client has the body so far: a read during the relay


HOSTILE = {
    "extra-bytes-after-content-length": Hostile(OK5 + b"EXTRA", 200, b"hello"),
    "second-response-after-content-length": Hostile(OK5 + SMUGGLED, 200, b"hello"),
    "garbage-then-a-second-response": Hostile(OK5 + b"GARBAGE\r\n" + SMUGGLED, 200, b"hello"),
    "garbage-then-a-second-response-in-a-later-read": Hostile(
        OK5, 200, b"hello", later=b"GARBAGE\r\n" + SMUGGLED
    ),
    "204-with-a-body": Hostile(b"HTTP/1.1 204 No Content\r\n\r\n" + SMUGGLED, 204, b""),
    "304-with-a-body": Hostile(b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\nbody", 304, b""),
    "crlf-after-the-message": Hostile(OK5 + b"\r\n\r\n", 200, b"hello"),
    "garbage-after-chunked-terminator": Hostile(
        CHUNKED + b"5\r\nhello\r\n0\r\n\r\nGARBAGE", 200, b"hello"
    ),
    "response-after-chunked-terminator": Hostile(
        CHUNKED + b"5\r\nhello\r\n0\r\n\r\n" + SMUGGLED, 200, b"hello"
    ),
    "big-body-then-extra-in-the-same-write": Hostile(
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % BIG + b"x" * BIG + b"EXTRA",
        200,
        b"x" * BIG,
    ),
    "response-after-chunked-terminator-in-a-later-read": Hostile(
        CHUNKED + b"5\r\nhello\r\n",
        200,
        b"hello world",
        later=b"6\r\n world\r\n0\r\n\r\n" + SMUGGLED,
    ),
    "bad-chunk-size-mid-body": Hostile(
        CHUNKED + b"5\r\nhello\r\n", 200, b"hello world", False, b"6\r\n world\r\nZZ\r\nmore\r\n"
    ),
    "content-length-body-then-garbage-mid-relay": Hostile(
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % BIG + b"x" * 1000,
        200,
        b"x" * BIG,
        later=b"x" * (BIG - 1000) + b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled",
    ),
    "head-that-never-ends": Hostile(b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * (1 << 20), 502, None),
    "header-line-over-the-cap": Hostile(
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * (300 * 1024) + b"\r\n\r\n", 502, None
    ),
    "two-interim-responses-are-fine": Hostile(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK5,
        200,
        b"hello",
    ),
}


@pytest.fixture
async def upstream() -> AsyncIterator[RawUpstream]:
    raw = await RawUpstream().start()
    yield raw
    await raw.stop()


@pytest.fixture
async def proxy_port(upstream: RawUpstream) -> AsyncIterator[int]:
    config = single_upstream_config(upstream.url)
    (entry,) = config.upstreams
    # first_byte short: a head that never ends must fail on its size, long before this.
    timeouts = Timeouts(connect=5.0, first_byte=8.0, idle=8.0)
    config = config.model_copy(
        update={"upstreams": (entry.model_copy(update={"timeouts": timeouts}),)}
    )
    runner, url = await start_proxy(config)
    yield int(url.rsplit(":", 1)[1])
    await runner.cleanup()


async def _get(
    port: int, path: str, seen: bytes | None = None, then: asyncio.Event | None = None
) -> tuple[int, bytes, bool]:
    raw = await exchange(port, get_request(path), seen, then)
    status_line, _, body = parse_raw(raw)
    return int(status_line.split()[1]), body, framed_whole(raw)


async def _post(port: int, path: str) -> tuple[int, bytes, bool]:
    raw = await exchange(port, post_request(path, b"{}"))
    status_line, _, body = parse_raw(raw)
    return int(status_line.split()[1]), body, framed_whole(raw)


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_a_hostile_answer_reaches_only_its_client_and_the_pool_stays_clean(
    upstream: RawUpstream, proxy_port: int, case: str
) -> None:
    hostile = HOSTILE[case]
    upstream.scripts["/hostile"] = hostile.answer
    if hostile.later:
        upstream.later["/hostile"] = hostile.later
    # Warm the pool: the hostile answer then comes on a connection the next requests may reuse.
    assert await _get(proxy_port, "/ok/warm") == (200, b"warm", True)
    status, body, whole = await _get(proxy_port, "/hostile", hostile.answer[-5:], upstream.release)
    assert status == hostile.status, body[:200]
    if hostile.body is not None:
        assert body == hostile.body
    assert whole is hostile.whole
    for marker in ("next1", "next2"):
        assert await _get(proxy_port, f"/ok/{marker}") == (200, marker.encode(), True)
    assert len(upstream.requests("/hostile")) == 1


async def test_only_codings_the_proxy_inflates_are_asked_of_children(
    upstream: RawUpstream, proxy_port: int
) -> None:
    chat = b'{"model":"m","messages":[],"n":2}'
    reply = b'{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}'  # noqa: E501
    upstream.scripts["/v1/chat/completions"] = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(reply), reply)
    )
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nConnection: close\r\n"
        b"Accept-Encoding: br, zstd;q=0.9, gzip;q=0.5, identity, *\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(chat), chat)
    )
    status_line, _, _ = parse_raw(await exchange(proxy_port, request))
    assert status_line.split()[1] == "200"
    children = upstream.requests("/v1/chat/completions")
    assert len(children) == 2
    for child in children:
        assert b"\r\nAccept-Encoding: gzip;q=0.5\r\n" in child.head
    # n=1 passes through: the client's own header, untouched
    upstream.scripts["/v1/models"] = OK5
    await exchange(proxy_port, get_request("/v1/models", b"Accept-Encoding: br, zstd"))
    (seen,) = upstream.requests("/v1/models")
    assert b"\r\nAccept-Encoding: br, zstd\r\n" in seen.head


@pytest.mark.parametrize(
    "value", [b"caf\xe9", b"caf\xc3\xa9", b"\xff\xfe raw", b"mixed \xc3\xa9 and \xe9"]
)
async def test_header_bytes_cross_unchanged_both_ways(
    upstream: RawUpstream, proxy_port: int, value: bytes
) -> None:
    for size in (5, 400_000):  # a body read whole, and a relayed one
        path = f"/bytes{size}"
        upstream.scripts[path] = (
            b"HTTP/1.1 200 OK\r\nX-Name: %s\r\nContent-Length: %d\r\n\r\n" % (value, size)
            + b"b" * size
        )
        raw = await exchange(proxy_port, get_request(path, b"X-Sent: " + value))
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"\r\nX-Name: " + value + b"\r\n" in head
        assert body == b"b" * size
        (seen,) = upstream.requests(path)
        assert b"\r\nX-Sent: " + value + b"\r\n" in seen.head


async def test_the_upstream_urls_path_prefixes_requests_and_health_checks(
    upstream: RawUpstream,
) -> None:
    config = single_upstream_config(upstream.url + "/base")
    runner, url = await start_proxy(config)
    try:
        port = int(url.rsplit(":", 1)[1])
        assert (await _get(port, "/ok/one"))[0] == 200
        assert [s.path for s in upstream.requests("/base/ok")] == ["/base/ok/one"]
        await asyncio.wait_for(upstream.health.wait(), 30)
        assert upstream.requests("/base/health")
        assert not upstream.requests("/health")
    finally:
        await runner.cleanup()


async def test_a_reset_on_a_reused_connection_is_not_retried_unless_retry_on_says_so(
    upstream: RawUpstream,
) -> None:
    """A POST: the pool's own once-more on a stale connection is for safe methods only."""
    config = single_upstream_config(upstream.url)  # retry_on: [connect], the default
    app_runner, url = await start_proxy(config)
    try:
        port = int(url.rsplit(":", 1)[1])
        assert await _get(port, "/ok/warm") == (200, b"warm", True)
        upstream.resets.add("/reset")
        status, _, _ = await _post(port, "/reset")
        assert status == 502
        assert len(upstream.requests("/reset")) == 1
        warm = upstream.requests("/ok/warm")[0]
        assert upstream.requests("/reset")[0].connection == warm.connection  # a reused one
    finally:
        await app_runner.cleanup()


async def test_a_reset_listed_in_retry_on_is_retried_counted_and_logged(
    upstream: RawUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    config = with_upstream(single_upstream_config(upstream.url), retry_on=("connect", "reset"))
    runner, url = await start_proxy(config)
    try:
        port = int(url.rsplit(":", 1)[1])
        assert await _get(port, "/ok/warm") == (200, b"warm", True)
        upstream.resets.add("/ok/again")
        with caplog.at_level(logging.INFO, logger="n_proxy"):  # a POST: retry_on decides
            assert await _post(port, "/ok/again") == (200, b"again", True)
        assert len(upstream.requests("/ok/again")) == 2
        retries = [r for r in caplog.records if r.getMessage() == "upstream retry"]
        assert len(retries) == 1
        assert retries[0].__dict__["fields"]["reason"] == "reset"
    finally:
        await runner.cleanup()


# --- an answer before the request was written ----------------------------------------------


# Past what loopback socket buffers hold at most (tcp_wmem's and tcp_rmem's defaults, 4 MiB
# and 6 MiB), within the proxy's 16 MiB body limit: the upload is not all out at the 413.
SMUGGLED_PAD = 14 << 20


class EarlyAnswers:
    """An upstream that answers an upload 413 with keep-alive before reading its body, then
    reads that body as the requests that follow, answering each: what a proxy that pools such
    a connection sends next gets the answer to a request smuggled in the body."""

    def __init__(self) -> None:
        self.go = asyncio.Event()  # the upload's body is read only once this is set
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()
        for handler in self.handlers:  # one may still be reading what the proxy sent
            handler.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            await self._answer(reader, writer)
        finally:
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            for _ in range(100):  # requests on one connection, bounded
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if path == b"/upload":
                    writer.write(
                        b"HTTP/1.1 413 Payload Too Large\r\nConnection: keep-alive\r\n"
                        b"Content-Length: 0\r\n\r\n"
                    )
                    async with asyncio.timeout(WAIT):
                        await self.go.wait()
                    continue  # the body is read next, as requests
                await reader.readexactly(length)
                marker = path.rsplit(b"/", 1)[-1]
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(marker), marker)
                )


async def test_a_connection_answered_before_its_upload_was_written_is_never_reused() -> None:
    early = EarlyAnswers()
    url = await early.start()
    runner, proxy_url = await start_proxy(single_upstream_config(url))
    try:
        port = int(proxy_url.rsplit(":", 1)[1])
        pool = runner.app[GENERATIONS].upstreams.connections
        assert await _get(port, "/ok/warm") == (200, b"warm", True)
        smuggled = (
            b"POST /smuggled HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % SMUGGLED_PAD
        )
        upload = smuggled + b"p" * SMUGGLED_PAD
        status_line, _, _ = parse_raw(await exchange(port, post_request("/upload", upload)))
        assert status_line.split()[1] == "413"
        nxt = asyncio.ensure_future(_get(port, "/ok/next1"))
        for _ in range(500):  # bounded: until the next request is out upstream (or answered)
            if pool.in_use or nxt.done():
                break
            await asyncio.sleep(0.01)
        early.go.set()  # the upstream reads the upload's body now, as requests
        assert await nxt == (200, b"next1", True)
        assert await _get(port, "/ok/next2") == (200, b"next2", True)
    finally:
        await runner.cleanup()
        await early.stop()


# --- Transfer-Encoding: one framing decision (docs/behaviour.md#errors) --------------------------

REPLY = (
    b'{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}]}'
)
EVENTS = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"hello"}}]}\n\ndata: [DONE]\n\n'
# The requests, each passed through (JSON, a stream) or fanned out, and the body their answer
# carries in chunked framing, cut in two reads.
WAYS = {
    "pass-through-json": (b'{"model":"m","messages":[]}', b"application/json", REPLY),
    "relayed-stream": (b'{"model":"m","messages":[],"stream":true}', b"text/event-stream", EVENTS),
    "fan-out-child": (b'{"model":"m","messages":[],"n":2}', b"application/json", REPLY),
}
# Transfer-Encoding heads the proxy cannot frame: a 502 with an OpenAI error body, never the
# chunked bytes read to the close ("hello0\r\n\r\n" and a reset, before), never both lengths.
REFUSED = {
    "chunked, identity": b"Transfer-Encoding: chunked, identity",
    "chunked-then-an-identity-line": b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity",
    "xchunked": b"Transfer-Encoding: xchunked",
    "gzip, chunked": b"Transfer-Encoding: gzip, chunked",
    "chunked, chunked": b"Transfer-Encoding: chunked, chunked",
    "content-length-then-chunked": b"Content-Length: 5\r\nTransfer-Encoding: chunked",
    "chunked-then-content-length": b"Transfer-Encoding: chunked\r\nContent-Length: 5",
}
# Heads it frames as the parser does: the body as its server meant it.
FRAMED = {
    "Chunked": b"Transfer-Encoding: Chunked",
    "identity, chunked": b"Transfer-Encoding: identity, chunked",
    "an-identity-line-then-chunked": b"Transfer-Encoding: identity\r\nTransfer-Encoding: chunked",
}


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _answered_with(upstream: RawUpstream, port: int, fields: bytes, way: str) -> bytes:
    request, content_type, body = WAYS[way]
    half = len(body) // 2
    path = "/v1/chat/completions"
    upstream.scripts[path] = b"HTTP/1.1 200 OK\r\nContent-Type: %b\r\n%b\r\n\r\n" % (
        content_type,
        fields,
    ) + _chunk(body[:half])
    upstream.later[path] = _chunk(body[half:]) + b"0\r\n\r\n"
    upstream.release.set()  # the rest follows at once, most often in a read of its own
    return await exchange(port, post_request(path, request))


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("fields", REFUSED.values(), ids=REFUSED.keys())
async def test_a_transfer_encoding_the_proxy_cannot_frame_is_a_502_before_any_byte(
    upstream: RawUpstream, proxy_port: int, fields: bytes, way: str
) -> None:
    raw = await _answered_with(upstream, proxy_port, fields, way)
    status_line, headers, body = parse_raw(raw)
    assert status_line.split()[1] == "502", raw
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body)["error"]["type"] == "server_error"
    assert framed_whole(raw)
    assert b"hello" not in raw
    assert await _get(proxy_port, "/ok/next") == (200, b"next", True)  # the pool is clean


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("fields", FRAMED.values(), ids=FRAMED.keys())
async def test_chunked_as_the_last_coding_reaches_the_client_as_its_server_meant(
    upstream: RawUpstream, proxy_port: int, fields: bytes, way: str
) -> None:
    raw = await _answered_with(upstream, proxy_port, fields, way)
    status_line, _, body = parse_raw(raw)
    assert status_line.split()[1] == "200", raw
    assert framed_whole(raw)
    if way == "fan-out-child":
        assert [c["message"]["content"] for c in json.loads(body)["choices"]] == ["hello"] * 2
    else:
        assert body == WAYS[way][2]
