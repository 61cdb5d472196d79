"""The client sink: chunked framing in place, every write counted for the request's record (handed
to it when the body is over), and a gone client is a ConnectionResetError."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web

from proxy.observe.record import Observers, RequestRecord
from proxy.request.sink import client_sink


class Transport:
    HIGH = 64  # the high-water mark, in bytes

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.buffered = 0  # what the kernel has not taken
        self.closing = False

    def write(self, data: bytes) -> None:
        if self.closing:  # as uvloop does once the connection is lost
            raise RuntimeError("unable to perform operation: the handler is closed")
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self.HIGH // 4, self.HIGH)


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
    """Past its high-water mark from the second write on (the protocol is paused, as uvloop
    pauses it); the third finds the socket reset (closing from then on)."""

    def __init__(self, protocol: SimpleNamespace) -> None:
        super().__init__()
        self.protocol = protocol

    def write(self, data: bytes) -> None:
        super().write(data)
        self.buffered = self.HIGH + 1 if len(self.written) == 2 else 0
        self.protocol.writing_paused = len(self.written) == 2
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
    assert sink.full()
    protocol.writing_paused = False  # drained
    assert not sink.full()
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
def test_every_write_is_counted_for_the_record_and_the_first_stamped_when_asked(
    chunked: bool,
) -> None:
    relayed = record()
    relayed.bytes_out = 0  # answered: nothing written yet
    sink, _, _ = sink_for(chunked, relayed, first_chunk=True)
    before = time.perf_counter()
    sink.write(b"data: x\n\n")
    after = time.perf_counter()
    sink.write(b"hello")
    assert relayed.bytes_out == 0  # handed to the record once, when the body is over
    assert relayed.first_chunk_at is None
    sink.settle()
    assert relayed.bytes_out == 14  # the body's bytes, not the chunked framing's
    stamped = relayed.first_chunk_at
    assert stamped is not None
    assert before <= stamped <= after  # the first write's time, not the second's
    sink.settle()  # a second settle changes nothing
    assert (relayed.bytes_out, relayed.first_chunk_at) == (14, stamped)
    stitched = record()
    sink, _, _ = sink_for(chunked, stitched, first_chunk=False)
    sink.write(b": keep-alive\n\n")  # a fan-out stamps its first stitched chunk itself
    sink.settle()
    assert stitched.bytes_out == 14
    assert stitched.first_chunk_at is None


def test_a_body_written_on_a_record_that_counted_already_adds_to_it() -> None:
    counted = record()
    counted.bytes_out = 5
    sink, _, _ = sink_for(False, counted)
    sink.write(b"abc")
    sink.settle()
    assert counted.bytes_out == 8


def test_a_client_gone_before_the_body_is_a_connection_reset() -> None:
    writer = SimpleNamespace(chunked=False, drain=None)
    request = SimpleNamespace(writer=writer, protocol=None, transport=None)
    with pytest.raises(ConnectionResetError, match="the client left"):
        client_sink(cast(web.Request, request), record(), first_chunk=True)


def test_whole_chunks_are_written_as_they_came_to_a_chunked_response_only() -> None:
    counted = record()
    sink, transport, _ = sink_for(True, counted)
    assert sink.framed is not None
    assert sink.framed.write_framed(b"5\r\nhello\r\n3\r\nabc\r\n", 8) is False
    assert transport.written == [b"5\r\nhello\r\n3\r\nabc\r\n"]
    sink.settle()
    assert counted.bytes_out == 8  # the body's bytes, as the relay counted them
    assert counted.first_chunk_at is not None
    transport.closing = True
    with pytest.raises(ConnectionResetError):
        sink.framed.write_framed(b"1\r\nx\r\n", 1)
    plain, _, _ = sink_for(False)
    assert plain.framed is None  # a response of known length, or to HTTP/1.0
