"""What is worked out from a string a client or an upstream chose (a header's name, a
``Connection`` value, an API key), remembered for the next request that sends it: a dict lookup
where the work was. Pure; compiled, as every request asks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Remembered(Generic[T]):
    """``work(key)``, remembered by ``key`` as it came.

    Bounded, since the keys are someone else's to choose: at most ``most`` keys, each of at most
    ``longest`` characters (a longer one is worked out every time). Past ``most`` the memory
    starts again: keys sent only to fill it cost their work and no more, and never keep the
    usual ones out for good. Work that gives None is asked again each time.
    """

    __slots__ = ("_kept", "_longest", "_most", "_work")

    def __init__(self, work: Callable[[str], T], most: int, longest: int) -> None:
        self._work = work
        self._most = most
        self._longest = longest
        self._kept: dict[str, T] = {}

    def of(self, key: str) -> T:
        kept = self._kept.get(key)
        if kept is not None:
            return kept
        made = self._work(key)
        if len(key) <= self._longest:
            if len(self._kept) >= self._most:
                self._kept.clear()
            self._kept[key] = made
        return made

    def __len__(self) -> int:
        return len(self._kept)
