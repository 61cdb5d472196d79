"""The client sink: chunked framing in place, and a gone client is a ConnectionResetError."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web

from proxy.request.sink import client_sink


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        if self.closing:  # as uvloop does once the connection is lost
            raise RuntimeError("unable to perform operation: the handler is closed")
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing


def sink_for(chunked: bool) -> tuple[Any, Transport, list[str]]:
    calls: list[str] = []

    async def drain() -> None:
        calls.append("drain")

    writer = SimpleNamespace(
        chunked=chunked, send_headers=lambda: calls.append("headers"), drain=drain
    )
    request = SimpleNamespace(writer=writer, protocol=SimpleNamespace(writing_paused=False))
    transport = Transport()
    sink = client_sink(cast(web.Request, request), cast(asyncio.Transport, transport))
    return sink, transport, calls


@pytest.mark.parametrize("chunked", [True, False])
def test_the_head_goes_first_and_bodies_are_framed_when_chunked(chunked: bool) -> None:
    sink, transport, calls = sink_for(chunked)
    assert calls == ["headers"]
    sink.write(b"data: x\n\n")
    sink.write(b"hello")
    if chunked:
        assert transport.written == [b"9\r\ndata: x\n\n\r\n", b"5\r\nhello\r\n"]
    else:
        assert transport.written == [b"data: x\n\n", b"hello"]
    assert not sink.full()


@pytest.mark.parametrize("chunked", [True, False])
def test_a_gone_client_is_a_connection_reset_and_the_sink_is_full(chunked: bool) -> None:
    sink, transport, _ = sink_for(chunked)
    transport.closing = True
    assert sink.full()  # the relay stops reading its upstream
    with pytest.raises(ConnectionResetError):
        sink.write(b"late")
    assert transport.written == []
