"""The client side of end-to-end tests: one POST that reads the whole answer, SSE decoding, and a
client that leaves by a reset or a FIN."""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

import aiohttp
import orjson
from multidict import CIMultiDict

from proxy.core.sse import SSEDecoder

# Seconds a client waits for a whole answer: a hang becomes a failure, not a stuck suite. Generous
# (the machine is shared), so never a timing assertion.
WAIT = 30.0


class Answer(NamedTuple):
    status: int
    body: bytes
    headers: CIMultiDict[str]


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: object,
    rid: str | None = None,
    *,
    headers: Mapping[str, str] | None = None,
    within: float = WAIT,
) -> Answer:
    """POST ``body`` (a JSON value, or bytes sent as they are) with ``X-Request-Id: rid`` when
    given, and read the whole answer within ``within`` seconds."""
    sent = dict(headers or {})
    if rid is not None:
        sent["X-Request-Id"] = rid
    # Bytes go as a stream of known length: aiohttp warns on a large body held in one piece.
    payload: dict[str, Any] = (
        {"data": io.BytesIO(body)} if isinstance(body, bytes) else {"json": body}
    )
    async with asyncio.timeout(within), http.post(url, headers=sent, **payload) as response:
        return Answer(response.status, await response.read(), response.headers.copy())


def sse_payloads(raw: bytes) -> list[Any]:
    """Every data payload of a stream, decoded; ``[DONE]`` stays a string."""
    decoder = SSEDecoder()
    events = decoder.feed(raw) + decoder.close()
    return [e.data if e.data == "[DONE]" else orjson.loads(e.data) for e in events]


async def leave(writer: asyncio.StreamWriter, rst: bool) -> None:
    """RST: SO_LINGER 0, then close. FIN: shut our side down, then close."""
    sock = writer.get_extra_info("socket")
    if rst:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
        return
    with contextlib.suppress(OSError):
        writer.write_eof()
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
