"""``Requests``: the count a drain and a retiring generation wait on. Its event is touched only
while someone waits, so every order of entering, leaving, waiting and cancelling a wait is
tried here."""

from __future__ import annotations

import asyncio
import itertools

from proxy.request import Requests

WITHIN = 30.0  # seconds any one wait may take


async def test_a_wait_with_nothing_in_flight_returns_at_once() -> None:
    requests = Requests()
    async with asyncio.timeout(WITHIN):
        await requests.wait_idle()
    requests.enter()
    requests.leave()
    async with asyncio.timeout(WITHIN):
        await requests.wait_idle()


async def test_waits_end_with_the_last_request_not_before() -> None:
    requests = Requests()
    requests.enter()
    requests.enter()
    waits = [asyncio.create_task(requests.wait_idle()) for _ in range(3)]
    await asyncio.sleep(0)
    requests.leave()
    await asyncio.sleep(0)
    assert not any(w.done() for w in waits)
    requests.enter()  # another begins while they wait: still not idle
    requests.leave()
    await asyncio.sleep(0)
    assert not any(w.done() for w in waits)
    requests.leave()
    async with asyncio.timeout(WITHIN):
        await asyncio.gather(*waits)
    assert requests.requests == 0


async def test_a_request_that_begins_before_a_woken_wait_runs_keeps_it_waiting() -> None:
    requests = Requests()
    requests.enter()
    wait = asyncio.create_task(requests.wait_idle())
    await asyncio.sleep(0)
    requests.leave()  # the wait is woken...
    requests.enter()  # ...but a request begins before it runs
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not wait.done()
    requests.leave()
    async with asyncio.timeout(WITHIN):
        await wait


async def test_every_order_of_steps_with_a_wait_cancelled_on_the_way() -> None:
    """Three waits, one cancelled, and the leaving steps in every order among them: the
    others end exactly when the count is 0, and nothing is left counted as waiting."""
    steps = ["leave", "leave", "cancel", "sleep"]
    for order in set(itertools.permutations(steps)):
        requests = Requests()
        requests.enter()
        requests.enter()
        waits = [asyncio.create_task(requests.wait_idle()) for _ in range(3)]
        await asyncio.sleep(0)
        for step in order:
            if step == "leave":
                requests.leave()
            elif step == "cancel":
                waits[0].cancel()
            await asyncio.sleep(0)
        async with asyncio.timeout(WITHIN):
            await asyncio.gather(*waits[1:])
        assert waits[0].cancelled() or waits[0].done()
        assert requests.requests == 0
        assert requests._waiting == 0, order
