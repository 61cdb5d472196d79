"""Settling the one-shot futures that tasks park on while a protocol callback feeds them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio


def wake(future: asyncio.Future[None] | None) -> None:
    """Let whoever waits on ``future`` run on; a future already done is left as it is."""
    if future is not None and not future.done():
        future.set_result(None)


def settle(future: asyncio.Future[None], exc: BaseException | None = None) -> None:
    """``wake``, or fail the waiter with ``exc``, marked retrieved: the waiter may be gone."""
    if not future.done():
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)
            future.exception()
