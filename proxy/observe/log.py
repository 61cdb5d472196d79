"""The proxy's log: one line per request and per event, JSON for machines or text for people;
never headers or bodies.

In JSON every line is one object, aiohttp's, asyncio's and warnings' included: a traceback is
folded into the line's ``exc`` field instead of spilling lines into the stream.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Literal

from proxy.observe.line import Direct, Lines, json_line, write_directly
from proxy.observe.line import log_request as log_request  # the request line's one entry
from proxy.observe.line import logger as logger  # the proxy's logger, named there once

LEVELS = ("debug", "info", "warning", "error")
Level = Literal["debug", "info", "warning", "error"]
_NUMBERS: dict[str, int] = {name: logging.getLevelName(name.upper()) for name in LEVELS}


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {})
        if record.name != logger.name:  # another library's line: say whose
            fields = {"logger": record.name, **fields}
        if record.exc_info:
            fields = {**fields, "exc": self.formatException(record.exc_info)}
        elif record.exc_text:
            fields = {**fields, "exc": record.exc_text}
        if record.stack_info:
            fields = {**fields, "stack": self.formatStack(record.stack_info)}
        return self.line(record.created, record.levelname.lower(), record.getMessage(), fields)

    def line(self, created: float, level: str, message: str, fields: dict[str, Any]) -> str:
        raise NotImplementedError


class _JsonFormatter(_Formatter):
    def line(self, created: float, level: str, message: str, fields: dict[str, Any]) -> str:
        return json_line(created, level, message, fields)


class _TextFormatter(_Formatter):
    """One line per record for people. A value a client chose (a path, a model, an id) can
    hold a line break or a space: it is quoted and escaped, so it cannot forge a line or a
    field (``_text``)."""

    def line(self, created: float, level: str, message: str, fields: dict[str, Any]) -> str:
        extra = " ".join(f"{k}={_text(v)}" for k, v in fields.items() if k != "exc")
        if "exc" in fields:  # for people: the traceback as Python prints it, indented under
            extra += "\n" + "\n".join("  " + _visible(line) for line in fields["exc"].split("\n"))
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
        return f"{stamp},{int(created % 1 * 1000):03d} {level} {_visible(message)} {extra}"


# Control characters (C0, DEL, C1) as escapes; U+2028 and the like take the slow path.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {
    ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t",
}  # fmt: skip
_QUOTED = _CONTROL | {ord('"'): '\\"', ord("\\"): "\\\\"}


def _visible(text: str) -> str:
    """``text`` on one line as it looks: every character that is not printable escaped."""
    return text if text.isprintable() else _escaped(text, _CONTROL)


def _text(value: object) -> str:
    """A field's value: bare when it is one printable word (numbers, ids, most paths), else
    in quotes with its quotes, backslashes and unprintable characters escaped."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable() and " " not in text and '"' not in text:
        return text
    return '"' + _escaped(text, _QUOTED) + '"'


def _escaped(text: str, table: dict[int, str]) -> str:
    text = text.translate(table)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text)


class _BatchingHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes lines in batches, one write per event-loop tick (``proxy.observe.line.Lines``,
    compiled): its stream is its lines' stream."""

    def __init__(self) -> None:
        self._lines = Lines(sys.stderr)
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return self._lines.stream

    @stream.setter
    def stream(self, stream: Any) -> None:
        self._lines.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.add(line)

    def add(self, line: str) -> None:
        self._lines.add(line)

    def flush(self) -> None:
        self._lines.write()
        super().flush()


def setup_logging(fmt: str, level: str = "info") -> None:
    """Our handler for the proxy's logger and for the root logger, so every library's records
    (aiohttp's, asyncio's, ``warnings``) come out in the same format; ``level`` for all."""
    handler = _BatchingHandler()
    formatter = _JsonFormatter() if fmt == "json" else _TextFormatter()
    handler.setFormatter(formatter)
    write_directly(Direct(handler, json_line if fmt == "json" else formatter.line))
    number = logging.getLevelName(level.upper())
    logger.handlers[:] = [handler]
    logger.setLevel(number)
    logger.propagate = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(number)
    logging.captureWarnings(True)


def log_enabled() -> bool:
    """Whether request lines are wanted (``--log-level`` info or debug)."""
    return logger.isEnabledFor(logging.INFO)


def log_event(message: str, level: Level = "info", /, **fields: Any) -> None:
    """One of the proxy's own events at ``level``: ``warning`` for what an operator should look
    at (a failed reload, a replica down or ejected), ``error`` for what stopped the proxy
    (docs/operating.md#logs)."""
    logger.log(_NUMBERS[level], message, extra={"fields": fields})


class Throttle:
    """At most ``per_second`` lines in each second of the clock; the first line let through
    after some were held back says how many (``admit``)."""

    def __init__(self, per_second: int) -> None:
        self.per_second = per_second
        self._second = -1
        self._used = 0
        self._held = 0

    def admit(self, now: float) -> int | None:
        """None: hold this line back. Otherwise write it, with the count held back before."""
        second = int(now)
        if second != self._second:
            self._second, self._used = second, 0
        if self._used >= self.per_second:
            self._held += 1
            return None
        self._used += 1
        held, self._held = self._held, 0
        return held
