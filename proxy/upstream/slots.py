"""Admission to an upstream's ``max_concurrency``: one slot per child, granted in turn across
clients, the client holding the fewest slots first, and first come first served within each
(docs/behaviour.md#admission); and each client's places over every upstream (``Tab``), which
``clients.max_children`` caps. Pure but for the futures its line parks on.

A request is refused (429) only on arrival, when every slot is taken and ``max_queue`` children
already wait; the children of an admitted request are never refused later. A waiter that is
cancelled at any moment is skipped, never granted, and a grant that races a cancellation is
handed back: ``in_use`` always equals the number of places held.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

from proxy.core import Overloaded

PlaceState = Literal["waiting", "held", "gone"]


class Tab:
    """What one client holds in every upstream's line: its children with a place, waiting or
    holding a slot, from admission until each place is released (``clients.max_children``
    caps it). Listed in its ``Tabs`` only while it holds one."""

    __slots__ = ("_tabs", "key", "places")

    def __init__(self, tabs: Tabs, key: str) -> None:
        self._tabs = tabs
        self.key = key
        self.places = 0

    def take(self, count: int) -> None:
        if not self.places:
            self._tabs[self.key] = self
        self.places += count

    def give(self) -> None:
        self.places -= 1
        if not self.places:
            del self._tabs[self.key]


class Tabs(dict[str, Tab]):
    """Every client that holds a place somewhere, by its id: as many as the lines' places."""

    def tab(self, key: str) -> Tab:
        """The client's tab; a new one is listed once it takes a place."""
        found = self.get(key)
        return Tab(self, key) if found is None else found

    def held(self) -> int:
        """Places counted against clients, over every upstream: 0 when idle."""
        return sum(tab.places for tab in self.values())


class Place:
    """One child's place in line: waiting for a slot, holding one, or gone (released)."""

    __slots__ = ("_future", "_line", "_slots", "queued_at", "state", "tab")

    def __init__(
        self, slots: Slots, state: PlaceState, line: _Line | None, tab: Tab | None, now: float
    ) -> None:
        self._slots = slots
        self._future: asyncio.Future[None] | None = None
        self._line = line  # its client's standing in this line; None once released
        self.tab = tab  # counted there until released
        self.state: PlaceState = state
        self.queued_at = now  # the loop's time it joined the queue; 0.0 when held at once

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


class _Line:
    """One client's standing in one upstream's line: the slots it holds there and its children
    waiting for one, first come first served among themselves. While it has children waiting it
    has a turn (``Slots._turns``); holding none, it is served within ``ahead + 1`` slots freed
    after ``frees_before`` (the watchdog's rule)."""

    __slots__ = ("ahead", "frees_before", "held", "keep", "key", "places", "waiting")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.held = 0  # slots it holds on this upstream
        self.waiting = 0  # live waiters
        self.places: deque[Place] = deque()  # its waiters; may also hold released ones, skipped
        self.ahead = 0  # lines holding no slot in front of it when it joined their turns
        self.frees_before = 0  # the slots' frees then
        # The slot kept for its next child (``Slots.grace``): the timer that gives it back.
        self.keep: asyncio.TimerHandle | None = None


@dataclass(frozen=True)
class Stall:
    """What the watchdog found: a waiter the queue in front of it does not explain."""

    reason: str
    waited: float  # seconds the oldest waiter has waited
    in_use: int
    queued: int


class Slots:
    """A semaphore counted in children, fair across clients: each client's children wait in a
    line of their own, and a freed slot goes to the waiting client holding the fewest of these
    slots, one child per turn; among clients holding as many, to the one that has waited for its
    turn longest (a client served goes to the back, a new one joins at the back). With one client
    (or every child in the shared line, ``None``) it is first come, first served."""

    def __init__(self, capacity: int, max_queue: int, grace: float = 0.0) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        # Seconds a slot a client gives back is kept for its next child, when it holds fewer
        # than every waiting client: a client that sends one request after another would be
        # first in turn as it comes back, but its slot would have gone to the flood meanwhile.
        self.grace = grace
        self.in_use = 0  # slots held, and kept (``grace``)
        self.kept = 0  # slots kept for a client's next child
        # Slots that came free below capacity so far: each one is owed to the next turn.
        self.frees = 0
        self.grants = 0  # waiters granted a slot so far
        self._owed = 0  # frees minus grants when the last wait began: each free since, a grant
        self._queued = 0  # live waiters, over every line
        self._quiet_since = 0.0  # the loop's time of the last slot freed, or of the first waiter
        self._lines: dict[Hashable, _Line] = {}  # every client holding or waiting for a slot
        # The lines with waiters, by the slots each holds, each in turn order (a dict keeps it).
        self._turns: dict[int, dict[_Line, None]] = {}

    @property
    def queued(self) -> int:
        return self._queued

    def join(self, count: int, line: Hashable = None, tab: Tab | None = None) -> list[Place]:
        """Places for ``count`` children, the first ones granted while slots are free and nobody
        waits, the others queued in order in ``line`` (the client's; None: the shared one);
        ``tab`` counts them until each is released.

        Raises ``Overloaded`` when no slot is free and ``max_queue`` children already wait.
        """
        standing = self._lines.get(line)
        kept = standing is not None and standing.keep is not None
        if self.in_use >= self.capacity and self._queued >= self.max_queue and not kept:
            raise Overloaded("upstream is at its concurrency limit; retry shortly", retry_after=1)
        now = 0.0  # the loop's time, read once a child must wait: a place held at once needs none
        if standing is None:
            standing = self._lines[line] = _Line(line)
        places = []
        for _ in range(count):
            if standing.keep is not None:  # its kept slot: held at once, counted in use already
                standing.keep.cancel()
                standing.keep = None
                self.kept -= 1
                standing.held += 1
                places.append(Place(self, "held", standing, tab, now))
                continue
            if self.in_use < self.capacity and not self._queued:
                self.in_use += 1
                standing.held += 1
                places.append(Place(self, "held", standing, tab, now))
                continue
            if not now:
                now = asyncio.get_running_loop().time()  # on Python 3.11, a getpid(2)
            if not self._queued:
                self._quiet_since = now
                self._owed = self.frees - self.grants
            if not standing.waiting:
                self._take_turn(standing)
            place = Place(self, "waiting", standing, tab, now)
            standing.places.append(place)
            standing.waiting += 1
            self._queued += 1
            places.append(place)
        if tab is not None:
            tab.take(count)
        return places

    def resize(self, capacity: int, max_queue: int, grace: float = 0.0) -> None:
        """A reload's new ``max_concurrency`` and ``max_queue`` (docs/operating.md#reload).
        Growing grants waiters at once, in turn. Shrinking takes no slot back: children admitted
        keep theirs, and no waiter is granted until fewer than ``capacity`` are held (a slot
        given back above the capacity is no free slot, so the turns' bound counts none of
        those). Children queued past a smaller ``max_queue`` stay in line: only arrivals are
        refused."""
        self.capacity = capacity
        self.max_queue = max_queue
        self.grace = grace
        grants = self.grants
        self._wake()
        self._owed -= self.grants - grants  # granted with no slot freed: none of them was lost

    def _take_turn(self, line: _Line) -> None:
        """``line`` at the back of the turns of those holding as many slots as it does."""
        turns = self._turns.get(line.held)
        if turns is None:
            turns = self._turns[line.held] = {}
        if not line.held:
            line.ahead, line.frees_before = len(turns), self.frees
        turns[line] = None

    def _leave_turn(self, line: _Line) -> None:
        turns = self._turns[line.held]
        del turns[line]
        if not turns:
            del self._turns[line.held]

    def _release(self, place: Place) -> None:
        line = place._line
        if place.state == "held":
            self._gone(place)
            assert line is not None
            if line.waiting:  # it holds one fewer: its turn comes sooner
                self._leave_turn(line)
                line.held -= 1
                self._take_turn(line)
            else:
                line.held -= 1
                if self.grace and self._turns and self._keeps(line):
                    self._keep(line)
                    return
                self._forget(line)
            self._free()
        elif place.state == "waiting":
            self._leave(place)
            future = place._future
            if future is not None and not future.done():
                future.cancel()

    def _free(self) -> None:
        """One slot back: a free one, granted to the next in turn, when below the capacity."""
        self.in_use -= 1
        if self.in_use < self.capacity:
            self.frees += 1
            if self._queued:
                self._quiet_since = asyncio.get_running_loop().time()
                self._wake()

    def _keeps(self, line: _Line) -> bool:
        """Whether the slot ``line`` gives back is kept for it: it has nothing waiting and holds
        fewer slots than every client that waits, so its next child, coming within ``grace``,
        would have been first in turn; and the slot would be a free one."""
        return (
            self.grace > 0
            and line.keep is None
            and not line.waiting
            and bool(self._turns)
            and min(self._turns) > line.held
            and self.in_use <= self.capacity
        )

    def _keep(self, line: _Line) -> None:
        self.kept += 1
        line.keep = asyncio.get_running_loop().call_later(self.grace, self._expire, line)

    def _expire(self, line: _Line) -> None:
        """Its client did not come back within ``grace``: the slot goes to the next in turn."""
        if line.keep is None:
            return
        line.keep.cancel()
        line.keep = None
        self.kept -= 1
        self._forget(line)
        self._free()

    def _let_go(self) -> None:
        """Nobody waits any more: no slot is kept against anyone."""
        for line in [line for line in self._lines.values() if line.keep is not None]:
            self._expire(line)

    def _gone(self, place: Place) -> None:
        place.state = "gone"
        place._line = None
        tab = place.tab
        if tab is not None:
            tab.give()

    def _forget(self, line: _Line) -> None:
        """A client neither holding nor waiting for a slot here is no longer kept."""
        if not line.held and not line.waiting and line.keep is None:
            del self._lines[line.key]

    def _leave(self, place: Place) -> None:
        """A waiter out of its line, without a slot."""
        line = place._line
        assert line is not None
        self._gone(place)
        self._queued -= 1
        line.waiting -= 1
        if not line.waiting:
            self._leave_turn(line)
            line.places.clear()
            self._forget(line)
            if self.kept and not self._turns:
                self._let_go()
        elif len(line.places) > 2 * line.waiting + 64:
            line.places = deque(p for p in line.places if p.state == "waiting")

    def _wake(self) -> None:
        while self._turns and self.in_use < self.capacity:
            line = next(iter(self._turns[min(self._turns)]))
            place = self._first(line)
            if place is None:
                continue  # every waiter of it left: out of the turns
            self._leave_turn(line)
            self._queued -= 1
            line.waiting -= 1
            line.held += 1
            if line.waiting:
                self._take_turn(line)  # one child per turn: to the back of its new turns
            place.state = "held"
            self.in_use += 1
            self.grants += 1
            if place._future is not None:
                place._future.set_result(None)
        if self.kept and not self._turns:
            self._let_go()

    def _first(self, line: _Line) -> Place | None:
        """The line's first live waiter, taken out of it; None when it has none left."""
        while line.waiting:  # every live waiter is in its line's deque
            place = line.places.popleft()
            if place.state != "waiting":
                continue  # released while it waited: skipped, never granted
            future = place._future
            if future is not None and future.cancelled():
                # Its task was cancelled but has not run its handler yet: that handler's
                # release finds the place gone.
                self._leave(place)
                continue
            return place
        return None

    def audit(self, now: float, patience: float) -> Stall | None:
        """The watchdog's check (``proxy.upstream.service``); None while the turns explain every
        wait.

        Every slot freed while children wait grants one; a client holding no slot, with
        ``ahead`` such clients in front of it when it joined their turns, must be served by the
        ``ahead + 1``-th slot freed after that (nobody can come before those: no client holds
        fewer); a free slot with waiters is a stall too. ``patience``: also report children that
        waited that long with no slot freed.
        """
        lines = [line for turns in self._turns.values() for line in turns]
        if not lines:
            return None
        oldest = min(p.queued_at for line in lines for p in line.places if p.state == "waiting")
        late = [
            line for line in self._turns.get(0, ()) if self.frees - line.frees_before > line.ahead
        ]
        quiet = now - self._quiet_since
        lost = self.frees - self.grants - self._owed
        if self.in_use < self.capacity:
            reason = "a slot is free while children wait"
        elif lost > 0:
            reason = f"{lost} slots freed while children waited granted none of them"
        elif late:
            freed = self.frees - late[0].frees_before
            reason = f"{freed} slots freed, {late[0].ahead} clients holding none ahead of it"
        elif patience and quiet >= patience:
            reason = f"no slot freed in {quiet:.0f} s"
        else:
            return None
        return Stall(reason, now - oldest, self.in_use, self._queued)

    def repair(self) -> None:
        """Grant what a free slot allows (the watchdog's remedy for the first kind of stall)."""
        self._wake()
        self._owed = self.frees - self.grants  # what was lost is reported once
