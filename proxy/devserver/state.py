"""Live bookkeeping of the demo backend's generation requests, for tests to synchronise on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal

from aiohttp import web

Json = dict[str, Any]
Outcome = Literal["finished", "aborted", "faulted"]
HISTORY = 10_000  # past requests kept per list: enough for any test, flat for a long demo


class DevState:
    """Live bookkeeping of generation requests, for tests to synchronise on.

    Request ids are assumed unique among requests in flight at the same time. Each history
    list keeps the last HISTORY entries, so a long-running demo or benchmark stays flat.
    """

    def __init__(self) -> None:
        self.active: dict[str, Json] = {}
        self.peak = 0  # the most requests generating at once, since the server started
        self.finished: list[str] = []
        self.aborted: list[str] = []
        # Requests the server broke on purpose (x_demo faults), neither finished nor aborted.
        self.faulted: list[str] = []
        self.seen: list[tuple[str, Json, dict[str, str]]] = []
        self._outcomes = {
            "finished": self.finished,
            "aborted": self.aborted,
            "faulted": self.faulted,
        }
        # A fresh event per change: changes happen in sync code (even while a handler is being
        # cancelled), where an asyncio.Condition could not be notified without awaiting its lock.
        self._changed = asyncio.Event()

    def record(self, rid: str, body: Json, headers: dict[str, str]) -> None:
        self.seen.append((rid, body, headers))
        _trim(self.seen)
        self._notify()

    def begin(self, rid: str, body: Json) -> None:
        self.active[rid] = body
        self.peak = max(self.peak, len(self.active))
        self._notify()

    def end(self, rid: str, outcome: Outcome) -> None:
        """Move `rid` out of `active`; a no-op when it already ended."""
        if rid not in self.active:
            return
        del self.active[rid]
        history = self._outcomes[outcome]
        history.append(rid)
        _trim(history)
        self._notify()

    async def wait_for(self, predicate: Callable[[DevState], bool], timeout: float = 5.0) -> None:
        """Return once `predicate(self)` holds; raise TimeoutError after `timeout` seconds."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                await self._changed.wait()

    def snapshot(self) -> Json:
        return {"active": list(self.active), **self._outcomes}

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def _trim(history: list[Any]) -> None:
    if len(history) > 2 * HISTORY:
        del history[:-HISTORY]  # amortised: one cut per HISTORY appends


DEV_STATE = web.AppKey("dev_state", DevState)
