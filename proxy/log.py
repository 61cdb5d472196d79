"""One log line per request, JSON for machines or text for people; never headers or bodies."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import orjson

logger = logging.getLogger("n_proxy")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
        }
        fields.update(getattr(record, "fields", {}))
        return orjson.dumps(fields).decode()


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        return f"{self.formatTime(record)} {record.levelname.lower()} {record.getMessage()} {extra}"


class _BatchingHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes lines in batches: one write per event-loop tick, not one syscall per request.

    A line waits at most one tick of the loop (``call_soon``); outside a loop it is written at
    once, so nothing is held back at start-up or shutdown.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self._lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record))
        except Exception:
            self.handleError(record)
            return
        if len(self._lines) > 1:
            return  # a flush is already scheduled
        try:
            asyncio.get_running_loop().call_soon(self.flush)
        except RuntimeError:
            self.flush()

    def flush(self) -> None:
        if self._lines:
            text = "\n".join(self._lines) + "\n"
            self._lines.clear()
            self.stream.write(text)
        super().flush()


def setup_logging(fmt: str) -> None:
    handler = _BatchingHandler()
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_request(**fields: Any) -> None:
    """The per-request line: ids, route, upstream, n, status, durations, children aborted."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("request", extra={"fields": fields})


def log_event(message: str, **fields: Any) -> None:
    logger.info(message, extra={"fields": fields})
