"""Tests for proxy.core.sse: literal bytes in, literal events out, split at every awkward place."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.sse import MAX_EVENT_BYTES, Event, RawEvent, SSEDecoder, SSEError


def decode_whole(stream: bytes) -> list[Event]:
    decoder = SSEDecoder()
    return decoder.feed(stream) + decoder.close()


def decode_pieces(pieces: list[bytes]) -> list[Event]:
    decoder = SSEDecoder()
    events: list[Event] = []
    for piece in pieces:
        events += decoder.feed(piece)
    return events + decoder.close()


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        pytest.param(
            b"data: YHOO\ndata: +2\ndata: 10\n\n",
            [Event("YHOO\n+2\n10")],
            id="whatwg-stock-ticker-multiline",
        ),
        pytest.param(
            b": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\n"
            b"data:  third event\n\n",
            [
                Event("first event", id="1"),
                Event("second event", id=""),
                Event(" third event", id=""),
            ],
            id="whatwg-comment-id-and-id-reset",
        ),
        pytest.param(
            b"data\n\ndata\ndata\n\ndata:\n\n",
            [Event(""), Event("\n"), Event("")],
            id="whatwg-bare-data-lines",
        ),
        pytest.param(
            b"data:test\n\ndata: test\n\n",
            [Event("test"), Event("test")],
            id="whatwg-space-after-colon-optional",
        ),
        pytest.param(
            b"event: add\ndata: 73857293\n\nevent: remove\ndata: 2153\n\n"
            b"event: add\ndata: 113411\n\n",
            [
                Event("73857293", event="add"),
                Event("2153", event="remove"),
                Event("113411", event="add"),
            ],
            id="whatwg-event-types",
        ),
        pytest.param(
            b"id: 7\ndata: a\n\ndata: b\n\n",
            [Event("a", id="7"), Event("b", id="7")],
            id="last-event-id-persists",
        ),
        pytest.param(
            b"id: 1\n\nid: x\x00y\ndata: a\n\n",
            [Event("a", id="1")],
            id="id-with-nul-ignored",
        ),
        pytest.param(
            b"retry: 3000\ndata: a\n\ndata: b\n\n",
            [Event("a", retry=3000), Event("b")],
            id="retry-belongs-to-its-event",
        ),
        pytest.param(
            b"retry: 30s\ndata: a\n\nretry:\ndata: b\n\nretry: \xd9\xa3\ndata: c\n\n",
            [Event("a"), Event("b"), Event("c")],
            id="retry-non-ascii-digits-ignored",
        ),
        pytest.param(
            b"event: x\nretry: 5\n\ndata: a\n\n",
            [Event("a")],
            id="blank-line-without-data-dispatches-nothing-and-resets",
        ),
        pytest.param(
            b"event:\ndata: a\n\n",
            [Event("a", event="message")],
            id="empty-event-type-is-message",
        ),
        pytest.param(
            b": ping\n\n:\n\ndata: a\n: ping inside\ndata: b\n\n",
            [Event("a\nb")],
            id="comments-ignored",
        ),
        pytest.param(
            b"foo: bar\nData: x\ndata : y\ndata: a\n\n",
            [Event("a")],
            id="unknown-and-miscased-fields-ignored",
        ),
        pytest.param(
            b"data: a:b: c\ndata:  two spaces\n\n",
            [Event("a:b: c\n two spaces")],
            id="only-first-colon-and-one-space-matter",
        ),
        pytest.param(
            b"\xef\xbb\xbfdata: a\n\n",
            [Event("a")],
            id="leading-bom-skipped",
        ),
        pytest.param(
            b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\ndata: b\n\n",
            [Event("b")],
            id="only-first-bom-skipped",
        ),
        pytest.param(
            b"data: \xff\xfe ok \xe2\x82\n\n",
            [Event("\ufffd\ufffd ok \ufffd")],
            id="invalid-utf8-replaced",
        ),
        pytest.param(
            b"data: caf\xc3\xa9 \xf0\x9f\x98\x80\n\n",
            [Event("caf\u00e9 \U0001f600")],
            id="multibyte-utf8",
        ),
        pytest.param(b"data: [DONE]\n\n", [Event("[DONE]")], id="done-sentinel"),
    ],
)
def test_decodes_literal_stream(stream: bytes, expected: list[Event]) -> None:
    assert decode_whole(stream) == expected


@pytest.mark.parametrize(
    "stream",
    [
        pytest.param(b"data: a\ndata: b\n\ndata: c\n\n", id="lf"),
        pytest.param(b"data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n", id="crlf"),
        pytest.param(b"data: a\rdata: b\r\rdata: c\r\r", id="cr"),
        pytest.param(b"data: a\r\ndata: b\r\rdata: c\n\r\n", id="mixed"),
    ],
)
def test_every_line_end_style_gives_same_events(stream: bytes) -> None:
    assert decode_whole(stream) == [Event("a\nb"), Event("c")]


def test_cr_then_lf_in_next_chunk_is_one_line_end() -> None:
    assert decode_pieces([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]) == [Event("a\nb")]


def test_cr_then_empty_chunk_then_lf_is_one_line_end() -> None:
    assert decode_pieces([b"data: a\r", b"", b"\n", b"data: b\n\n"]) == [Event("a\nb")]


def test_cr_then_cr_lf_is_two_line_ends() -> None:
    assert decode_pieces([b"data: a\r", b"\r\n", b"data: b\n\n"]) == [Event("a"), Event("b")]


def test_event_is_returned_by_the_feed_that_completes_it() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n") == []
    assert decoder.feed(b"\r") == [Event("a")]
    assert decoder.feed(b"\ndata: b\n\ndata: c\n\nda") == [Event("b"), Event("c")]
    assert decoder.feed(b"ta: d\n") == []
    assert decoder.feed(b"\n") == [Event("d")]


def test_bom_split_across_chunks_is_skipped() -> None:
    assert decode_pieces([b"\xef", b"\xbb", b"\xbfdata: a\n\n"]) == [Event("a")]


def test_bom_prefix_that_is_not_a_bom_is_kept() -> None:
    assert decode_pieces([b"\xef\xbb", b"data: a\n\ndata: b\n\n"]) == [Event("b")]


def test_multibyte_character_split_across_chunks() -> None:
    assert decode_pieces([b"data: \xf0\x9f", b"\x98", b"\x80!\n\n"]) == [Event("\U0001f600!")]


def test_one_mib_line_in_64_kib_reads() -> None:
    payload = b"x" * (1024 * 1024 + 7)
    stream = b"data: " + payload + b"\n\n"
    pieces = [stream[i : i + 65536] for i in range(0, len(stream), 65536)]
    assert decode_pieces(pieces) == [Event(payload.decode())]


def test_large_chunk_of_small_crlf_events() -> None:
    # Past 8 KiB the splitter switches from bytes.split to a find loop; same answer.
    stream = b"".join(b"data: %d\r\n: ping\r\n\r\n" % i for i in range(2000))
    assert len(stream) > 8192
    assert decode_whole(stream) == [Event(str(i)) for i in range(2000)]


# A stream with every awkward thing at once. Its long line (200 KiB, far past 64 KiB) is
# plain ASCII so that decoding it ~200,000 times in the split test below stays fast.
REALISTIC = (
    b"\xef\xbb\xbf: welcome\r\n\r\n"
    b'retry: 1500\r\nid: 41\r\nevent: start\r\ndata: {"v": 1}\r\n\r\n'
    b"data: line one\rdata:line two\r\r"
    b": ping\n"
    b"data: caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\n"
    b"data: \xce\xb1\xce\xb2\xce\xb3\n\n"
    b"data: " + b"0123456789abcdef" * 12800 + b"\r\n\r\n"
    b"event: \xe2\x9c\x93\nid\ndata\ndata\n\r\n"
    b"data: [DONE]\n\n"
)
REALISTIC_EVENTS = [
    Event('{"v": 1}', event="start", id="41", retry=1500),
    Event("line one\nline two", id="41"),
    Event("caf\u00e9 \u20ac \U0001f600\n\u03b1\u03b2\u03b3", id="41"),
    Event("0123456789abcdef" * 12800, id="41"),
    Event("\n", event="\u2713", id=""),
    Event("[DONE]", id=""),
]


def test_realistic_stream_in_one_feed() -> None:
    assert decode_whole(REALISTIC) == REALISTIC_EVENTS


def _split_offsets() -> list[int]:
    """Every offset, except that inside the long line's uniform middle a prime stride will do.

    Each split decodes the whole 200 KiB stream; every single offset would take tens of seconds
    for cases that differ only in where one run of identical bytes is cut.
    """
    start = REALISTIC.index(b"0123456789abcdef")
    end = start + 16 * 12800
    return [
        offset
        for offset in range(len(REALISTIC) + 1)
        if not start + 64 < offset < end - 64 or (offset - start) % 251 == 0
    ]


def test_realistic_stream_split_at_every_offset_gives_same_events() -> None:
    mismatches = [
        offset
        for offset in _split_offsets()
        if decode_pieces([REALISTIC[:offset], REALISTIC[offset:]]) != REALISTIC_EVENTS
    ]
    assert mismatches == []


def test_realistic_stream_byte_at_a_time_gives_same_events() -> None:
    pieces = [REALISTIC[i : i + 1] for i in range(len(REALISTIC))]
    assert decode_pieces(pieces) == REALISTIC_EVENTS


def test_close_dispatches_event_missing_only_its_blank_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n\ndata: [DONE]\n") == [Event("a")]
    assert decoder.close() == [Event("[DONE]")]


def test_close_dispatches_after_trailing_crlf_split_from_its_lf() -> None:
    assert decode_pieces([b"data: [DONE]\r"]) == [Event("[DONE]")]


@pytest.mark.parametrize(
    "stream",
    [
        pytest.param(b"data: [DONE]", id="unterminated-line"),
        pytest.param(b"data: a\ndata: trunc", id="event-with-unterminated-last-line"),
        pytest.param(b"data: a\n: ping", id="event-with-unterminated-comment"),
        pytest.param(b"event: x\nid: 3\n", id="fields-without-data"),
        pytest.param(b"", id="empty-stream"),
        pytest.param(b"\xef\xbb", id="half-a-bom"),
    ],
)
def test_close_dispatches_nothing_for_truncated_or_dataless_tail(stream: bytes) -> None:
    assert decode_whole(stream) == []


def test_close_twice_returns_nothing_the_second_time() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"data: a\n")
    assert decoder.close() == [Event("a")]
    assert decoder.close() == []


def test_unterminated_line_past_limit_raises() -> None:
    decoder = SSEDecoder(max_event_bytes=100)
    assert decoder.feed(b"data: " + b"x" * 94) == []
    with pytest.raises(SSEError, match="max_event_bytes=100"):
        decoder.feed(b"x")


def test_line_past_limit_in_one_chunk_raises() -> None:
    decoder = SSEDecoder(max_event_bytes=100)
    with pytest.raises(SSEError):
        decoder.feed(b"event: " + b"x" * 100 + b"\n")


def test_event_whose_data_lines_add_up_past_limit_raises() -> None:
    decoder = SSEDecoder(max_event_bytes=100)
    line = b"data: " + b"x" * 39 + b"\n"
    assert decoder.feed(line + line) == []
    with pytest.raises(SSEError):
        decoder.feed(line)


def test_many_events_each_under_limit_do_not_raise() -> None:
    decoder = SSEDecoder(max_event_bytes=100)
    event = b"data: " + b"x" * 90 + b"\n\n"
    assert decoder.feed(event * 50) == [Event("x" * 90)] * 50


def test_unterminated_comment_past_limit_raises() -> None:
    decoder = SSEDecoder(max_event_bytes=100)
    with pytest.raises(SSEError):
        decoder.feed(b": " + b"p" * 200)


@pytest.mark.parametrize("raw", [False, True], ids=["feed", "feed_raw"])
@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_a_line_at_the_limit_passes_and_one_byte_more_raises_however_it_is_split(
    raw: bool, eol: bytes
) -> None:
    limit = 16
    at_limit = b"data: " + b"x" * (limit - len(b"data: "))  # its end not counted
    for line, fits in ((at_limit, True), (at_limit + b"x", False)):
        stream = line + eol + eol
        for cut in range(len(stream) + 1):
            events, failed = _decode([stream[:cut], stream[cut:]], limit, raw)
            assert failed is not fits, (line, cut)
            assert events == ([("x" * 10, "message")] if fits else []), (line, cut)


class LineByLine:
    """The decoder's general path only, line by line: what its fast paths must equal. A wrapper,
    not a subclass: the compiled decoder (setup.py) takes no subclass from Python."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._decoder = SSEDecoder(max_event_bytes)

    def feed(self, chunk: bytes) -> list[Event]:
        lines = self._decoder._lines.feed(chunk)
        return self._decoder._interpret(lines) if lines else []

    def close(self) -> list[Event]:
        return self._decoder.close()

    def feed_raw(self, chunk: bytes) -> list[RawEvent]:
        """The data decoded and encoded again, as no fast path leaves it."""
        return [(e.data.encode(), e.event) for e in self.feed(chunk)]

    def close_raw(self) -> list[RawEvent]:
        return [(e.data.encode(), e.event) for e in self.close()]


def _both(pieces: list[bytes]) -> tuple[list[Event], list[Event]]:
    fast, reference = SSEDecoder(), LineByLine()
    got: list[Event] = []
    want: list[Event] = []
    for piece in pieces:
        got += fast.feed(piece)
        want += reference.feed(piece)
    return got + fast.close(), want + reference.close()


WHOLE_EVENT_CASES = [
    [b'data: {"a":1}\n\n', b'data: {"b":2}\n\ndata: [DONE]\n\n'],
    [b"data: a\n\n", b": ping\n\n", b"id: 7\n\n", b"data: x\n\n", b"data: y\n\n"],
    [b"data: a\n\n", b"retry: 5\n", b"data: y\n\n", b"data: z\n\n"],
    [b"data: a\n\n", b"event: e\n", b"data: b\n\n", b"data: c\n\n"],
    [b"data: a\n\n", b"data: b\ndata: c\n\n"],
    [b"data: a\n\n", b"data:b\n\n", b"data:  two spaces\n\n"],
    [b"data: a\n\n", b"data: a\n\n\n\n", b"\n\n"],
    [b"data: a\n\n", b"data: caf\xc3\n\n", b"data: \xc3\xa9\n\n"],
    [b"data: a\n\n", b"data: b\r\n\r\n", b"data: c\n\n"],
    [b"data: a\n\n", b"data: part", b"ial\n\n", b"data: whole\n\n"],
    [b"data: a\n\n", b"data: \n\n", b"data: \x00\n\n"],
    [b"\xef\xbb\xbfdata: bom\n\n", b"data: next\n\n"],
]


@pytest.mark.parametrize("pieces", WHOLE_EVENT_CASES)
def test_whole_event_fast_path_equals_the_line_by_line_path(pieces: list[bytes]) -> None:
    got, want = _both(pieces)
    assert got == want


def test_whole_event_fast_path_equals_line_by_line_on_every_literal_fixture() -> None:
    streams = [REALISTIC, b"data: [DONE]\n\n", b'data: {"v": 1}\n\nid: 3\ndata: x\n\n']
    for stream in streams:
        events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
        got, want = _both([b"data: warm\n\n", *events])
        assert got == want
        got, want = _both([b"data: warm\n\n", stream])
        assert got == want


def test_whole_event_fast_path_respects_the_size_limit() -> None:
    decoder = SSEDecoder(max_event_bytes=16)
    assert decoder.feed(b"data: ok\n\n") == [Event("ok")]
    with pytest.raises(SSEError):
        decoder.feed(b"data: " + b"x" * 32 + b"\n\n")


def _raw_and_line_by_line(pieces: list[bytes]) -> tuple[list[RawEvent], list[Event]]:
    raw, reference = SSEDecoder(), LineByLine()
    got: list[RawEvent] = []
    want: list[Event] = []
    for piece in pieces:
        got += raw.feed_raw(piece)
        want += reference.feed(piece)
    return got + raw.close_raw(), want + reference.close()


@pytest.mark.parametrize("pieces", WHOLE_EVENT_CASES)
def test_feed_raw_is_feed_with_the_data_left_undecoded(pieces: list[bytes]) -> None:
    got, want = _raw_and_line_by_line(pieces)
    assert [(data.decode("utf-8", "replace"), event) for data, event in got] == [
        (e.data, e.event) for e in want
    ]


def test_feed_raw_leaves_a_whole_events_bytes_as_sent() -> None:
    decoder = SSEDecoder()
    assert decoder.feed_raw(b"data: warm\n\n") == [(b"warm", "message")]
    assert decoder.feed_raw(b"data: caf\xc3\n\n") == [(b"caf\xc3", "message")]
    assert decoder.feed_raw(b"data: a\n\ndata: b\n\n") == [(b"a", "message"), (b"b", "message")]
    assert decoder.feed_raw(b"event: error\ndata: x\n\n") == [(b"x", "error")]


def test_feed_raw_respects_the_size_limit() -> None:
    decoder = SSEDecoder(max_event_bytes=16)
    assert decoder.feed_raw(b"data: ok\n\n") == [(b"ok", "message")]
    with pytest.raises(SSEError):
        decoder.feed_raw(b"data: " + b"x" * 32 + b"\n\n")


def test_feed_raw_equals_line_by_line_on_every_literal_fixture() -> None:
    streams = [REALISTIC, b"data: [DONE]\n\n", b'data: {"v": 1}\n\nid: 3\ndata: x\n\n']
    for stream in streams:
        events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
        for pieces in ([b"data: warm\n\n", *events], [b"data: warm\n\n", stream]):
            got, want = _raw_and_line_by_line(pieces)
            assert [(d.decode(), event) for d, event in got] == [(e.data, e.event) for e in want]


# --- any stream, split into any reads, decodes as it does one byte at a time ---

_PIECES = [
    b'data: {"a":1}\n\n', b"data: x\n\n", b"data: ", b"data:", b"data", b"event: e", b"event:",
    b"id: 7", b"retry: 5", b": ping", b"\xef\xbb\xbf", b"\xc3\xa9", b"\xc3", b"\xff", b" ",
    b"\n", b"\r", b"\r\n", b"\n\n", b"\r\n\r\n", b"\r\r", b"[DONE]", b"x" * 30,
]  # fmt: skip


def _decode(pieces: list[bytes], limit: int, raw: bool) -> tuple[list[tuple[str, str]], bool]:
    """The events as (data, type) and whether the decoder raised; what a caller would see."""
    decoder = SSEDecoder(max_event_bytes=limit)
    events: list[tuple[str, str]] = []
    try:
        for piece in pieces:
            if raw:
                events += [(d.decode("utf-8", "replace"), e) for d, e in decoder.feed_raw(piece)]
            else:
                events += [(e.data, e.event) for e in decoder.feed(piece)]
        if raw:
            events += [(d.decode("utf-8", "replace"), e) for d, e in decoder.close_raw()]
        else:
            events += [(e.data, e.event) for e in decoder.close()]
    except SSEError:
        return events, True
    return events, False


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(_PIECES), max_size=40),
    st.lists(st.integers(min_value=0, max_value=2000), max_size=8),
    st.sampled_from([MAX_EVENT_BYTES, 40, 12]),
    st.booleans(),
)
def test_any_split_decodes_as_byte_at_a_time(
    parts: list[bytes], cuts: list[int], limit: int, raw: bool
) -> None:
    stream = b"".join(parts)
    offsets = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    pieces = [stream[a:b] for a, b in itertools.pairwise(offsets)]
    want, want_error = _decode([stream[i : i + 1] for i in range(len(stream))], limit, raw=False)
    got, got_error = _decode(pieces, limit, raw)
    assert got_error == want_error
    if want_error:  # the events of the read that failed are lost with it, none are made up
        assert got == want[: len(got)]
    else:
        assert got == want
