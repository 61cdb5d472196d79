"""Handing memory back to the OS after a large request: glibc keeps freed heap pages otherwise.

Python frees a large request's objects as soon as it ends, but glibc's malloc keeps the pages
(and, after a large free, raises its mmap threshold so the next large buffers come from the heap
too), so RSS would stay at the high-water mark. ``malloc_trim(0)`` shortly after a large request,
at most one pending at a time, returns them. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable

LARGE_BODY = 1 << 20  # request bytes
LARGE_FANOUT = 256  # children
_DELAY = 0.5  # seconds: lets the request's last objects go, and large requests coalesce


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # musl, macOS: no malloc_trim
    return trim


class Trimmer:
    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self._pending: asyncio.TimerHandle | None = None

    def request_ended(self, body_bytes: int, children: int) -> None:
        if self._trim is None or self._pending is not None:
            return
        if body_bytes < LARGE_BODY and children < LARGE_FANOUT:
            return
        self._pending = asyncio.get_running_loop().call_later(_DELAY, self._run)

    def _run(self) -> None:
        self._pending = None
        if self._trim is not None:
            self._trim(0)

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
