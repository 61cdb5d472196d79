"""A raw upstream for end-to-end tests: literal bytes per request path, on a loopback socket.

``/health`` and ``/ok/<marker>`` answer well-formed responses (the body is the marker);
any other path answers the bytes the test scripted for it, then keeps reading the connection.
Every request is recorded with the raw bytes of its head.

Kept apart from ``upstreams.RecordingUpstream``: an aiohttp server frames every answer itself,
and these tests need answers no server library would write (a second response after a body,
a head that never ends, a 503 whose body never comes, a connection closed before any status).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

WAIT = 10.0  # seconds: a bound on every wait, not a timing assertion


@dataclass
class Seen:
    path: str
    head: bytes
    body: bytes
    connection: int


@dataclass
class RawUpstream:
    scripts: dict[str, bytes] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    resets: set[str] = field(default_factory=set)  # paths whose next request gets a reset
    closes: set[str] = field(default_factory=set)  # paths closed unanswered, every time
    later: dict[str, bytes] = field(default_factory=dict)  # sent once ``release`` is set
    release: asyncio.Event = field(default_factory=asyncio.Event)
    health: asyncio.Event = field(default_factory=asyncio.Event)  # a .../health request came
    connections: int = 0
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> RawUpstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def requests(self, prefix: str) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith(prefix)]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError):
            for _ in range(1000):  # requests on one connection, bounded
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                path = head.split(b" ", 2)[1].decode("latin-1")
                self.seen.append(Seen(path, head, body, number))
                if path.endswith("/health"):
                    self.health.set()
                if path in self.resets:
                    self.resets.discard(path)
                    writer.transport.abort()
                    return
                if path in self.closes:
                    break
                writer.write(self.answer(path))
                await writer.drain()
                if path in self.later:
                    async with asyncio.timeout(WAIT):
                        await self.release.wait()
                    writer.write(self.later[path])
                    await writer.drain()
        writer.close()

    def answer(self, path: str) -> bytes:
        if path in self.scripts:
            return self.scripts[path]
        marker = path.rsplit("/", 1)[-1].encode()
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(marker), marker)


async def exchange(
    port: int, request: bytes, seen: bytes | None = None, then: asyncio.Event | None = None
) -> bytes:
    """Send ``request`` to the proxy and read its whole answer, until the proxy closes.

    Once the bytes ``seen`` have arrived, ``then`` is set (the upstream's cue for more).
    """
    async with asyncio.timeout(WAIT):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            chunks = []
            with contextlib.suppress(ConnectionError):
                while chunk := await reader.read(65536):
                    chunks.append(chunk)
                    if then is not None and seen is not None and seen in b"".join(chunks):
                        then.set()
            return b"".join(chunks)
        finally:
            writer.close()


def get_request(path: str, *headers: bytes) -> bytes:
    extra = b"".join(h + b"\r\n" for h in headers)
    return b"GET %s HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n%s\r\n" % (path.encode(), extra)


def post_request(path: str, body: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
        % (path.encode(), len(body), body)
    )


def framed_whole(raw: bytes) -> bool:
    """Whether a raw HTTP/1.1 answer carries its whole body as its framing announced it."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    status = int(lines[0].split()[1])
    if status in (204, 304):
        return body == b""
    for line in lines[1:]:
        if line.startswith(b"content-length:"):
            return len(body) == int(line.split(b":", 1)[1])
        if line.startswith(b"transfer-encoding:") and b"chunked" in line:
            return body.endswith(b"0\r\n\r\n")
    return True  # close-delimited: whatever came is all
