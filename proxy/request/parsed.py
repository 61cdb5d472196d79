"""What aiohttp parsed of a client's request, read where its request keeps it, and the status
of an answer; compiled, as every request reads them.

aiohttp's request gives its method, headers, version, URL and body stream through cached
properties: each read is a descriptor call and a dictionary lookup, and the first of each a
call of its own too (1.6 % of a pass-through's instructions in all). Its ``__init__`` sets
the attributes they return; these read them. One of the modules that use aiohttp's private
members (tests/meta/test_layers.py checks them).
"""

from __future__ import annotations

from typing import Any, Final, cast

from aiohttp import web
from aiohttp.http_writer import HttpVersion
from aiohttp.streams import EmptyStreamReader, StreamReader
from multidict import CIMultiDictProxy

# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_EMPTY: Final = EmptyStreamReader


def method_of(request: web.BaseRequest) -> str:
    """``request.method``: upper-case, as the client sent it."""
    return request._method


def headers_of(request: web.BaseRequest) -> CIMultiDictProxy[str]:
    """``request.headers``."""
    return request._headers


def path_of(request: web.BaseRequest) -> str:
    """``request.path``: the decoded path."""
    return request._rel_url.path


def path_qs_of(request: web.BaseRequest) -> str:
    """``request.rel_url.raw_path_qs``: the path and query as the client sent them."""
    return request._rel_url.raw_path_qs


def version_of(request: web.BaseRequest) -> HttpVersion:
    """``request.version``."""
    return request._version


def keeps_alive(request: web.BaseRequest) -> bool:
    """``request.keep_alive``: the client asked for no close, by its version or a header."""
    # Any: aiohttp types its message as a NamedTuple, and its C parser's is not a tuple, which
    # compiled code would check it for.
    return not cast(Any, request)._message.should_close


def content_of(request: web.BaseRequest) -> StreamReader:
    """``request.content``: the body's stream."""
    return request._payload


def body_as_it_lies(request: web.BaseRequest) -> bytes | None:
    """``request.content.read_nowait()`` of a body that came whole with its head, taken from its
    reader's buffer: the reader at its end, with no error, nobody waiting, nothing of it read
    yet, no chunk boundaries kept, and one piece under its low-water mark in its buffer (so the
    connection's reading, which such a body did not pause, has nothing to resume). None for any
    other body: read as aiohttp reads it. Six Python calls fewer a request."""
    content = request._payload
    if type(content) is _EMPTY:
        return b""
    buffer = content._buffer
    if (
        not content._eof
        or content._exception is not None
        or content._waiter is not None
        or content._buffer_offset
        or content._http_chunk_splits is not None
        or len(buffer) != 1
    ):
        return None
    data: bytes = buffer[0]
    size = len(data)
    if size >= content._low_water:
        return None
    buffer.clear()
    content._size -= size
    content._cursor += size
    return data


def status_of(response: web.StreamResponse) -> int:
    """``response.status``: a property, a Python call on Python 3.11."""
    return response._status


def has_body(request: web.BaseRequest) -> bool:
    """``request.body_exists``: a body is framed, by chunks (even none but the last) or by a
    length above zero."""
    return type(request._payload) is not _EMPTY
