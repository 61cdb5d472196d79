"""Tests for the admission line (proxy.upstream.slots): per-child admission, round-robin across
clients and first come first served within one, under every cancellation interleaving
(docs/behaviour.md#admission).

The unit tests pin each interleaving that once leaked a slot, and each step of the rotation; the
property tests drive random schedules against a model of the rotation, and cancel random
requests and children at random moments, checking that every slot and every client's count
comes back and that no request that was left alone hangs.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config.models import Config
from proxy.core.errors import Overloaded
from proxy.server.app import GENERATIONS
from proxy.upstream.slots import Place, Slots, Tabs
from tests.support.polling import until
from tests.support.servers import Backend, Proxy, proxy_config, with_upstream

CLIENTS = 50


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
    assert stall.reason == "1 slots freed while children waited granted none of them"
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


# --- the turns: a freed slot goes to each client in turn, the fewest held first ---------------


def states(places: list[Place]) -> str:
    """Each place as one letter: w(aiting), h(eld), g(one)."""
    return "".join(p.state[0] for p in places)


async def test_a_freed_slot_goes_to_each_waiting_client_in_turn_one_child_at_a_time() -> None:
    slots = Slots(1, max_queue=100)
    (first,) = slots.join(1, "x")
    a = slots.join(3, "a")
    b = slots.join(2, "b")
    c = slots.join(1, "c")
    order = [*a, *b, *c]
    granted: list[Place] = []
    holding = first
    while slots.queued:
        holding.release()
        (holding,) = [p for p in order if p.state == "held"]
        granted.append(holding)
    assert granted == [a[0], b[0], c[0], a[1], b[1], a[2]]
    holding.release()
    assert (slots.in_use, slots.queued) == (0, 0)


async def test_one_clients_children_are_granted_in_the_order_they_joined() -> None:
    slots = Slots(1, max_queue=100)
    (first,) = slots.join(1, "a")
    older, newer = slots.join(2, "a"), slots.join(2, "a")  # two requests of one client
    first.release()
    assert states(older + newer) == "hwww"
    older[0].release()
    assert states(older + newer) == "ghww"


async def test_a_new_client_waits_behind_those_already_waiting_not_behind_one_served_since() -> (
    None
):
    slots = Slots(1, max_queue=100)
    (first,) = slots.join(1, "x")
    a = slots.join(2, "a")
    (b,) = slots.join(1, "b")
    first.release()  # a's turn: a holds the slot
    (c,) = slots.join(1, "c")
    a[0].release()  # a holds none again: behind b and c, who were waiting by then
    assert (b.state, c.state, a[1].state) == ("held", "waiting", "waiting")
    b.release()
    assert (c.state, a[1].state) == ("held", "waiting")


async def test_a_freed_slot_goes_to_the_waiting_client_holding_the_fewest_slots() -> None:
    slots = Slots(4, max_queue=100)
    mine = slots.join(3, "a")  # a holds three slots
    (theirs,) = slots.join(1, "b")  # b one
    a_waits, b_waits = slots.join(1, "a"), slots.join(2, "b")  # a was waiting first...
    mine[0].release()
    assert (a_waits[0].state, states(b_waits)) == ("waiting", "hw")  # ...b holds fewer
    theirs.release()
    assert (a_waits[0].state, states(b_waits)) == ("waiting", "hh")  # still fewer: 2 against 2
    mine[1].release()
    assert (a_waits[0].state, states(b_waits)) == ("held", "hh")  # now a: 1 against 2


async def test_one_child_of_a_client_behind_a_flood_of_fan_outs_gets_the_next_free_slot() -> None:
    slots = Slots(4, max_queue=1000)
    flood = [place for _ in range(6) for place in slots.join(4, "flood")]  # 6 parents of n = 4
    (victim,) = slots.join(1, "victim")
    assert (slots.in_use, slots.queued) == (4, 21)
    flood[0].release()
    assert victim.state == "held"
    victim.release()
    (again,) = slots.join(1, "victim")  # its next request, right after: the next slot again
    flood[1].release()
    assert again.state == "held"


# --- a returning client's slot kept (return_grace) --------------------------------------------


def flood_and_victim(grace: float, max_queue: int = 1000) -> tuple[Slots, list[Place]]:
    """Max concurrency 4 held by a flood of fan-outs with 20 children waiting, and the slot a
    victim's child got from it just given back by that child: kept, when ``grace`` allows."""
    slots = Slots(4, max_queue, grace=grace)
    flood = [place for _ in range(6) for place in slots.join(4, "flood")]
    (victim,) = slots.join(1, "victim")
    flood[0].release()
    assert victim.state == "held"
    victim.release()
    return slots, flood


async def test_a_slot_given_back_holding_fewer_than_every_waiting_client_is_kept_for_its_next() -> (
    None
):
    slots, flood = flood_and_victim(grace=60)
    assert (slots.in_use, slots.kept, slots.queued) == (4, 1, 20)  # not the flood's
    (again,) = slots.join(1, "victim")  # its next request: the kept slot, at once
    assert again.state == "held"
    assert (slots.in_use, slots.kept, slots.queued) == (4, 0, 20)
    assert slots.audit(asyncio.get_running_loop().time(), patience=0) is None
    again.release()  # kept again: the flood still holds more
    assert slots.kept == 1
    for place in flood:
        place.release()  # nobody waits any more: nothing is kept against anyone
    assert (slots.in_use, slots.kept, slots.queued) == (0, 0, 0)


async def test_a_kept_slot_not_claimed_within_the_grace_goes_to_the_next_in_turn() -> None:
    slots, flood = flood_and_victim(grace=0.01)
    waiting = [p for p in flood if p.state == "waiting"]
    assert slots.kept == 1
    await until(lambda: slots.kept == 0)
    assert (slots.in_use, slots.queued, waiting[0].state) == (4, 19, "held")
    assert slots.audit(asyncio.get_running_loop().time(), patience=0) is None
    for place in flood:
        place.release()


async def test_no_slot_is_kept_for_a_client_holding_as_many_as_a_waiter_nor_when_none_waits() -> (
    None
):
    slots = Slots(2, max_queue=10, grace=60)
    (mine,) = slots.join(1, "a")
    (theirs,) = slots.join(1, "b")
    (b_waits,) = slots.join(1, "b")
    mine.release()  # a holds 0 and b, waiting, holds 1: kept for a
    assert (slots.kept, b_waits.state) == (1, "waiting")
    (mine,) = slots.join(1, "a")
    theirs.release()  # b has a child waiting: its own slot goes to it
    assert (slots.kept, b_waits.state) == (0, "held")
    mine.release()  # nobody waits: free
    assert (slots.in_use, slots.kept) == (1, 0)
    b_waits.release()
    fifo = Slots(1, max_queue=10, grace=60)
    (first,), (second,) = fifo.join(1), fifo.join(1)
    first.release()  # one line: its next waiter is its own
    assert (second.state, fifo.kept) == ("held", 0)
    second.release()


async def test_a_client_with_a_kept_slot_is_not_refused_when_the_queue_is_full() -> None:
    slots, flood = flood_and_victim(grace=60, max_queue=21)
    flood += slots.join(1, "flood")  # the queue is full
    with pytest.raises(Overloaded):
        slots.join(1, "another")
    (again,) = slots.join(1, "victim")
    assert again.state == "held"
    for place in [again, *flood]:
        place.release()
    assert (slots.in_use, slots.kept, slots.queued) == (0, 0, 0)


async def test_the_last_waiter_leaving_lets_the_kept_slot_go() -> None:
    slots, flood = flood_and_victim(grace=60)
    for place in [p for p in flood if p.state == "waiting"]:
        place.release()  # the flood's request cancelled: its waiters leave
    assert (slots.in_use, slots.kept, slots.queued) == (3, 0, 0)
    for place in flood:
        place.release()


async def test_the_shared_line_is_first_come_first_served_whoever_joins_it() -> None:
    """What ``admission: fifo`` does: every child in the one line, ``None``."""
    slots = Slots(4, max_queue=1000)
    flood = [place for _ in range(6) for place in slots.join(4, None)]
    (victim,) = slots.join(1, None)
    frees = 0
    while victim.state == "waiting":
        next(p for p in flood if p.state == "held").release()
        frees += 1
    assert frees == 21  # behind every queued child of the flood


async def test_a_client_whose_waiters_all_left_rejoins_at_the_back() -> None:
    slots = Slots(1, max_queue=100)
    (first,) = slots.join(1, "x")
    (a,) = slots.join(1, "a")
    (b,) = slots.join(1, "b")
    a.release()  # a's only waiter leaves: a is out of the rotation
    (again,) = slots.join(1, "a")
    first.release()
    assert (b.state, again.state) == ("held", "waiting")


# --- a tab: what a client holds, from admission until each place is released ---------------


async def test_a_tab_counts_a_clients_places_until_each_is_released_however() -> None:
    slots, other = Slots(1, max_queue=100), Slots(1, max_queue=100)
    tabs = Tabs()
    tab = tabs.tab("a")
    (held,) = slots.join(1, "a", tab)
    waiting = slots.join(2, "a", tab)
    (elsewhere,) = other.join(1, "a", tab)  # over every upstream
    assert (tab.places, tabs) == (4, {"a": tab})
    cancelled = asyncio.create_task(waiting[0].wait())
    await ticks(1)
    cancelled.cancel()
    await ticks(1)  # left the line: no longer counted
    assert tab.places == 3
    held.release()  # waiting[1] granted: still counted
    assert (tab.places, waiting[1].state) == (2, "held")
    waiting[1].release()
    elsewhere.release()
    elsewhere.release()  # a second release does nothing
    assert (tab.places, tabs, tabs.held()) == (0, {}, 0)


async def test_a_tab_is_listed_only_once_it_holds_a_place() -> None:
    slots = Slots(1, max_queue=0)
    tabs = Tabs()
    slots.join(1, "a", tabs.tab("a"))
    with pytest.raises(Overloaded):
        slots.join(1, "b", tabs.tab("b"))
    assert list(tabs) == ["a"]


# --- cancellation at each moment of a wait: the turn passes on, nothing is held ---------------

MOMENTS = ("before_it_ran", "while_waiting", "as_the_slot_frees", "granted_not_resumed", "holding")


@pytest.mark.parametrize("moment", MOMENTS)
async def test_a_child_cancelled_at_any_moment_never_runs_and_the_next_client_gets_the_slot(
    moment: str,
) -> None:
    slots = Slots(1, max_queue=10)
    tabs = Tabs()
    (held,) = slots.join(1, "h", tabs.tab("h"))
    (x,) = slots.join(1, "a", tabs.tab("a"))  # a's turn comes first
    (y,) = slots.join(1, "b", tabs.tab("b"))
    ran: list[str] = []
    hold = asyncio.Event()

    async def child(place: Place, name: str) -> None:
        async with place:
            ran.append(name)
            await hold.wait()

    task_x = asyncio.create_task(child(x, "x"))
    task_y = asyncio.create_task(child(y, "y"))
    if moment == "before_it_ran":
        task_x.cancel()  # before its first step: its own handler never runs
        await ticks(2)
        held.release()  # granted to a place nobody will use...
        x.release()  # ...until its request gives every place back (Tickets.release)
    elif moment == "while_waiting":
        await ticks(2)
        task_x.cancel()
        await ticks(2)  # its handler left the line
        held.release()
    elif moment == "as_the_slot_frees":
        await ticks(2)
        task_x.cancel()
        held.release()  # the same tick: its handler has not run, its turn is skipped
    elif moment == "granted_not_resumed":
        await ticks(2)
        held.release()
        assert x.state == "held"
        task_x.cancel()  # before it resumed: the grant is handed back
    else:
        await ticks(2)
        held.release()
        await ticks(2)
        assert ran == ["x"]
        task_x.cancel()
    await ticks(4)
    assert (x.state, y.state, slots.in_use, slots.queued) == ("gone", "held", 1, 0)
    assert ran == (["x", "y"] if moment == "holding" else ["y"])
    hold.set()
    await asyncio.gather(task_x, task_y, return_exceptions=True)
    assert (slots.in_use, slots.queued, tabs) == (0, 0, {})
    assert slots.audit(asyncio.get_running_loop().time(), patience=0) is None


async def test_every_waiter_of_the_client_in_turn_cancelled_as_a_slot_frees_skips_to_the_next() -> (
    None
):
    slots = Slots(1, max_queue=10)
    (held,) = slots.join(1, "h")
    mine = slots.join(3, "a")  # a's turn comes first
    (theirs,) = slots.join(1, "b")
    tasks = [asyncio.create_task(p.wait()) for p in [*mine, theirs]]
    await ticks(2)
    for task in tasks[:3]:
        task.cancel()
    held.release()
    assert (states(mine), theirs.state, slots.in_use) == ("ggg", "held", 1)
    await asyncio.gather(*tasks, return_exceptions=True)
    theirs.release()
    assert (slots.in_use, slots.queued) == (0, 0)


# --- the watchdog's rule for the turns ---------------------------------------------------------


async def test_audit_reports_a_client_holding_no_slot_not_served_within_its_turn_plus_one() -> None:
    slots = Slots(1, max_queue=10)
    (held,) = slots.join(1, "h")
    a = slots.join(2, "a")
    slots.join(1, "b")  # one client ahead of it: served within 2 slots freed
    slots.join(1, "c")
    now = asyncio.get_running_loop().time()
    held.release()  # a served, as its turn says
    assert slots.audit(now, patience=0) is None
    slots.frees += 1  # a second slot freed and granted out of turn: b's turn passed it by
    slots.grants += 1
    stall = slots.audit(now, patience=0)
    assert stall is not None
    assert stall.reason == "2 slots freed, 1 clients holding none ahead of it"
    assert (stall.in_use, stall.queued) == (1, 3)
    assert a[0].state == "held"


async def test_audit_reports_children_that_saw_no_slot_freed_for_patience_after_one_was() -> None:
    slots = Slots(1, max_queue=10)
    (held,) = slots.join(1, "a")
    slots.join(1, "a")
    slots.join(1, "b")
    joined = asyncio.get_running_loop().time()
    assert slots.audit(joined + 59, patience=60) is None
    stall = slots.audit(joined + 61, patience=60)
    assert stall is not None
    assert stall.reason.startswith("no slot freed in 6")
    held.release()  # one slot freed (to a): then none, while b waits
    freed = asyncio.get_running_loop().time()
    assert slots.audit(freed + 59, patience=60) is None
    stall = slots.audit(freed + 61, patience=60)
    assert stall is not None
    assert stall.reason == "no slot freed in 61 s"


async def test_audit_is_quiet_while_every_client_is_served_in_turn() -> None:
    slots = Slots(2, max_queue=100)
    places = [*slots.join(4, "a"), *slots.join(3, "b"), *slots.join(1, "c")]
    now = asyncio.get_running_loop().time()
    while slots.in_use:
        assert slots.audit(now, patience=0) is None
        next(p for p in places if p.state == "held").release()
    assert slots.audit(now, patience=0) is None


# --- the property: random cancellations at random moments ------------------------------------


def check_invariants(slots: Slots, tabs: Tabs, places: list[tuple[str, Place]]) -> None:
    """What holds between any two steps: ``in_use`` is the places held, ``queued`` the places
    waiting, no slot is free while a child waits, each client's tab counts its live places, and
    the watchdog finds nothing."""
    held = sum(p.state == "held" for _, p in places)
    waiting = sum(p.state == "waiting" for _, p in places)
    assert (slots.in_use, slots.queued) == (held + slots.kept, waiting)
    assert not waiting or slots.in_use >= slots.capacity  # above it: held past a shrink
    live: dict[str, int] = {}
    for client, place in places:
        if place.state != "gone":
            live[client] = live.get(client, 0) + 1
    assert {key: tab.places for key, tab in tabs.items()} == live
    assert slots.audit(asyncio.get_running_loop().time(), patience=0) is None


async def run_scenario(seed: int, resizes: bool = False, grace: float = 0.0) -> None:
    """Requests of several clients joining, children and requests cancelled at random; with
    ``resizes``, the line also resized at random (a reload): no slot is granted past the
    capacity, though a shrink leaves the slots held above it, in use until they are freed
    (``bound``). With ``grace``, slots are kept for the clients that give them back."""
    rng = random.Random(seed)
    slots = Slots(rng.randint(1, 4), max_queue=10_000, grace=grace)
    bound = slots.capacity  # slots.in_use never exceeds it
    tabs = Tabs()
    fifo = rng.random() < 0.25  # admission: fifo, every client in the shared line
    children: list[tuple[int, asyncio.Task[None]]] = []
    joined: list[tuple[str, Place]] = []

    async def child(place: Place) -> None:
        async with place:
            assert slots.in_use <= bound
            await ticks(rng.randint(0, 3))

    async def request(j: int, client: str, count: int) -> None:
        # The shape of fanout.py: one task per child, every place released in a finally.
        places = slots.join(count, None if fifo else client, tabs.tab(client))
        joined.extend((client, p) for p in places)
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

    clients = [f"c{k}" for k in range(rng.randint(1, 4))]
    requests = [
        asyncio.create_task(request(j, rng.choice(clients), rng.randint(1, 6)))
        for j in range(rng.randint(1, 12))
    ]
    cancelled: set[int] = set()
    for _ in range(rng.randint(0, 40)):
        await ticks(rng.randint(0, 2))
        check_invariants(slots, tabs, joined)
        assert slots.in_use <= bound
        bound = max(slots.capacity, slots.in_use)  # held past a shrink: they only go down
        roll = rng.random()
        if resizes and roll < 0.15:
            slots.resize(rng.randint(1, 4), max_queue=10_000, grace=grace)
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
    assert (slots.kept, slots.queued) == (0, 0)  # none kept once nobody waits
    assert (slots.in_use, slots.queued, tabs) == (0, 0, {})
    assert all(task.done() for _, task in children)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_random_cancellations_always_give_every_slot_back(seed: int) -> None:
    asyncio.run(run_scenario(seed))


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_random_resizes_never_grant_past_the_capacity_nor_report_a_stall(seed: int) -> None:
    asyncio.run(run_scenario(seed, resizes=True))


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32), st.sampled_from([0.0005, 0.005, 0.05]))
def test_random_schedules_with_kept_slots_give_every_slot_back(seed: int, grace: float) -> None:
    """Kept slots (``return_grace``) claimed, expiring or let go as the waiters leave, at any
    moment, through resizes: nothing held past the end, no stall, no request hung."""
    asyncio.run(run_scenario(seed, resizes=True, grace=grace))


# --- the property: random schedules against a model of the rotation ---------------------------


class Turns:
    """The rule as plainly as it can be written: each client's slots held and children waiting,
    and a stamp of when it took its turn (it started waiting, was served, or gave a slot back
    while waiting); a freed slot goes to the oldest child of the waiting client with the fewest
    slots held, the oldest stamp first among those."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: list[Place] = []
        self.holds: dict[str | None, int] = {}
        self.waiting: dict[str | None, list[Place]] = {}
        self.stamps: dict[str | None, int] = {}
        self.clock = itertools.count()
        self.owner: dict[int, str | None] = {}

    def joined(self, line: str | None, places: list[Place]) -> None:
        for place in places:
            self.owner[id(place)] = line
            if len(self.held) < self.capacity and not any(self.waiting.values()):
                self.grant(line, place)
                continue
            if not self.waiting.get(line):
                self.waiting[line] = []
                self.stamps[line] = next(self.clock)
            self.waiting[line].append(place)

    def grant(self, line: str | None, place: Place) -> None:
        self.held.append(place)
        self.holds[line] = self.holds.get(line, 0) + 1

    def released(self, place: Place) -> None:
        line = self.owner[id(place)]
        if place in self.held:
            self.held.remove(place)
            self.holds[line] -= 1
            if self.waiting.get(line):
                self.stamps[line] = next(self.clock)
            while len(self.held) < self.capacity and any(self.waiting.values()):
                waiting = [k for k, v in self.waiting.items() if v]
                turn = min(waiting, key=lambda k: (self.holds.get(k, 0), self.stamps[k]))
                self.grant(turn, self.waiting[turn].pop(0))
                self.stamps[turn] = next(self.clock)
        else:
            self.waiting[line].remove(place)


Step = tuple[str, int, int]  # ("join", client, count) or ("release", pick, 0)
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 3), st.integers(1, 5)),
        st.tuples(st.just("release"), st.integers(0, 1000), st.just(0)),
    ),
    max_size=60,
)


async def run_schedule(capacity: int, fifo: bool, steps: list[Step]) -> None:
    slots = Slots(capacity, max_queue=10_000)
    tabs = Tabs()
    model = Turns(capacity)
    places: list[tuple[str, Place]] = []
    for kind, a, b in steps:
        if kind == "join":
            client = f"c{a}"
            line = None if fifo else client
            joined = slots.join(b, line, tabs.tab(client))
            model.joined(line, joined)
            places += [(client, p) for p in joined]
        else:
            live = [p for _, p in places if p.state != "gone"]
            if not live:
                continue
            place = live[a % len(live)]  # a slot given back, or a waiter leaving
            place.release()
            model.released(place)
        assert {id(p) for _, p in places if p.state == "held"} == {id(p) for p in model.held}
        check_invariants(slots, tabs, places)
    for _, place in places:
        place.release()
    assert (slots.in_use, slots.queued, tabs) == (0, 0, {})


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.booleans(), STEPS)
def test_random_schedules_grant_exactly_as_the_turns_say(
    capacity: int, fifo: bool, steps: list[Step]
) -> None:
    asyncio.run(run_schedule(capacity, fifo, steps))


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
