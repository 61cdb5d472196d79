"""The hand-off between a fan-out's child tasks and its one stream writer: a bounded mailbox
(backpressure reaches the upstream) and the keep-alive ping that wakes the writer when nothing
was written for a while (docs/behaviour.md#keep-alive)."""

from __future__ import annotations

import asyncio
from collections import deque

from proxy.core.futures import wake
from proxy.core.sse import RawEvent

Item = list[RawEvent] | BaseException | None  # events, a failure, or None: the child ended cleanly
PING = b": keep-alive\n\n"  # an SSE comment: load balancers see bytes, clients ignore it


class Mailbox:
    """A bounded hand-off from the child tasks to the one writer.

    Bounded so a slow client stalls the children's reads (backpressure reaches the upstream);
    ``cut`` wakes the writer at once, for a drain that has run out of time.
    """

    def __init__(self, size: int) -> None:
        self._items: deque[tuple[int, Item]] = deque()
        self._size = size
        self._getter: asyncio.Future[None] | None = None
        self._putters: deque[asyncio.Future[None]] = deque()
        self.cut_reason: str | None = None
        self._pinged = False

    async def put(self, item: tuple[int, Item]) -> None:
        while len(self._items) >= self._size:
            await self._taken()
        self.put_nowait(item)

    def full(self) -> bool:
        """Over the bound: as ``put`` blocks, one item per child may wait without a pause."""
        return len(self._items) > self._size

    def put_nowait(self, item: tuple[int, Item]) -> None:
        """Past the bound by at most one item per child: its reader pauses until ``room``,
        so a child behind a slow client still holds about one read in the proxy."""
        self._items.append(item)
        wake(self._getter)

    async def room(self) -> None:
        """Until the mailbox is back within its bound."""
        while self.full():
            await self._taken()

    async def _taken(self) -> None:
        """Until the writer next takes what is waiting."""
        putter = asyncio.get_running_loop().create_future()
        self._putters.append(putter)
        try:
            await putter
        finally:
            if putter in self._putters:
                self._putters.remove(putter)

    async def take(self) -> list[tuple[int, Item]] | None:
        """Everything waiting (at least one item), [] once cut, None when woken by ``ping``."""
        if not self._items and self.cut_reason is None and not self._pinged:
            getter = self._getter = asyncio.get_running_loop().create_future()
            await getter
        if self.cut_reason is not None:
            return []
        self._pinged = False
        if not self._items:
            return None
        items = list(self._items)
        self._items.clear()
        while self._putters:
            wake(self._putters.popleft())
        return items

    def ping(self) -> None:
        """Wake the writer with nothing to take (its keep-alive is due)."""
        self._pinged = True
        wake(self._getter)

    def cut(self, reason: str) -> None:
        self.cut_reason = reason
        wake(self._getter)


class PingTimer:
    """Pings the mailbox after ``seconds`` with nothing written (0: never).

    One timer per stream, moved on lazily when it fires: a write costs a clock read, not a
    timer of its own.
    """

    def __init__(self, mailbox: Mailbox, seconds: float) -> None:
        self._mailbox = mailbox
        self._seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._written_at = self._loop.time()
        self._timer: asyncio.TimerHandle | None = None
        if seconds:
            self._timer = self._loop.call_at(self._written_at + seconds, self._check)

    def wrote(self) -> None:
        self._written_at = self._loop.time()

    def _check(self) -> None:
        now = self._loop.time()
        due = self._written_at + self._seconds
        if now >= due:
            self._mailbox.ping()
            due = now + self._seconds
        self._timer = self._loop.call_at(due, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
