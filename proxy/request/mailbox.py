"""The hand-off from a fan-out stream's children to its one writer: a bounded ``Mailbox``, fed
from the upstream protocol as bytes arrive (``Mailbox.feeder``), so that backpressure reaches the
upstream, and a ``PingTimer`` that wakes the writer to send a keep-alive when nothing was
written for a while (docs/behaviour.md#keep-alive). Compiled with the rest of the stream path
(setup.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from proxy.core import RawEvent, SSEDecoder

# A child's events, a comment line it sent, a failure, or None: the child ended cleanly.
Item = list[RawEvent] | bytes | BaseException | None
PING = b": keep-alive\n\n"  # an SSE comment: load balancers see bytes, clients ignore it
MAX_COMMENT_BYTES = 1024  # a child's comment passed on as it is; a longer one as ``PING``


def _wake(future: asyncio.Future[None] | None) -> None:
    """Let the task parked on ``future`` run on; a future already done is left as it is."""
    if future is not None and not future.done():
        future.set_result(None)


class Mailbox:
    """A bounded hand-off from the child tasks to the one writer.

    Bounded so a slow client stalls the children's reads (backpressure reaches the upstream);
    ``cut`` wakes the writer at once, for a drain that has run out of time.
    """

    def __init__(self, size: int) -> None:
        # Made in the running loop: its waits make their futures on it without asking asyncio
        # again, a getpid(2) on Python 3.11 each time.
        self._loop = asyncio.get_running_loop()
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

    def feeder(self, pos: int, decoder: SSEDecoder) -> Callable[[bytes], bool]:
        """What child ``pos``'s upstream reads are fed to, as they arrive (no task hop per
        chunk): its events, or a comment line when a read holds no event, go in; returns
        ``full()``."""
        return Feeder(self, pos, decoder)

    def full(self) -> bool:
        """Over the bound: as ``put`` blocks, one item per child may wait without a pause."""
        return len(self._items) > self._size

    def put_nowait(self, item: tuple[int, Item]) -> bool:
        """Past the bound by at most one item per child: its reader pauses until ``room``,
        so a child behind a slow client still holds about one read in the proxy. Returns
        ``full()``."""
        items = self._items
        items.append(item)
        _wake(self._getter)
        return len(items) > self._size

    async def room(self) -> None:
        """Until the mailbox is back within its bound."""
        while self.full():
            await self._taken()

    async def _taken(self) -> None:
        """Until the writer next takes what is waiting."""
        putter = self._loop.create_future()
        self._putters.append(putter)
        try:
            await putter
        finally:
            if putter in self._putters:
                self._putters.remove(putter)

    async def take(self) -> list[tuple[int, Item]] | None:
        """Everything waiting (at least one item), [] once cut, None when woken by ``ping``."""
        if not self._items and self.cut_reason is None and not self._pinged:
            getter = self._getter = self._loop.create_future()
            await getter
        if self.cut_reason is not None:
            return []
        self._pinged = False
        if not self._items:
            return None
        items = list(self._items)
        self._items.clear()
        while self._putters:
            _wake(self._putters.popleft())
        return items

    def ping(self) -> None:
        """Wake the writer with nothing to take (its keep-alive is due)."""
        self._pinged = True
        _wake(self._getter)

    def cut(self, reason: str) -> None:
        self.cut_reason = reason
        _wake(self._getter)


class PingTimer:
    """Pings the mailbox after ``seconds`` with nothing written (0: never), and decides which of
    the children's own comments reach the client (docs/behaviour.md#keep-alive).

    One timer per stream, moved on lazily when it fires: a write costs a clock read, not a
    timer of its own. A child's comment passes when nothing was written since that child's
    previous one (or since the stream began): with every child pulsing at the server's
    interval and nothing else to send, the client gets one comment per interval, not one per
    child; once chunks flow, none.
    """

    def __init__(self, mailbox: Mailbox, seconds: float, children: int) -> None:
        self._mailbox = mailbox
        self._seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._written_at = self._loop.time()
        self._heard = [self._written_at] * children  # each child's previous comment
        self._timer: asyncio.TimerHandle | None = None
        if seconds:
            self._timer = self._loop.call_at(self._written_at + seconds, self._check)

    def wrote(self) -> None:
        self._written_at = self._loop.time()

    def heard(self, pos: int) -> bool:
        """Child ``pos`` sent a comment: True when the client should get one now, which the
        caller then writes (or chunks in its place); it counts as written at this moment."""
        now = self._loop.time()
        quiet = self._written_at <= self._heard[pos]
        self._heard[pos] = now
        if quiet:
            self._written_at = now  # the same instant: this child's next comment may pass too
        return quiet

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


class Feeder:
    """``Mailbox.feeder``'s: a class, not a closure, whose call reads its fields in place. A
    closure keeps them in an object of its own, one more cache line missed per read of 1,000
    streams (docs/performance.md, "What 1,000 streams miss")."""

    def __init__(self, mailbox: Mailbox, pos: int, decoder: SSEDecoder) -> None:
        self._decoder = decoder
        self._mailbox = mailbox
        self._pos = pos

    def __call__(self, data: bytes) -> bool:
        decoder = self._decoder
        events = decoder.feed_raw(data)
        if events:
            return self._mailbox.put_nowait((self._pos, events))
        if decoder.comment is not None:  # only a read with no event looks
            comment, decoder.comment = decoder.comment, None
            return self._mailbox.put_nowait((self._pos, comment))
        return self._mailbox.full()
