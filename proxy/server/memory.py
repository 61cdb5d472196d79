"""Memory: handing it back to the OS after a large request, and when the cyclic collector runs.

Python frees a large request's objects as soon as it ends, but glibc's malloc keeps the pages
(and, after a large free, raises its mmap threshold so the next large buffers come from the heap
too), so RSS would stay at the high-water mark. ``malloc_trim(0)`` shortly after a large request,
at most one pending at a time, returns them. Elsewhere than glibc this does nothing. The trimmer
watches the ends of large requests only (``LargeRequest``): a request under both thresholds never
calls it.

The collector (``settle_collector``): a full collection stops the event loop for as long as it
takes to scan every object the process holds.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
from collections.abc import Callable

from proxy.observe import LargeRequest, RequestRecord

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

    def watch(self) -> LargeRequest:
        """What the record calls as a large request ends."""
        return LargeRequest(LARGE_BODY, LARGE_FANOUT, self.large_request_ended)

    def large_request_ended(self, record: RequestRecord) -> None:
        if self._trim is None or self._pending is not None:
            return
        self._pending = asyncio.get_running_loop().call_later(_DELAY, self._run)

    def _run(self) -> None:
        self._pending = None
        if self._trim is not None:
            self._trim(0)

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()


# CPython collects its youngest generation every 700 container objects allocated (net), and every
# tenth such collection collects the middle one too, moving what survives to the oldest; once a
# quarter as many as the oldest holds have moved there, it scans everything. Under a thousand
# streams, every middle collection moves the thousands of objects a chunk in flight holds at that
# instant, though they die a moment later: a full scan every few seconds, 30 to 100 ms each with
# the loop stopped (the manystream bench's 99th percentile was those pauses). Young collections
# ten times rarer move far fewer such objects to the oldest, and each still scans no more than
# YOUNG_THRESHOLD objects (a few milliseconds); reference cycles are still collected, a little
# later.
YOUNG_THRESHOLD = 10_000


def settle_collector() -> None:
    """Once the process is set up: what start-up made (modules, the app, the config) is collected
    once and frozen out of every later scan, and young collections are rarer."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
