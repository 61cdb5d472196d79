"""What aiohttp parsed of a request, read where its request keeps it (proxy.request.parsed): each
reader gives what aiohttp's own property gives, on requests its C parser read off a socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from proxy.request import parsed

WITHIN = 30.0

# Each a request as a client writes it: versions, keep-alive either way, bodies framed by a length,
# by chunks (an empty one too) or not at all, a path with escapes and a query.
REQUESTS = [
    b"GET /a%20b/c?x=1&y=%2F HTTP/1.1\r\nHost: h\r\nX-One: 1\r\n\r\n",
    b"POST /p HTTP/1.0\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc",
    b"POST /q?z HTTP/1.1\r\nHost: h\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0\r\n\r\n",
    b"GET / HTTP/1.0\r\nHost: h\r\nConnection: keep-alive\r\n\r\n",
    b"DELETE /%7Euser HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n",
]


@pytest.fixture
async def seen() -> AsyncIterator[tuple[int, list[dict[str, Any]]]]:
    """A server on loopback whose one handler notes, for each request, every reader's value
    beside its property's; its port, and the notes."""
    notes: list[dict[str, Any]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        notes.append({
            "method": (parsed.method_of(request), request.method),
            "headers": (parsed.headers_of(request), request.headers),
            "path": (parsed.path_of(request), request.path),
            "path_qs": (parsed.path_qs_of(request), request.rel_url.raw_path_qs),
            "version": (parsed.version_of(request), request.version),
            "keep_alive": (parsed.keeps_alive(request), request.keep_alive),
            "content": (parsed.content_of(request), request.content),
            "body": (parsed.has_body(request), request.body_exists),
        })  # fmt: skip
        await request.read()
        return web.Response(status=201, text="ok")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield port, notes
    finally:
        await runner.cleanup()


async def test_each_reader_gives_what_aiohttps_property_gives(
    seen: tuple[int, list[dict[str, Any]]],
) -> None:
    port, notes = seen
    async with asyncio.timeout(WITHIN):
        for raw in REQUESTS:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(raw)
                status_line = await reader.readline()
            finally:
                writer.close()
                await writer.wait_closed()
            assert b" 201 " in status_line, status_line  # in the request's own version
    assert len(notes) == len(REQUESTS)
    for note in notes:
        for name, (mine, theirs) in note.items():
            if name in ("headers", "content"):
                assert mine is theirs, name
            else:
                assert mine == theirs, name
    # The requests differ where the readers could go wrong, so each comparison meant something.
    assert [n["path"][0] for n in notes] == ["/a b/c", "/p", "/q", "/", "/~user"]
    assert [n["path_qs"][0] for n in notes][:3] == ["/a%20b/c?x=1&y=%2F", "/p", "/q?z"]
    assert [n["keep_alive"][0] for n in notes] == [True, False, False, True, True]
    assert [n["body"][0] for n in notes] == [False, True, True, False, False]
    assert [n["version"][0] for n in notes] == [(1, 1), (1, 0), (1, 1), (1, 0), (1, 1)]


def test_status_of_gives_the_answers_status() -> None:
    for status in (200, 204, 418, 599):
        response = web.Response(status=status)
        assert parsed.status_of(response) == response.status == status
