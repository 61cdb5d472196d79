"""One log line per request, JSON for machines or text for people; never headers or bodies."""

from __future__ import annotations

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


def setup_logging(fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
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
