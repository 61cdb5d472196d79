"""What the proxy logs, captured for a test: each record as text, and each request line's fields.

The per-request line is written as a handler ends, so waiting for it is how a test knows a
request is over. The proxy may log from another thread's loop (a rig on a thread), so the
capture is thread-safe and can be waited on from an event loop or from a plain thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

PROXY_LOGGER = "n_proxy"


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []  # every record, formatted, with its extra fields
        self.lines: list[dict[str, Any]] = []  # the fields of each per-request line
        # Every record as (level, message, fields): "warning", "replica ejected", {...}.
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self._condition = threading.Condition()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{logging.Formatter().format(record)} {record.__dict__!r}"
        fields = dict(getattr(record, "fields", {}))
        with self._condition:
            self.records.append(text)
            self.events.append((record.levelname.lower(), record.getMessage(), fields))
            if record.name != PROXY_LOGGER or record.getMessage() != "request":
                return
            self.lines.append(fields)
            self._condition.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    async def wait_for(self, count: int, within: float = 5.0) -> None:
        """Until ``count`` request lines were logged (TimeoutError after ``within`` seconds)."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(within):
            while len(self.lines) < count:
                waiter = (loop, asyncio.Event())
                with self._condition:
                    self._waiters.add(waiter)
                try:
                    if len(self.lines) < count:  # a line logged before the waiter was added
                        await waiter[1].wait()
                finally:
                    with self._condition:
                        self._waiters.discard(waiter)

    def levels(self, message: str) -> list[tuple[str, dict[str, Any]]]:
        """The level and fields of every record logged with ``message``, in order."""
        with self._condition:
            return [(level, fields) for level, said, fields in self.events if said == message]

    def wait_blocking(self, count: int, within: float = 20.0) -> bool:
        """``wait_for`` from a thread that runs no event loop; False when time ran out."""
        with self._condition:
            return self._condition.wait_for(lambda: len(self.lines) >= count, within)


@contextlib.contextmanager
def capture_logs(everything: bool = False) -> Iterator[LogCapture]:
    """The proxy's log from INFO up (its request lines included) into a ``LogCapture``; with
    ``everything``, DEBUG and up, and every other logger's records too."""
    capture = LogCapture()
    proxy_logger = logging.getLogger(PROXY_LOGGER)
    level, propagate = proxy_logger.level, proxy_logger.propagate
    proxy_logger.setLevel(logging.DEBUG if everything else logging.INFO)
    proxy_logger.addHandler(capture)
    root = logging.getLogger()
    if everything:
        # Heard on the root logger too: the proxy's records must not arrive twice.
        proxy_logger.propagate = False
        root.addHandler(capture)
    try:
        yield capture
    finally:
        root.removeHandler(capture)
        proxy_logger.removeHandler(capture)
        proxy_logger.setLevel(level)
        proxy_logger.propagate = propagate
