"""The 20-line aiohttp forwarder: what a plain aiohttp reverse proxy costs, as a contender.

python -m bench.forwarder --port 8200 --upstream http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def build(upstream: str) -> web.Application:
    async def forward(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
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

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.forwarder", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    web.run_app(
        build(args.upstream), host="127.0.0.1", port=args.port, access_log=None,
        print=None, loop=loop_factory() if loop_factory else None, backlog=4096,
    )  # fmt: skip


if __name__ == "__main__":
    main()
