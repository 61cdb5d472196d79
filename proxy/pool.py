"""Keep-alive HTTP/1.1 connections to the upstreams, http and https alike; the proxy's only
upstream client (``proxy.http1`` per connection, ``proxy.response`` per answer).

A request is sent once: a failure is the caller's to retry or not (``retry_on``), so the pool
never repeats one behind its back. Failures are the exceptions aiohttp's client raises, so
callers catch one set::

    aiohttp.ClientError
    ├── ClientConnectorError     connect refused, unreachable, TLS failure (also an OSError)
    ├── ConnectionTimeoutError   connect timeout (also a TimeoutError)
    ├── ServerDisconnectedError  closed before a complete head
    ├── ClientPayloadError       body cut short, malformed response, undecodable encoding
    └── ServerTimeoutError       first byte or idle timeout (also a TimeoutError)
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

from proxy.http1 import UpstreamConnection, request_head
from proxy.response import UpstreamResponse

BODY_BUFFER = 64 * 1024  # bytes read ahead of the consumer at most, inflated bytes included
# An idle pooled connection older than this is closed, not reused: below uvicorn's (and so
# vLLM's) 5 s keep-alive, so the server rarely closes one just as a request goes out on it.
KEEPALIVE_SECONDS = 4.0
MAX_IDLE_PER_ORIGIN = 1024
Key = tuple[str, int, str | None]  # host, port, TLS server name (None: plain http)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an upstream URL points: its socket address, Host header, path and TLS."""

    host: str
    port: int
    host_header: str
    base_path: str  # "" or "/base": every request path is appended to it
    tls: bool


def parse_origin(url: str) -> Origin:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http or https URL: {url}")
    tls = parts.scheme == "https"
    default = 443 if tls else 80
    port = parts.port or default
    name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6 literal
    host_header = name if port == default else f"{name}:{port}"
    return Origin(parts.hostname, port, host_header, parts.path.rstrip("/"), tls)


class ConnectionPool:
    """Keep-alive connections per origin; ``request`` returns once the response head is in."""

    def __init__(
        self,
        *,
        keepalive: float = KEEPALIVE_SECONDS,
        max_idle_per_origin: int = MAX_IDLE_PER_ORIGIN,
    ) -> None:
        self.keepalive = keepalive
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: dict[Key, list[UpstreamConnection]] = {}
        self.in_use: set[UpstreamConnection] = set()
        self._origins: dict[str, Origin] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def request(
        self,
        url: str,
        method: str,
        path_qs: str,
        headers: Mapping[str, str] | CIMultiDict[str],
        body: bytes | None,
        *,
        connect: float | None,
        first_byte: float | None,
        idle: float,
        inflate: bool = False,
        buffer: int = BODY_BUFFER,
        tls_name: str | None = None,
    ) -> UpstreamResponse:
        """Send one request to ``url``'s path + ``path_qs`` and wait for the head.

        ``tls_name``: the name an https certificate must carry when ``url`` holds an address.
        The caller must ``release`` the response.
        """
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = parse_origin(url)
        data = request_head(method, origin.base_path + path_qs, origin.host_header, headers, body)
        if body:
            data += body
        connection = await self._connect(origin, connect, tls_name)
        response = UpstreamResponse(connection, method, buffer, inflate)
        connection.begin(response)
        self.in_use.add(connection)
        try:
            assert connection.transport is not None
            connection.transport.write(data)
            await response.wait_head(first_byte if first_byte is not None else 86400.0)
        except BaseException:
            self._drop(connection)
            raise
        response.start_idle(idle)
        return response

    async def _connect(
        self, origin: Origin, timeout: float | None, tls_name: str | None
    ) -> UpstreamConnection:
        if self._closed:
            raise aiohttp.ClientOSError(0, "the upstream client is closed")
        host, port = origin.host, origin.port
        name = (tls_name or host) if origin.tls else None
        key: Key = (host, port, name)
        idle = self._idle.get(key)
        loop = asyncio.get_running_loop()
        now = loop.time()
        while idle:
            connection = idle.pop()
            if connection.closing or now - connection.idle_since > self.keepalive:
                connection.abort()
                continue
            return connection
        context = self._context() if origin.tls else None
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(
                    lambda: UpstreamConnection(loop, key),
                    host,
                    port,
                    ssl=context,
                    server_hostname=name,
                ),
                timeout,
            )
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(
                f"connecting to {host}:{port} timed out after {timeout} s"
            ) from None
        except ssl.SSLCertVerificationError as exc:
            raise aiohttp.ClientConnectorCertificateError(_key(host, port, context), exc) from None
        except OSError as exc:
            # aiohttp's own connect failure, so callers tell "never reached a server" apart.
            raise aiohttp.ClientConnectorError(_key(host, port, context), exc) from None
        return protocol

    def _context(self) -> ssl.SSLContext:
        """The system's trust store (``SSL_CERT_FILE``/``SSL_CERT_DIR`` replace it), made once."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
            self._tls.set_alpn_protocols(["http/1.1"])
        return self._tls

    def release(self, response: UpstreamResponse) -> None:
        """Back to the pool when its body was read to the end; closed (never reused) otherwise."""
        connection = cast(UpstreamConnection, response._connection)  # the one request() made
        response._stop_idle()
        self.in_use.discard(connection)
        if (
            response.complete
            and connection.reusable
            and not self._closed
            and connection.response is response
        ):
            connection.response = None
            connection.resume()
            connection.idle_since = asyncio.get_running_loop().time()
            pool = self._idle.setdefault(connection.key, [])
            if len(pool) < self.max_idle_per_origin:
                pool.append(connection)
                return
        connection.response = None
        connection.abort()

    def _drop(self, connection: UpstreamConnection) -> None:
        self.in_use.discard(connection)
        connection.response = None
        connection.abort()

    async def close(self) -> None:
        self._closed = True
        for pool in self._idle.values():
            for connection in pool:
                connection.abort()
        self._idle.clear()
        for connection in list(self.in_use):
            connection.abort()
        self.in_use.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost


def _key(host: str, port: int, context: ssl.SSLContext | None) -> Any:
    """What aiohttp's connector errors read of a connection key."""
    return cast(Any, SimpleNamespace(host=host, port=port, ssl=context))
