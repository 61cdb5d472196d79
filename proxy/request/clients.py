"""Who sent a request: the client id that fair admission and ``clients.max_children`` count by
(docs/operating.md#clients), made once per request from its headers or its peer.
"""

from __future__ import annotations

import hashlib
import os
from typing import Final

from aiohttp import hdrs, web

from proxy.config import Clients
from proxy.core import Remembered
from proxy.request.parsed import headers_of

# Made at start, never written anywhere: an id is stable within this process only, and neither
# it nor a log line holding it gives back the key it was made from.
_KEY = os.urandom(32)
# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_AUTHORIZATION: Final = hdrs.AUTHORIZATION


def _keyed(value: str) -> str:
    """16 hex digits of a keyed BLAKE2b of ``value`` (a MAC in itself, as HMAC-SHA256 would be,
    at a third of its cost per request)."""
    data = value.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, key=_KEY, digest_size=8).hexdigest()


# A client sends the same key request after request, and its hash was 3,800 instructions of a
# pass-through: remembered, 256 keys of up to 2 KiB at most (a JWT fits). The keys stay in this
# process's memory, as the requests that carried them were; nothing writes them anywhere.
_ids: Final = Remembered(_keyed, 256, 2048)


def keyed_id(value: str) -> str:
    """``value``'s keyed hash (``_keyed``), remembered."""
    return _ids.of(value)


class ClientIds:
    """The config's way of telling clients apart, applied to one request at a time."""

    __slots__ = ("_header", "_identify")

    def __init__(self, clients: Clients) -> None:
        self._identify = clients.identify
        self._header = clients.header or ""

    def of(self, request: web.Request) -> str:
        """The id of the request's client: the keyed hash of its ``Authorization`` or of the
        configured header's last comma-separated value (the one the load balancer in front
        added), else its peer address. A key never leaves here."""
        identify = self._identify
        headers = headers_of(request)
        if identify == "authorization":
            value = headers.get(_AUTHORIZATION)
            if value is not None:
                return keyed_id(value)
        elif identify == "header":
            value = headers.get(self._header, "").rpartition(",")[2].strip()
            if value:
                return keyed_id(value)
        return request.remote or "unknown"
