"""Tests for the admission line (proxy.upstream.slots): FIFO per-child admission under every
cancellation interleaving (docs/behaviour.md#admission).

The unit tests pin each interleaving that once leaked a slot; the property test cancels random
requests and children at random moments and checks that every slot comes back and that no
request that was left alone hangs.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config.models import Config
from proxy.core.errors import Overloaded
from proxy.server.app import GENERATIONS
from proxy.upstream.slots import Place, Slots
from tests.support.servers import Backend, Proxy, proxy_config, with_upstream

CLIENTS = 50


async def until(condition: Callable[[], bool]) -> None:
    """Poll a condition of the proxy's own state (it has no event to wait on), for up to 10 s."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in 10 s")


async def ticks(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def holder(place: Place, granted: list[int], mark: int, hold: asyncio.Event) -> None:
    async with place:
        granted.append(mark)
        await hold.wait()


async def test_children_are_granted_one_at_a_time_in_join_order() -> None:
    slots = Slots(2, max_queue=10)
    hold = asyncio.Event()
    granted: list[int] = []
    first, second = slots.join(3), slots.join(2)
    tasks = [
        asyncio.create_task(holder(p, granted, mark, hold)) for mark, p in enumerate(first + second)
    ]
    await ticks(3)
    assert (granted, slots.in_use, slots.queued) == ([0, 1], 2, 3)
    hold.set()
    await asyncio.gather(*tasks)
    assert granted == [0, 1, 2, 3, 4]
    assert (slots.in_use, slots.queued) == (0, 0)


async def test_a_cancelled_waiter_is_skipped_never_granted() -> None:
    slots = Slots(1, max_queue=10)
    (held,) = slots.join(1)
    b, c = slots.join(1)[0], slots.join(1)[0]
    granted: list[int] = []
    hold = asyncio.Event()
    waiting_b = asyncio.create_task(holder(b, granted, 1, hold))
    waiting_c = asyncio.create_task(holder(c, granted, 2, hold))
    await ticks(2)
    waiting_b.cancel()  # its handler has not run yet when the slot frees, in the same tick
    held.release()
    assert b.state == "gone"
    assert c.state == "held"
    assert slots.in_use == 1
    hold.set()
    await asyncio.gather(waiting_b, waiting_c, return_exceptions=True)
    assert granted == [2]
    assert (slots.in_use, slots.queued) == (0, 0)


async def test_a_grant_that_races_a_cancellation_is_handed_back() -> None:
    slots = Slots(1, max_queue=10)
    (held,) = slots.join(1)
    (b,) = slots.join(1)
    granted: list[int] = []
    waiting = asyncio.create_task(holder(b, granted, 1, asyncio.Event()))
    await ticks(2)
    held.release()  # granted: its future has a result, its task has not resumed
    assert b.state == "held"
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert granted == []
    assert (slots.in_use, slots.queued) == (0, 0)


async def test_a_place_whose_task_never_ran_is_given_back_by_its_request() -> None:
    slots = Slots(1, max_queue=10)
    places = slots.join(3)
    tasks = [asyncio.create_task(p.wait()) for p in places]
    for task in tasks:
        task.cancel()  # before any of them ran: their own handlers never run
    await asyncio.gather(*tasks, return_exceptions=True)
    assert (slots.in_use, slots.queued) == (1, 2)
    for place in places:
        place.release()
        place.release()  # a second release does nothing
    assert (slots.in_use, slots.queued) == (0, 0)


async def test_refused_only_on_arrival_when_the_queue_is_full() -> None:
    slots = Slots(2, max_queue=1)
    admitted = slots.join(5)  # two slots free: admitted, three children queue past max_queue
    assert (slots.in_use, slots.queued) == (2, 3)
    with pytest.raises(Overloaded):
        slots.join(1)
    for place in admitted:
        place.release()
    assert len(slots.join(1)) == 1


async def test_max_queue_zero_admits_while_a_slot_is_free() -> None:
    slots = Slots(1, max_queue=0)
    slots.join(2)
    with pytest.raises(Overloaded):
        slots.join(1)


async def test_audit_reports_a_free_slot_with_waiters_and_repair_grants_it() -> None:
    slots = Slots(1, max_queue=10)
    slots.join(1)
    (waiter,) = slots.join(1)
    now = asyncio.get_running_loop().time()
    assert slots.audit(now, patience=60) is None
    slots.in_use -= 1  # a leak in reverse: what a bug that forgot to wake would leave
    stall = slots.audit(now + 1, patience=60)
    assert stall is not None
    assert stall.reason == "a slot is free while children wait"
    slots.repair()
    assert waiter.state == "held"
    assert slots.audit(now + 1, patience=60) is None


async def test_audit_reports_a_waiter_that_more_frees_than_its_queue_did_not_grant() -> None:
    slots = Slots(1, max_queue=10)
    slots.join(1)
    (waiter,) = slots.join(1)
    slots.frees += 1  # a slot freed without granting: the old _wake bug's effect
    now = asyncio.get_running_loop().time()
    stall = slots.audit(now, patience=0)
    assert stall is not None
    assert "1 slots freed, 0 waiters ahead" in stall.reason
    assert waiter.state == "waiting"


async def test_audit_reports_a_head_waiter_that_saw_no_slot_freed_for_patience() -> None:
    slots = Slots(1, max_queue=10)
    slots.join(1)
    slots.join(1)
    now = asyncio.get_running_loop().time()
    assert slots.audit(now + 10, patience=60) is None
    stall = slots.audit(now + 61, patience=60)
    assert stall is not None
    assert stall.reason.startswith("no slot freed in")


# --- a reload resizes the line (docs/operating.md#reload) -----------------------------------


async def test_growing_the_line_grants_waiters_at_once() -> None:
    slots = Slots(1, max_queue=10)
    (held,) = slots.join(1)
    waiters = slots.join(3)
    slots.resize(3, max_queue=10)
    assert [p.state for p in waiters] == ["held", "held", "waiting"]
    assert (slots.in_use, slots.queued) == (3, 1)
    assert held.state == "held"


async def test_shrinking_the_line_keeps_held_slots_and_grants_none_until_below_the_new_limit() -> (
    None
):
    slots = Slots(3, max_queue=10)
    held = slots.join(3)
    (waiter,) = slots.join(1)
    slots.resize(1, max_queue=10)
    (late,) = slots.join(1)  # joins behind two slots owed past the new capacity, and the waiter
    now = asyncio.get_running_loop().time()
    for place in held:
        assert (waiter.state, late.state) == ("waiting", "waiting")
        assert slots.audit(now, patience=0) is None  # every wait explained: no stall reported
        place.release()
    assert (waiter.state, late.state) == ("held", "waiting")
    assert (slots.in_use, slots.queued) == (1, 1)
    assert slots.audit(now, patience=0) is None
    waiter.release()
    assert late.state == "held"
    late.release()
    assert (slots.in_use, slots.queued) == (0, 0)


async def test_a_smaller_max_queue_refuses_arrivals_and_keeps_the_queued() -> None:
    slots = Slots(1, max_queue=5)
    (held,) = slots.join(1)
    queued = slots.join(3)
    slots.resize(1, max_queue=1)
    assert [p.state for p in queued] == ["waiting"] * 3
    with pytest.raises(Overloaded):
        slots.join(1)
    held.release()
    assert queued[0].state == "held"


# --- the property: random cancellations at random moments ------------------------------------


async def run_scenario(seed: int, resizes: bool = False) -> None:
    """Requests joining, children and requests cancelled at random; with ``resizes``, the line
    also resized at random (a reload): no slot is granted past the capacity, though a shrink
    leaves the slots held above it, in use until they are freed (``bound``)."""
    rng = random.Random(seed)
    slots = Slots(rng.randint(1, 4), max_queue=10_000)
    bound = slots.capacity  # slots.in_use never exceeds it
    children: list[tuple[int, asyncio.Task[None]]] = []

    async def child(place: Place) -> None:
        async with place:
            assert slots.in_use <= bound
            await ticks(rng.randint(0, 3))

    async def request(j: int, count: int) -> None:
        # The shape of fanout.py: one task per child, every place released in a finally.
        places = slots.join(count)
        tasks = [asyncio.create_task(child(p)) for p in places]
        children.extend((j, t) for t in tasks)
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            try:
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:  # cancelled again right here: the places still go back
                for place in places:
                    place.release()

    requests = [
        asyncio.create_task(request(j, rng.randint(1, 6))) for j in range(rng.randint(1, 12))
    ]
    cancelled: set[int] = set()
    for _ in range(rng.randint(0, 40)):
        await ticks(rng.randint(0, 2))
        assert slots.audit(asyncio.get_running_loop().time(), patience=0) is None
        assert slots.in_use <= bound
        bound = max(slots.capacity, slots.in_use)  # held past a shrink: they only go down
        roll = rng.random()
        if resizes and roll < 0.15:
            slots.resize(rng.randint(1, 4), max_queue=10_000)
            bound = max(slots.capacity, slots.in_use)
        elif roll < 0.3:
            j = rng.randrange(len(requests))
            requests[j].cancel()
            cancelled.add(j)
        elif roll < 0.5 and children:
            j, task = rng.choice(children)
            if not task.done():
                task.cancel()  # a child alone: its request fails, its slot comes back
                cancelled.add(j)
    async with asyncio.timeout(30):  # no request hangs
        results = await asyncio.gather(*requests, return_exceptions=True)
    for j, result in enumerate(results):
        if j not in cancelled:
            assert result is None  # left alone: served in full
    assert (slots.in_use, slots.queued) == (0, 0)
    assert all(task.done() for _, task in children)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_random_cancellations_always_give_every_slot_back(seed: int) -> None:
    asyncio.run(run_scenario(seed))


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_random_resizes_never_grant_past_the_capacity_nor_report_a_stall(seed: int) -> None:
    asyncio.run(run_scenario(seed, resizes=True))


# --- over real loopback servers: a disconnect storm (it once leaked slots) -------------------


async def test_queued_n10_clients_leaving_at_once_give_every_slot_back(
    make_backend: Callable[..., Awaitable[Backend]],
    make_proxy: Callable[[Config], Awaitable[Proxy]],
) -> None:
    backend = await make_backend(token_delay=0.01)
    config = with_upstream(proxy_config(backend), max_concurrency=4, max_queue=10_000)
    proxy = await make_proxy(config)
    slots = proxy.app[GENERATIONS].upstreams.state(proxy.config.upstreams[0]).slots
    endless = {
        "model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True,
        "max_tokens": 10_000, "ignore_eos": True,
    }  # fmt: skip
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def post(n: int) -> None:
            async with http.post(proxy.url + "/v1/chat/completions", json={**endless, "n": n}):
                await asyncio.Event().wait()  # until cancelled: the client leaves

        holder = asyncio.create_task(post(4))
        await backend.state.wait_for(lambda s: len(s.active) == 4)
        queued = [asyncio.create_task(post(10)) for _ in range(CLIENTS)]
        await until(lambda: slots.queued == CLIENTS * 10)  # every child of every client waits
        for task in [holder, *queued]:
            task.cancel()  # every client at once, the slot holder too
        await asyncio.gather(holder, *queued, return_exceptions=True)
        await until(lambda: not slots.in_use and not slots.queued)
        assert slots.audit(asyncio.get_running_loop().time(), patience=0) is None

        body = {**endless, "n": 10, "max_tokens": 3, "stream": False}
        async with asyncio.timeout(30):
            async with http.post(proxy.url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                assert len((await response.json())["choices"]) == 10
    assert (slots.in_use, slots.queued) == (0, 0)


async def test_watchdog_logs_and_counts_a_stall_then_repairs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from proxy.config.models import single_upstream_config
    from proxy.observe.metrics import Metrics
    from proxy.upstream.service import Upstreams

    config = single_upstream_config("http://127.0.0.1:9")
    metrics = Metrics()
    pool = Upstreams(config, metrics)
    state = pool.state(config.upstreams[0])
    state.slots = Slots(1, max_queue=10)
    state.slots.join(1)
    (waiter,) = state.slots.join(1)
    state.slots.in_use -= 1  # what a lost wake-up would leave
    with caplog.at_level("WARNING", logger="n_proxy"):
        pool.audit(state, asyncio.get_running_loop().time())
    (record,) = [r for r in caplog.records if r.getMessage() == "slot watchdog"]
    assert record.fields["reason"] == "a slot is free while children wait"  # type: ignore[attr-defined]
    assert record.fields["upstream"] == "default"  # type: ignore[attr-defined]
    assert metrics.slot_stalls.labels("default")._value.get() == 1
    assert waiter.state == "held"
