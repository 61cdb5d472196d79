"""Waiting on a condition of the proxy's own state where it has no event to wait on: polled
every 10 ms, within a bound that is a limit on the wait, not a timing assertion."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
STEP = 0.01  # seconds between two looks


async def until(probe: Callable[[], T], within: float = 10.0, what: str = "condition") -> T:
    """``probe()``'s first true value, looked at until ``within`` seconds have passed; an
    ``AssertionError`` naming ``what`` if it never comes."""
    for _ in range(max(1, round(within / STEP))):
        value = probe()
        if value:
            return value
        await asyncio.sleep(STEP)
    raise AssertionError(f"{what} not reached in {within:g} s")
