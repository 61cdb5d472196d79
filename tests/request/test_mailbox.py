"""The fan-out's hand-off: bounded, woken by a cut or a ping, every wait a cancellation point."""

from __future__ import annotations

import asyncio

from proxy.request.mailbox import Mailbox, PingTimer


async def test_put_blocks_past_the_bound_until_the_writer_takes() -> None:
    box = Mailbox(1)
    await box.put((0, None))
    second = asyncio.create_task(box.put((1, None)))
    await asyncio.sleep(0)
    assert not second.done()
    assert await box.take() == [(0, None)]
    await asyncio.wait_for(second, 10)
    assert await box.take() == [(1, None)]


async def test_cut_wakes_the_writer_with_nothing() -> None:
    box = Mailbox(4)
    taking = asyncio.create_task(box.take())
    await asyncio.sleep(0)
    box.cut("drain ran out of time")
    assert await asyncio.wait_for(taking, 10) == []
    assert box.cut_reason == "drain ran out of time"


async def test_ping_wakes_the_writer_with_none_then_items_flow_again() -> None:
    box = Mailbox(4)
    taking = asyncio.create_task(box.take())
    await asyncio.sleep(0)
    box.ping()
    assert await asyncio.wait_for(taking, 10) is None
    box.put_nowait((2, None))
    assert await box.take() == [(2, None)]


async def test_a_cancelled_putter_leaves_no_waiter_behind() -> None:
    box = Mailbox(1)
    box.put_nowait((0, None))
    blocked = asyncio.create_task(box.put((1, None)))
    await asyncio.sleep(0)
    blocked.cancel()
    await asyncio.gather(blocked, return_exceptions=True)
    assert box._putters == type(box._putters)()
    assert await box.take() == [(0, None)]


async def test_ping_timer_pings_only_after_the_quiet_period() -> None:
    box = Mailbox(4)
    timer = PingTimer(box, 0.05, 1)
    try:
        taking = asyncio.create_task(box.take())
        assert await asyncio.wait_for(taking, 10) is None  # nothing written: the ping came
    finally:
        timer.close()


async def test_ping_timer_off_never_pings() -> None:
    box = Mailbox(4)
    timer = PingTimer(box, 0, 1)
    try:
        taking = asyncio.create_task(box.take())
        done, _ = await asyncio.wait({taking}, timeout=0.1)
        assert not done
        taking.cancel()
        await asyncio.gather(taking, return_exceptions=True)
    finally:
        timer.close()


async def test_childrens_comments_pass_one_per_quiet_interval_and_none_once_chunks_flow() -> None:
    """Two children pulsing together give the client one comment per round, not two; a
    child's comment after a write since its previous one is dropped
    (docs/behaviour.md#keep-alive)."""
    timer = PingTimer(Mailbox(4), 0, 2)
    try:
        rounds = [(timer.heard(0), timer.heard(1)) for _ in range(3)]
        assert rounds == [(True, False), (True, False), (True, False)]
        timer.wrote()  # chunks went out
        assert (timer.heard(0), timer.heard(1)) == (False, False)
        assert (timer.heard(1), timer.heard(0)) == (True, False)  # quiet again: one passes
    finally:
        timer.close()
