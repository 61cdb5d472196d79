"""One log line per request, JSON for machines or text for people; never headers or bodies."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import orjson

logger = logging.getLogger("n_proxy")


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        return self.line(record.created, record.levelname.lower(), record.getMessage(), fields)

    def line(self, created: float, level: str, message: str, fields: dict[str, Any]) -> str:
        raise NotImplementedError


class _JsonFormatter(_Formatter):
    def line(self, created: float, level: str, message: str, fields: dict[str, Any]) -> str:
        return orjson.dumps(
            {"ts": round(created, 3), "level": level, "msg": message, **fields}
        ).decode()


class _TextFormatter(_Formatter):
    def line(self, created: float, level: str, message: str, fields: dict[str, Any]) -> str:
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
        return f"{stamp},{int(created % 1 * 1000):03d} {level} {message} {extra}"


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
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.add(line)

    def add(self, line: str) -> None:
        self._lines.append(line)
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


_direct: tuple[_BatchingHandler, _Formatter] | None = None


def setup_logging(fmt: str) -> None:
    global _direct
    handler = _BatchingHandler()
    formatter = _JsonFormatter() if fmt == "json" else _TextFormatter()
    handler.setFormatter(formatter)
    _direct = (handler, formatter)
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_request(**fields: Any) -> None:
    """The per-request line: ids, route, upstream, n, status, durations, children aborted."""
    if not logger.isEnabledFor(logging.INFO):
        return
    direct = _direct
    handlers = logger.handlers
    if direct is not None and len(handlers) == 1 and handlers[0] is direct[0]:
        # Our own handler alone: the line straight to it, without a LogRecord and its
        # caller lookup (a third of the proxy's own Python time per pass-through request).
        handler, formatter = direct
        handler.add(formatter.line(time.time(), "info", "request", fields))
    else:
        logger.info("request", extra={"fields": fields})


def log_event(message: str, **fields: Any) -> None:
    logger.info(message, extra={"fields": fields})
