"""The per-request log line, built from the request's record (its fields are listed in
docs/operating.md#logs), and the JSON line every log record becomes; compiled, as every request
pays for them. The handler that writes them and the text format are ``proxy.observe.log``'s.
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from itertools import count
from typing import Any, Final

import orjson
from multidict import istr
from mypy_extensions import mypyc_attr

from proxy.core import X_REQUEST_ID
from proxy.observe.record import Observer, RequestRecord

# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_json_dumps: Final = orjson.dumps
_time: Final = time.time
_thread_id: Final = threading.get_ident
_running_loop: Final = asyncio.get_running_loop

logger: Final = logging.getLogger("n_proxy")
_INFO: Final = logging.INFO
Format = Callable[[float, str, str, dict[str, Any]], str]  # (created, level, message, fields)
# The name as multidict's own string: its lower case, for a lookup, is made once.
_TRACEPARENT: Final = istr("traceparent")


@mypyc_attr(allow_interpreted_subclasses=True)  # the tests' own
class Lines:
    """The lines of ``proxy.observe.log``'s handler, written in batches: one write per tick of
    the event loop, not one syscall per request. Compiled, as every request adds one: the
    handler's ``add`` and ``stream`` are this one's.

    A line waits at most one tick of the loop (``call_soon``); outside a loop it is written at
    once, so nothing is held back at start-up or shutdown.
    """

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self.stream = stream
        # The loop the last write was scheduled on, and its thread: asking asyncio for the
        # running loop is a getpid(2) on Python 3.11, one a request at concurrency 1.
        self._loop: Any = None
        self._in_thread = 0
        self._checked: object = None  # the stream last looked at, and whether it writes out
        self._through = False

    def add(self, line: str) -> None:
        lines = self.lines
        lines.append(line)
        if len(lines) > 1:
            return  # a write is already scheduled
        loop, thread = self._loop, _thread_id()
        # A loop running in this thread is the running loop: a thread runs one at a time.
        if loop is None or thread != self._in_thread or not loop.is_running():
            try:
                loop = _running_loop()
            except RuntimeError:
                self.write()
                return
            self._loop, self._in_thread = loop, thread
        loop.call_soon(self.write)

    def write(self) -> None:
        """The lines so far, in one write. Where that write reaches the file by itself (stderr's
        does, ``writes_out``), it is the whole of it: logging's flush, a lock taken for a stream
        flush that finds nothing to do, is left to the handler's ``flush`` (logging's shutdown
        calls it)."""
        lines = self.lines
        if lines:
            self.lines = []  # a line another thread adds from here waits for the next write
            stream = self.stream
            stream.write("\n".join(lines) + "\n")
            if stream is not self._checked:
                self._checked, self._through = stream, writes_out(stream)
            if not self._through:
                stream.flush()


def writes_out(stream: object) -> bool:
    """Whether a write of whole lines to ``stream`` reaches its file with no flush: a
    line-buffered text stream (stderr on a terminal), or one that writes through to an
    unbuffered file (stderr into a pipe or a file, from Python 3.9)."""
    if getattr(stream, "line_buffering", False):
        return True
    return getattr(stream, "write_through", False) is True and isinstance(
        getattr(stream, "buffer", None), io.FileIO
    )


class Direct:
    """The proxy's own handler and its format, set by ``proxy.observe.log.setup_logging``:
    while it is the logger's only handler, a request line is handed to it at once, without a
    ``LogRecord`` and its caller lookup."""

    def __init__(self, handler: Any, line: Format) -> None:
        self.handler = handler  # proxy.observe.log's _BatchingHandler
        self.lines: Lines = handler._lines  # where its lines wait for the loop's next tick
        self.line = line  # the format's line: json_line, or the text formatter's
        self.json = line is json_line

    def write(self, line: dict[str, Any]) -> None:
        """A request line: ``line`` is its JSON object, "ts", "level" and "msg" first (its "ts"
        is set here), as ``request_line`` makes it."""
        created = _time()
        if self.json:
            line["ts"] = _ts(created)
            # default: as json_line's
            self.lines.add(_json_dumps(line, default=str).decode())
        else:
            self.lines.add(self.line(created, "info", "request", _fields_of(line)))


_direct: Direct | None = None


def write_directly(direct: Direct | None) -> None:
    global _direct
    _direct = direct


def log_request(fields: dict[str, Any]) -> None:
    """A request line of ``fields`` (a request's are listed in docs/operating.md#logs)."""
    if logger.isEnabledFor(_INFO):
        _write({**_HEAD, **fields})


def _write(line: dict[str, Any]) -> None:
    direct = _direct
    handlers = logger.handlers
    if direct is not None and len(handlers) == 1 and direct.handler is handlers[0]:
        direct.write(line)
    else:
        logger.info("request", extra={"fields": _fields_of(line)})


def _fields_of(line: dict[str, Any]) -> dict[str, Any]:
    """A request line's fields: its object without "ts", "level" and "msg" (``_HEAD``)."""
    fields = line.copy()
    for name in _HEAD:
        del fields[name]
    return fields


def json_line(created: float, level: str, message: str, fields: dict[str, Any]) -> str:
    line: dict[str, Any] = {"ts": _ts(created), "level": level, "msg": message}
    line.update(fields)
    # default: an odd value in a library's fields must not lose the line
    return _json_dumps(line, default=str).decode()


class RequestLine(Observer):
    """The request's line at its end, from its record: ids, where it went, sizes, times, tokens
    (fields in the README, Operating)."""

    def ended(self, record: RequestRecord) -> None:
        if logger.isEnabledFor(_INFO):
            _write(request_line(record))


def _ts(created: float) -> float:
    """A JSON line's time: seconds to the millisecond, rounded with integers as ``ms``."""
    return math.floor(created * 1000 + 0.5) / 1000


# A request line's object, its names in their order: each line is a copy, its values then set
# (a dict of this size built from nothing is resized twice on the way). Its "ts" is the writer's.
_HEAD: Final[dict[str, Any]] = {"ts": 0.0, "level": "info", "msg": "request"}
_LINE: Final[dict[str, Any]] = {
    **_HEAD,
    **dict.fromkeys((
        "request_id", "trace_id", "client", "method", "path", "route", "model", "upstream",
        "replica", "n", "children", "children_aborted", "retries", "status", "bytes_in",
        "bytes_out", "duration_ms", "ttft_ms", "prompt_tokens", "completion_tokens",
    )),
}  # fmt: skip


def request_line(record: RequestRecord) -> dict[str, Any]:
    """The request's line as an object: "ts" (the writer's to set), "level" and "msg", then
    its fields."""
    usage = record.usage
    first_chunk = record.first_chunk
    headers = record.headers
    line = _LINE.copy()
    line["request_id"] = record.request_id or logged_id(headers)
    line["trace_id"] = record.trace_id or _incoming_trace_id(headers)
    line["client"] = record.client
    line["method"] = record.method
    line["path"] = record.path
    line["route"] = record.route
    line["model"] = record.model
    line["upstream"] = record.upstream
    line["replica"] = record.replicas()
    line["n"] = record.n
    line["children"] = len(record.children) if record.fanned_out else 0
    line["children_aborted"] = record.aborted
    line["retries"] = record.retries
    line["status"] = record.status
    line["bytes_in"] = record.bytes_in
    line["bytes_out"] = record.bytes_out
    line["duration_ms"] = ms(record.ended_at - record.started)
    line["ttft_ms"] = ms(first_chunk) if first_chunk is not None else None
    line["prompt_tokens"] = usage.get("prompt_tokens") if usage else None
    line["completion_tokens"] = usage.get("completion_tokens") if usage else None
    return line


def ms(seconds: float) -> float:
    """Milliseconds to the microsecond: ``round(seconds * 1000, 3)``, a half microsecond up, at
    a fraction of its cost (a float rounded to digits goes through its decimal string; compiled,
    ``math.floor`` is a C call, where ``round`` is the builtin looked up and called)."""
    return math.floor(seconds * 1e6 + 0.5) / 1000


# The line's request id when the client sent none: unique per process, cheap per request.
_ID_PREFIX: Final = os.urandom(6).hex() + "-"
_next_id: Final = count(1).__next__


def logged_id(headers: Mapping[str, str]) -> str:
    """The client's id, else one of the proxy's own (never sent upstream: a pass-through sends
    exactly the client's request)."""
    incoming = headers.get(X_REQUEST_ID)
    if incoming is not None:
        return incoming[:200]
    return _ID_PREFIX + str(_next_id())


def _incoming_trace_id(headers: Mapping[str, str]) -> str | None:
    """The client's W3C trace id, logged even with tracing off, for finding the request."""
    parent = headers.get(_TRACEPARENT)
    if parent is None or len(parent) < 55 or parent[2] != "-":
        return None
    return parent[3:35]
