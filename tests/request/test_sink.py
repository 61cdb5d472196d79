"""The client sink: chunked framing in place, every write counted on the request's record, and a
gone client is a ConnectionResetError."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web

from proxy.observe.record import Observers, RequestRecord
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


def record() -> RequestRecord:
    return RequestRecord(Observers([]), "POST", "/v1/chat/completions", {})


def sink_for(
    chunked: bool,
    on: RequestRecord | None = None,
    first_chunk: bool = True,
    protocol: SimpleNamespace | None = None,
    transport: Transport | None = None,
) -> tuple[Any, Transport, list[str]]:
    calls: list[str] = []

    async def drain() -> None:
        calls.append("drain")

    writer = SimpleNamespace(
        chunked=chunked, send_headers=lambda: calls.append("headers"), drain=drain
    )
    protocol = protocol or SimpleNamespace(writing_paused=False)
    transport = transport or Transport()
    request = SimpleNamespace(writer=writer, protocol=protocol, transport=transport)
    sink = client_sink(cast(web.Request, request), on or record(), first_chunk=first_chunk)
    return sink, transport, calls


@pytest.mark.parametrize("chunked", [True, False])
def test_the_head_goes_first_and_bodies_are_framed_when_chunked(chunked: bool) -> None:
    sink, transport, calls = sink_for(chunked)
    assert calls == ["headers"]
    assert sink.write(b"data: x\n\n") is False  # each write says whether the sink is full now
    sink.write(b"hello")
    if chunked:
        assert transport.written == [b"9\r\ndata: x\n\n\r\n", b"5\r\nhello\r\n"]
    else:
        assert transport.written == [b"data: x\n\n", b"hello"]
    assert not sink.full()


class Filling(Transport):
    """Past its high-water mark from the second write on (the protocol is paused); the third
    finds the socket reset (closing from then on)."""

    def __init__(self, protocol: SimpleNamespace) -> None:
        super().__init__()
        self.protocol = protocol

    def write(self, data: bytes) -> None:
        super().write(data)
        self.protocol.writing_paused = len(self.written) >= 2
        self.closing = len(self.written) >= 3


@pytest.mark.parametrize(
    ("chunked", "first_chunk"), [(c, f) for c in (True, False) for f in (True, False)]
)
def test_a_write_that_fills_the_transport_or_finds_the_client_gone_says_it_is_full(
    chunked: bool, first_chunk: bool
) -> None:
    protocol = SimpleNamespace(writing_paused=False)
    sink, _, _ = sink_for(chunked, None, first_chunk, protocol, Filling(protocol))
    assert [sink.write(b"a"), sink.write(b"b")] == [False, True]
    protocol.writing_paused = False  # drained
    assert sink.write(b"c") is True  # the client is gone: full, so the writer's drain raises


@pytest.mark.parametrize("chunked", [True, False])
def test_a_gone_client_is_a_connection_reset_and_the_sink_is_full(chunked: bool) -> None:
    sink, transport, _ = sink_for(chunked)
    transport.closing = True
    assert sink.full()  # the relay stops reading its upstream
    with pytest.raises(ConnectionResetError):
        sink.write(b"late")
    assert transport.written == []


@pytest.mark.parametrize("chunked", [True, False])
def test_every_write_is_counted_on_the_record_and_the_first_stamped_when_asked(
    chunked: bool,
) -> None:
    relayed = record()
    sink, _, _ = sink_for(chunked, relayed, first_chunk=True)
    assert relayed.bytes_out == 0  # answered: nothing written yet
    assert relayed.first_chunk_at is None
    sink.write(b"data: x\n\n")
    stamped = relayed.first_chunk_at
    assert stamped is not None
    sink.write(b"hello")
    assert relayed.bytes_out == 14  # the body's bytes, not the chunked framing's
    assert relayed.first_chunk_at == stamped
    stitched = record()
    sink, _, _ = sink_for(chunked, stitched, first_chunk=False)
    sink.write(b": keep-alive\n\n")  # a fan-out stamps its first stitched chunk itself
    assert stitched.bytes_out == 14
    assert stitched.first_chunk_at is None


def test_a_client_gone_before_the_body_is_a_connection_reset() -> None:
    writer = SimpleNamespace(chunked=False, drain=None)
    request = SimpleNamespace(writer=writer, protocol=None, transport=None)
    with pytest.raises(ConnectionResetError, match="the client left"):
        client_sink(cast(web.Request, request), record(), first_chunk=True)
