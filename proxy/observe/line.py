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
_REQUEST = b',"level":"info","msg":"request"'  # a request line's JSON after its ts
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

    def write(self, fields: dict[str, Any]) -> None:
        created = _time()
        if self.json:
            # json_line's object, spliced rather than merged into a copy of the fields: the
            # request line's names are its own, none of them "ts", "level" or "msg".
            head = b'{"ts":' + _json_dumps(_ts(created)) + _REQUEST
            body = _json_dumps(fields, default=str)  # default: as json_line's
            self.lines.add((head + (b"," + body[1:] if len(body) > 2 else b"}")).decode())
        else:
            self.lines.add(self.line(created, "info", "request", fields))


_direct: Direct | None = None


def write_directly(direct: Direct | None) -> None:
    global _direct
    _direct = direct


def log_request(fields: dict[str, Any]) -> None:
    """The per-request line (its fields are listed in docs/operating.md#logs)."""
    if logger.isEnabledFor(_INFO):
        _write(fields)


def _write(fields: dict[str, Any]) -> None:
    direct = _direct
    handlers = logger.handlers
    if direct is not None and len(handlers) == 1 and direct.handler is handlers[0]:
        direct.write(fields)
    else:
        logger.info("request", extra={"fields": fields})


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
            _write(request_fields(record))


def _ts(created: float) -> float:
    """A JSON line's time: seconds to the millisecond, rounded with integers as ``ms``."""
    return math.floor(created * 1000 + 0.5) / 1000


def request_fields(record: RequestRecord) -> dict[str, Any]:
    usage = record.usage
    first_chunk = record.first_chunk
    headers = record.headers
    return {
        "request_id": record.request_id or logged_id(headers),
        "trace_id": record.trace_id or _incoming_trace_id(headers),
        "client": record.client,
        "method": record.method,
        "path": record.path,
        "route": record.route,
        "model": record.model,
        "upstream": record.upstream,
        "replica": record.replicas(),
        "n": record.n,
        "children": len(record.children) if record.fanned_out else 0,
        "children_aborted": record.aborted,
        "retries": record.retries,
        "status": record.status,
        "bytes_in": record.bytes_in,
        "bytes_out": record.bytes_out,
        "duration_ms": ms(record.ended_at - record.started),
        "ttft_ms": ms(first_chunk) if first_chunk is not None else None,
        "prompt_tokens": usage.get("prompt_tokens") if usage else None,
        "completion_tokens": usage.get("completion_tokens") if usage else None,
    }  # fmt: skip


def ms(seconds: float) -> float:
    """Milliseconds to the microsecond: ``round(seconds * 1000, 3)``, a half microsecond up, at
    a fraction of its cost (a float rounded to digits goes through its decimal string; compiled,
    ``math.floor`` is a C call, where ``round`` is the builtin looked up and called)."""
    return math.floor(seconds * 1e6 + 0.5) / 1000


# The line's request id when the client sent none: unique per process, cheap per request.
_ID_FORMAT: Final = os.urandom(6).hex() + "-%x"  # one % a line: an f-string is two calls
_next_id: Final = count(1).__next__


def logged_id(headers: Mapping[str, str]) -> str:
    """The client's id, else one of the proxy's own (never sent upstream: a pass-through sends
    exactly the client's request)."""
    incoming = headers.get(X_REQUEST_ID)
    if incoming is not None:
        return incoming[:200]
    return _ID_FORMAT % _next_id()


def _incoming_trace_id(headers: Mapping[str, str]) -> str | None:
    """The client's W3C trace id, logged even with tracing off, for finding the request."""
    parent = headers.get(_TRACEPARENT)
    if parent is None or len(parent) < 55 or parent[2] != "-":
        return None
    return parent[3:35]
