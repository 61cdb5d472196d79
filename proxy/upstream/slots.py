"""Admission to an upstream's ``max_concurrency``: one slot per child, granted FIFO
(docs/behaviour.md#admission). Pure but for the futures its line parks on.

A request is refused (429) only on arrival, when every slot is taken and ``max_queue`` children
already wait; the children of an admitted request are never refused later. A waiter that is
cancelled at any moment is skipped, never granted, and a grant that races a cancellation is
handed back: ``in_use`` always equals the number of places held.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

from proxy.core import Overloaded

PlaceState = Literal["waiting", "held", "gone"]


class Place:
    """One child's place in line: waiting for a slot, holding one, or gone (released)."""

    __slots__ = ("_future", "_slots", "ahead", "frees_before", "queued_at", "state")

    def __init__(self, slots: Slots, state: PlaceState, ahead: int, frees_before: int) -> None:
        self._slots = slots
        self._future: asyncio.Future[None] | None = None
        self.state: PlaceState = state
        # Slots to be freed before its turn, less one, when it joined the queue: the live waiters
        # in front of it, and the slots held past the capacity (a reload lowered it).
        self.ahead = ahead
        self.frees_before = frees_before  # the slots' free count when it joined
        self.queued_at = asyncio.get_running_loop().time()

    async def wait(self) -> None:
        """Until the slot is granted; on cancellation the place is released, whatever happened."""
        if self.state == "held":
            return
        if self.state == "gone":
            raise RuntimeError("this place was released")
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
        try:
            await self._future
        except BaseException:
            self.release()  # a grant that raced the cancellation goes back too
            raise

    def release(self) -> None:
        """Give the slot back, or leave the queue; a second call does nothing."""
        self._slots._release(self)

    async def __aenter__(self) -> Place:
        await self.wait()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


@dataclass(frozen=True)
class Stall:
    """What the watchdog found: a waiter the queue in front of it does not explain."""

    reason: str
    waited: float  # seconds the oldest waiter has waited
    in_use: int
    queued: int


class Slots:
    """A FIFO semaphore counted in children."""

    def __init__(self, capacity: int, max_queue: int) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        self.in_use = 0
        self.frees = 0  # slots given back so far: each one grants the oldest live waiter
        self._queued = 0  # live waiters; the deque may also hold released ones, skipped lazily
        self._line: deque[Place] = deque()

    @property
    def queued(self) -> int:
        return self._queued

    def join(self, count: int) -> list[Place]:
        """Places for ``count`` children in FIFO order, the first ones granted while slots are free.

        Raises ``Overloaded`` when no slot is free and ``max_queue`` children already wait.
        """
        if self.in_use >= self.capacity and self._queued >= self.max_queue:
            raise Overloaded("upstream is at its concurrency limit; retry shortly", retry_after=1)
        places = []
        for _ in range(count):
            if self.in_use < self.capacity and not self._queued:
                self.in_use += 1
                places.append(Place(self, "held", 0, self.frees))
            else:
                place = Place(self, "waiting", self._queued + self._owed(), self.frees)
                self._line.append(place)
                self._queued += 1
                places.append(place)
        return places

    def resize(self, capacity: int, max_queue: int) -> None:
        """A reload's new ``max_concurrency`` and ``max_queue`` (docs/operating.md#reload).
        Growing grants waiters at once. Shrinking takes no slot back: children admitted keep
        theirs, and no waiter is granted until fewer than ``capacity`` are held. Children queued
        past a smaller ``max_queue`` stay in line: only arrivals are refused."""
        owed = self._owed()
        self.capacity = capacity
        self.max_queue = max_queue
        more = self._owed() - owed
        if more > 0:  # each waiter now waits for that many more slots to be freed (``audit``)
            for place in self._line:
                place.ahead += more
        self._wake()

    def _owed(self) -> int:
        """Slots held past the capacity (a reload lowered it): freed before any waiter's turn."""
        return max(0, self.in_use - self.capacity)

    def _release(self, place: Place) -> None:
        if place.state == "held":
            place.state = "gone"
            self.in_use -= 1
            self.frees += 1
            self._wake()
        elif place.state == "waiting":
            place.state = "gone"
            self._queued -= 1
            future = place._future
            if future is not None and not future.done():
                future.cancel()
            if len(self._line) > 2 * self._queued + 64:
                self._line = deque(p for p in self._line if p.state == "waiting")

    def _wake(self) -> None:
        while self._line and self.in_use < self.capacity:
            place = self._line.popleft()
            if place.state != "waiting":
                continue  # released while it waited: skipped, never granted
            future = place._future
            if future is not None and future.cancelled():
                # Its task was cancelled but has not run its handler yet: that handler's
                # release finds the place gone.
                place.state = "gone"
                self._queued -= 1
                continue
            place.state = "held"
            self._queued -= 1
            self.in_use += 1
            if future is not None:
                future.set_result(None)

    def audit(self, now: float, patience: float) -> Stall | None:
        """The watchdog's check (``proxy.upstream.service``); None while the queue explains every
        wait.

        A waiter with ``ahead`` live waiters (and slots owed past the capacity) in front of it
        must be granted by the ``ahead + 1``-th slot freed after it joined; a free slot with
        waiters is a stall too.
        ``patience``: also report a head waiter that waited that long with no slot freed.
        """
        head = next((p for p in self._line if p.state == "waiting"), None)
        if head is None:
            return None
        waited = now - head.queued_at
        if self.in_use < self.capacity:
            reason = "a slot is free while children wait"
        elif self.frees - head.frees_before > head.ahead:
            reason = f"{self.frees - head.frees_before} slots freed, {head.ahead} waiters ahead"
        elif patience and waited >= patience and self.frees == head.frees_before:
            reason = f"no slot freed in {waited:.0f} s"
        else:
            return None
        return Stall(reason, waited, self.in_use, self._queued)

    def repair(self) -> None:
        """Grant what a free slot allows (the watchdog's remedy for the first kind of stall)."""
        self._wake()
