"""The 20-line aiohttp forwarder, a contender: what a plain aiohttp reverse proxy costs. ``--lean``:
the same on n-proxy's own upstream client, bodies read whole (the floor under n-proxy)."""

import argparse
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
    args = parser.parse_args()
    on_uvloop()
    app = (build_lean if args.lean else build)(args.upstream)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, backlog=4096)


if __name__ == "__main__":
    main()
