"""The upstream HTTP/1.1 client: one connection per request in flight, the response read or relayed
from the protocol, keep-alive pooling. It knows nothing of LLMs, n or replicas, and imports no
aiohttp: its failures are its own (``proxy.http.errors``).
"""

from proxy.http.connection import stream_path_compiled
from proxy.http.errors import (
    BadResponse,
    BodyTooLong,
    ClientClosed,
    ConnectFailed,
    ConnectTimeout,
    Disconnected,
    HTTPClientError,
    ResponseTimeout,
)
from proxy.http.pool import ConnectionPool
from proxy.http.response import FramedSink, UpstreamResponse

__all__ = [
    "BadResponse",
    "BodyTooLong",
    "ClientClosed",
    "ConnectFailed",
    "ConnectTimeout",
    "ConnectionPool",
    "Disconnected",
    "FramedSink",
    "HTTPClientError",
    "ResponseTimeout",
    "UpstreamResponse",
    "stream_path_compiled",
]
