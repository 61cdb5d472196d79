"""bench.load's closed loop when the client does its own fan-out (``together``): the vllm
scenario's client loop rests on each group's requests being in flight at once and counted as
one request."""

from __future__ import annotations

import asyncio

from aiohttp import web

from bench.load import generate

GROUP = 3
HOLD_S = 5.0  # a request waits this long at most for the rest of its group


async def test_a_group_is_sent_at_once_and_counted_as_one() -> None:
    """The server answers no request until GROUP have arrived: one worker gets answers only when
    each group's requests are in flight together."""
    arrived: list[bytes] = []
    held: list[asyncio.Future[None]] = []

    async def handle(request: web.Request) -> web.Response:
        arrived.append(await request.read())
        mine = asyncio.get_running_loop().create_future()
        held.append(mine)
        if len(held) == GROUP:
            for waiting in held:
                waiting.set_result(None)
            held.clear()
        await asyncio.wait_for(mine, HOLD_S)
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        bodies = [(url, str(seed).encode()) for seed in range(GROUP * 2)]
        latencies, errors, _ = await generate(bodies, 1, 0.2, HOLD_S * 2, together=GROUP)
    finally:
        await runner.cleanup()
    assert errors == 0
    assert latencies
    assert len(arrived) == GROUP * len(latencies)
    groups = [sorted(arrived[i : i + GROUP]) for i in range(0, len(arrived), GROUP)]
    starts = [GROUP * (turn % 2) for turn in range(len(groups))]  # the list, group by group
    assert groups == [[str(s).encode() for s in range(start, start + GROUP)] for start in starts]
