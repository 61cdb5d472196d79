"""The waits for response heads (``HeadClock``): each wait fails when it falls due and not
before, a wait that ended is never failed, and what the clock keeps stays bounded however long
one wait runs. Real responses on a real loop; the deadlines are short, the checks are of order
and of what failed, not of how late."""

from __future__ import annotations

import asyncio

import pytest

from proxy.http.errors import ResponseTimeout
from proxy.http.response import HeadClock, UpstreamResponse
from tests.http.test_chunks import connected

WITHIN = 30.0  # seconds any one wait of a test may take


async def _waiting(
    clock: HeadClock, first_byte: float
) -> tuple[UpstreamResponse, asyncio.Task[None]]:
    _, response = connected()
    task = asyncio.create_task(response.wait_head(first_byte, clock))
    await asyncio.sleep(0)  # its wait began
    return response, task


async def _settled(task: asyncio.Task[None]) -> None:
    async with asyncio.timeout(WITHIN):
        await task


async def test_each_wait_fails_when_due_and_a_wait_that_ended_never_does() -> None:
    clock = HeadClock(asyncio.get_running_loop())
    first, first_task = await _waiting(clock, 0.05)
    second, second_task = await _waiting(clock, 0.05)
    third, third_task = await _waiting(clock, 0.05)
    second.on_head(200, False)  # its head came: its wait is over
    await _settled(second_task)
    for task in (first_task, third_task):
        with pytest.raises(ResponseTimeout, match=r"within 0\.05 s"):
            await _settled(task)
    assert second.error is None
    assert isinstance(first.error, ResponseTimeout)
    assert isinstance(third.error, ResponseTimeout)


async def test_the_timer_moves_to_the_next_running_wait() -> None:
    """The line's timer is set at its first wait's deadline; when that wait ended before it,
    the next one is failed at its own deadline, not at the first's."""
    loop = asyncio.get_running_loop()
    clock = HeadClock(loop)
    early, early_task = await _waiting(clock, 0.2)
    await asyncio.sleep(0.1)
    late, late_task = await _waiting(clock, 0.2)
    began = loop.time()
    early.on_head(200, False)
    await _settled(early_task)
    with pytest.raises(ResponseTimeout):
        await _settled(late_task)
    assert loop.time() - began >= 0.2 - 0.01  # its own deadline (the loop's clock is in ms)
    assert early.error is None
    assert isinstance(late.error, ResponseTimeout)


async def test_each_first_byte_value_has_a_line_of_its_own() -> None:
    clock = HeadClock(asyncio.get_running_loop())
    slow, slow_task = await _waiting(clock, WITHIN * 10)
    quick, quick_task = await _waiting(clock, 0.05)
    with pytest.raises(ResponseTimeout):
        await _settled(quick_task)
    assert isinstance(quick.error, ResponseTimeout)
    assert slow.error is None
    assert not slow_task.done()
    slow_task.cancel()  # a request that went: its wait ends, nothing fails it later
    with pytest.raises(asyncio.CancelledError):
        await slow_task
    assert slow.error is None
    assert [line.running for line in clock._lines.values()] == [0, 0]


async def test_what_the_clock_keeps_is_bounded_behind_a_long_wait() -> None:
    """One wait runs long at the front of its line; thousands begin and end behind it. The
    line keeps a bounded number of ended waits, not one for each."""
    clock = HeadClock(asyncio.get_running_loop())
    long, long_task = await _waiting(clock, WITHIN * 10)
    for _ in range(5000):
        response, task = await _waiting(clock, WITHIN * 10)
        response.on_head(200, False)
        await task
    (line,) = clock._lines.values()
    assert line.running == 1
    assert len(line.waits) - line.first <= 4 * 64
    long.on_head(200, False)
    await long_task
    assert long.error is None
