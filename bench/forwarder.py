"""The 20-line aiohttp forwarder, a contender: what a plain aiohttp reverse proxy costs. ``--lean``:
the same on n-proxy's own upstream client, bodies read whole (aiohttp's server and that client).
``--floor``: that client behind a bare httptools protocol, no server framework at all: the least
any Python proxy on n-proxy's client pays per request."""

import argparse
import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from bench.workload import on_uvloop

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def build(upstream: str) -> web.Application:
    async def forward(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["client"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with session.request(
            request.method, upstream + request.rel_url.raw_path_qs, headers=headers,
            data=await request.read(), auto_decompress=False,
        ) as upstream_response:  # fmt: skip
            headers = {k: v for k, v in upstream_response.headers.items() if k.lower() not in HOP}
            response = web.StreamResponse(status=upstream_response.status, headers=headers)
            await response.prepare(request)
            async for data in upstream_response.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response

    return _app(forward, lambda: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))


def build_lean(upstream: str) -> web.Application:
    from proxy.http import ConnectionPool

    async def forward(request: web.Request) -> web.Response:
        pool: ConnectionPool = request.app["client"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        answer = await pool.request(
            upstream, request.method, request.rel_url.raw_path_qs, headers, await request.read(),
            connect=5.0, first_byte=60.0, idle=60.0,
        )  # fmt: skip
        try:
            body = await answer.read(1 << 26)
        finally:
            pool.release(answer)
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP}
        return web.Response(status=answer.status, headers=headers, body=body)

    return _app(forward, ConnectionPool)


class Floor(asyncio.Protocol):
    """One client connection, parsed by httptools; each request forwarded whole on n-proxy's
    pool, answered in one write, in the order the requests came (``_forward`` waits for the one
    before it)."""

    def __init__(self, pool: Any, upstream: str) -> None:
        import httptools

        self.pool, self.upstream = pool, upstream
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url, self.headers, self.body = b"", dict[str, str](), bytearray()
        self.last: asyncio.Task[None] | None = None  # the answer before the next one's

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:  # httptools' parse errors: a 400, then the connection is closed
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", {}, bytearray()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode()
        if key.lower() not in HOP:
            self.headers[key] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        method, keep = self.parser.get_method().decode(), self.parser.should_keep_alive()
        sent = (method, self.url.decode(), self.headers, bytes(self.body))
        self.last = asyncio.get_running_loop().create_task(self._forward(self.last, keep, *sent))

    async def _forward(self, before: Any, keep: bool, *sent: Any) -> None:
        answer = await self.pool.request(self.upstream, *sent, connect=5.0, first_byte=60.0,
                                         idle=60.0)  # fmt: skip
        try:
            body = await answer.read(1 << 26)
        finally:
            self.pool.release(answer)
        head = [f"HTTP/1.1 {answer.status} {answer.reason}"]
        head += [f"{k}: {v}" for k, v in answer.headers.items() if k.lower() not in HOP]
        head += [f"Content-Length: {len(body)}", *(["Connection: close"] * (not keep)), "", ""]
        if before is not None:
            await before
        if self.transport is not None:
            self.transport.write("\r\n".join(head).encode("latin-1") + body)
            if not keep:
                self.transport.close()


async def serve_floor(upstream: str, port: int) -> None:
    from proxy.http import ConnectionPool

    pool = ConnectionPool()
    loop = asyncio.get_running_loop()
    await loop.create_server(lambda: Floor(pool, upstream), "127.0.0.1", port, backlog=4096)
    await asyncio.Event().wait()  # until killed


def _app(forward: Any, client: Any) -> web.Application:
    """Every path to ``forward``; ``client()`` made at start-up as ``app["client"]``, closed at
    the end (aiohttp's session and n-proxy's pool both have an async ``close``)."""

    async def lifetime(app: web.Application):  # type: ignore[no-untyped-def]
        app["client"] = client()
        yield
        await app["client"].close()

    app = web.Application()
    app.cleanup_ctx.append(lifetime)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.forwarder", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--lean", action="store_true", help="n-proxy's client, whole bodies")
    parser.add_argument("--floor", action="store_true", help="that behind httptools alone")
    args = parser.parse_args()
    on_uvloop()
    if args.floor:
        asyncio.run(serve_floor(args.upstream, args.port))
        return
    app = (build_lean if args.lean else build)(args.upstream)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, backlog=4096)


if __name__ == "__main__":
    main()
