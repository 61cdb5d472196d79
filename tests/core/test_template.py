"""Tests for the byte templates (proxy.core.template): they send what the full path sends, byte
for byte.

Literal streams first (vLLM's, the pacer's, crafted bytes around the value, a multi-line
event), then a differential fuzzer: child streams as a server might send them (token
chunks of any text, multi-line ``data:`` events, JSON whitespace, escapes, number spellings and
key orders orjson would not write, LF, CRLF and CR line ends, comments, ``id``/``event``/
``retry`` fields, a BOM, role, finishing, usage and error chunks), split into any network reads
and interleaved, go through the stitcher twice: with templates and the decoder's fast paths, and
through the full path with the line-by-line decoder. What the client is sent must be the same.

``N_PROXY_FUZZ_EXAMPLES=5000 pytest --timeout=0 tests/core/test_template.py`` fuzzes longer than CI
does.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from typing import Any, Protocol

import hypothesis
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.plan import Plan, plan_request
from proxy.core.sse import RawEvent, SSEDecoder, SSEError
from proxy.core.stitch import StreamError, StreamStitcher
from tests.core.test_sse import LineByLine
from tests.core.test_stitch import (
    STREAM_WITH_USAGE,
    chunk,
    one_event,
    plan,
    role_chunk,
    usage,
    usage_chunk,
)

EXAMPLES = int(os.environ.get("N_PROXY_FUZZ_EXAMPLES", "150"))


class Stitching(Protocol):
    plan: Plan

    @property
    def chunks(self) -> int: ...

    def chunk(self, pos: int, data: bytes, event: str = "message") -> bytes | None: ...
    def finished(self, pos: int) -> bool: ...
    def tail(self) -> bytes: ...


class FullPath:
    """Every chunk parsed, rewritten and serialized: what the templates must equal. A wrapper,
    not a subclass: the compiled stitcher (setup.py) takes no subclass from Python."""

    def __init__(self, p: Plan) -> None:
        self.stitcher = StreamStitcher(p)
        self.plan = p

    @property
    def chunks(self) -> int:
        return self.stitcher.chunks

    def chunk(self, pos: int, data: bytes, event: str = "message") -> bytes | None:
        return self.stitcher._rewrite(pos, data, event)

    def finished(self, pos: int) -> bool:
        return self.stitcher.finished(pos)

    def tail(self) -> bytes:
        return self.stitcher.tail()


class Counted(FullPath):
    """The stitcher as it runs, counting the chunks that a template stitched."""

    calls = 0

    @property
    def filled(self) -> int:
        return self.calls - self.stitcher.rewrites  # the chunks that skipped the full path

    def chunk(self, pos: int, data: bytes, event: str = "message") -> bytes | None:
        self.calls += 1
        return self.stitcher.chunk(pos, data, event)


class Decoding(Protocol):
    def feed_raw(self, chunk: bytes) -> list[RawEvent]: ...
    def close_raw(self) -> list[RawEvent]: ...


# --- literal streams ---


Step = tuple[int, bytes, str]


def replay(p: Plan, steps: list[Step]) -> tuple[list[Any], list[Any]]:
    """Both stitchers through the same events: what each sent, chunk by chunk, then its tail."""
    sent: tuple[list[Any], list[Any]] = ([], [])
    both: tuple[Stitching, Stitching] = (StreamStitcher(p), FullPath(p))
    for s, out in zip(both, sent, strict=True):
        for pos, data, event in steps:
            try:
                raw = s.chunk(pos, data, event)
            except StreamError as error:
                out.append(("error", error.choice, error.reason))
                break
            out.append(raw)
        else:
            out.append(s.tail())
        out.append((s.chunks, [s.finished(pos) for pos in range(len(p.children))]))
    return sent


def interleave(streams: list[list[bytes]]) -> list[Step]:
    longest = max(len(s) for s in streams)
    return [
        (pos, s[i], "message")
        for i in range(longest)
        for pos, s in enumerate(streams)
        if i < len(s)
    ]


def vllm_stream(p: Plan, pos: int, contents: list[Any], **extra: Any) -> list[bytes]:
    cid = f"chatcmpl-{p.children[pos].request_id}"
    return [
        role_chunk(cid, **extra),
        *(chunk(cid, 9, c, **extra) for c in contents),
        chunk(cid, 9, None, "stop", **extra),
        usage_chunk(cid, 4, len(contents)),
        b"[DONE]",
    ]


ADVERSARIAL = [
    "plain",
    ' "quoted" ',
    '","finish_reason":"stop"}],"usage":{"total_tokens":1}}',
    '"},{"index":1,"delta":{"role":"assistant"',
    "back\\slash\\",
    "\\u0041 not an escape",
    "caf\u00e9 \u2603 \U0001f600",
    "\x00\x1f control",
    "",
    "id",
    '"index"',
    "\n\n data: [DONE]\n\n",
    "\x00n-proxy template slot\x00",
]


@pytest.mark.parametrize(
    "contents",
    [
        pytest.param([f" tok{i}" for i in range(12)], id="tokens"),
        pytest.param(ADVERSARIAL, id="adversarial"),
        pytest.param(
            ["a", "b", 7, "c", 1.5, None, True, "d", {"x": 1}, ["e"], "f", "g"], id="types"
        ),
        pytest.param(["same"] * 6 + ["other", "more"], id="repeats"),
    ],
)
@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"n": 3, "stream": True}, id="plain"),
        pytest.param(STREAM_WITH_USAGE, id="include-usage"),
    ],
)
def test_templates_equal_the_full_path_on_chat_streams(
    body: dict[str, Any], contents: list[Any]
) -> None:
    p = plan(body)
    streams = [
        vllm_stream(p, pos, contents[pos:] + contents[:pos]) for pos in range(len(p.children))
    ]
    fast, full = replay(p, interleave(streams))
    assert fast == full


def test_templates_equal_the_full_path_with_vendor_fields_and_a_varying_one() -> None:
    p = plan({"n": 2, "stream": True})
    streams = []
    for pos in range(2):
        cid = f"chatcmpl-{p.children[pos].request_id}"
        streams.append(
            [chunk(cid, 9, " token", system_fingerprint="fp", ts=1.0 + i / 8) for i in range(10)]
            + [chunk(cid, 9, " changed", system_fingerprint="fp", ts=3.0)]
            + [chunk(cid, 9, " token", system_fingerprint="fp", ts=4 + i) for i in range(3)]
        )
    fast, full = replay(p, interleave(streams))
    assert fast == full


def test_templates_equal_the_full_path_on_completions_and_sorted_keys() -> None:
    p = plan({"prompt": ["a", "b"], "n": 2, "stream": True}, completions=True)
    streams = []
    for pos in range(4):
        cid = f"cmpl-{p.children[pos].request_id}"
        streams.append(
            [
                orjson.dumps(
                    {
                        "choices": [
                            {"finish_reason": None, "index": 0, "logprobs": None, "text": t}
                        ],
                        "created": 3,
                        "id": cid,
                        "model": "m",
                        "object": "text_completion",
                    }
                )
                for t in ["a", "b", "c", "d", "e"]
            ]
        )
    fast, full = replay(p, interleave(streams))
    assert fast == full


def generate_stream(p: Plan, pos: int, tokens: list[int], **extra: Any) -> list[bytes]:
    """Child ``pos``'s stream as vLLM's generate sends it: one token id a chunk."""
    rid = f"generate-tokens-{p.children[pos].request_id}"

    def step(token: int, finish: str | None = None) -> bytes:
        choice = {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": [token],
                  "routed_experts": None, "sampling_mask": None, "weight_versions": None,
                  "logprobs": None}  # fmt: skip
        return orjson.dumps({"request_id": rid, "usage": None, "output_mode": "tokens",
                             "choices": [choice], **extra})  # fmt: skip

    completion = {"prompt_tokens": 3, "completion_tokens": len(tokens), "total_tokens": 3}
    return [
        *(step(t) for t in tokens[:-1]),
        step(tokens[-1], "length"),
        orjson.dumps(
            {"request_id": rid, "usage": completion, "output_mode": "tokens", "choices": []}
        ),
        b"[DONE]",
    ]


def test_generate_token_chunks_are_stitched_from_templates_equal_to_the_full_path() -> None:
    body = {"token_ids": [1], "sampling_params": {"n": 3}, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    p = plan_request(body, "abc", 10, endpoint="generate")
    assert p is not None
    tokens = [[7 * pos + i for i in range(10)] for pos in range(3)]
    steps = interleave([generate_stream(p, pos, tokens[pos]) for pos in range(3)])
    fast, full = replay(p, steps)
    assert fast == full
    # The first two token chunks (the second teaches the template), the finishing one, the
    # usage chunk and [DONE] take the full path; the other seven come from the template.
    assert full_path_chunks(p, steps) == 5 * 3


def test_templates_equal_the_full_path_when_the_envelope_changes_mid_stream() -> None:
    p = plan({"n": 2, "stream": True})
    cid = f"chatcmpl-{p.children[0].request_id}"
    steps: list[Step] = [(0, chunk(cid, 9, c), "message") for c in "abcd"]
    steps += [
        (0, chunk(cid, 10, "e"), "message"),
        (0, chunk(cid, 9, "f", model="other"), "message"),
    ]
    steps += [(0, chunk("chatcmpl-other", 9, "g"), "message"), (0, chunk(cid, 9, "h"), "message")]
    moved = orjson.loads(chunk(cid, 9, "i"))
    moved["choices"][0]["index"] = 1
    steps += [(0, orjson.dumps(moved), "message"), (0, chunk(cid, 9, "j"), "event-name")]
    steps += [
        (0, chunk(cid, 9, "k", usage=usage(1, 1)), "message"),
        (1, chunk(cid, 9, "l"), "message"),
    ]
    fast, full = replay(p, steps)
    assert fast == full


def test_templates_equal_the_full_path_on_crafted_bytes_around_the_value() -> None:
    p = plan({"n": 2, "stream": True})
    cid = f"chatcmpl-{p.children[0].request_id}"
    warm = [chunk(cid, 9, c) for c in "abc"]
    head, tail = chunk(cid, 9, "SLOT").split(b'"SLOT"')
    values = [
        b'"x","role":"assistant"', b'"x"},"finish_reason":"stop","x":{"y":"z"', b'"x","index":5',
        b' "spaced" ', b'"caf\xc3"', b'"\\u00e9"', b"1e3", b"-0", b"true", b"null", b"{}", b"[]",
        b'"unterminated', b"", b'"a" "b"', b'"ok"',
    ]  # fmt: skip
    steps: list[Step] = [(0, data, "message") for data in warm]
    steps += [(0, head + value + tail, "message") for value in values]
    steps += [(0, head[:-3], "message")]
    for step in steps:
        fast, full = replay(p, steps[: steps.index(step) + 1])
        assert fast == full


@pytest.mark.parametrize(
    "spelling",
    [
        pytest.param(b'data: %s\ndata: "TOKEN"%s\n\n', id="multi-line-data-event"),
        pytest.param(b'data: %s\r\ndata: "TOKEN"%s\r\n\r\n', id="multi-line-crlf"),
        pytest.param(b'data: %s "TOKEN" %s\n\n', id="spaces-around-the-value"),
        pytest.param(b'data: %s"TOK\\u0045N"%s\n\n', id="escaped-letter"),
    ],
)
def test_a_token_spelled_otherwise_is_sent_as_one_line_of_the_full_paths_json(
    spelling: bytes,
) -> None:
    """Issue 17 item 8: a multi-line ``data:`` event once came out as a broken one-line event
    (a newline inside it): the token was lost to the client's SSE parser, the event not JSON."""
    p = plan({"n": 2, "stream": True})
    cid = f"chatcmpl-{p.children[0].request_id}"
    decoder, s = SSEDecoder(), StreamStitcher(p)
    for token in "abc":  # teach child 0 its template
        for data, event in decoder.feed_raw(b"data: " + chunk(cid, 9, token) + b"\n\n"):
            s.chunk(0, data, event)
    head, tail = chunk(cid, 9, "TOKEN").split(b'"TOKEN"')
    out = b"".join(
        s.chunk(0, data, event) or b"" for data, event in decoder.feed_raw(spelling % (head, tail))
    )
    assert out.count(b"\n") == 2
    assert one_event(out)["choices"][0]["delta"] == {"content": "TOKEN"}
    assert out == b"data: " + chunk("chatcmpl-abc", 9, "TOKEN") + b"\n\n"


def test_templates_equal_the_full_path_on_non_canonical_json_and_continuous_usage() -> None:
    body = {
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    p = plan(body)
    streams = []
    for pos in range(2):
        cid = f"chatcmpl-{p.children[pos].request_id}"
        spaced = [orjson.loads(chunk(cid, 9, c)) for c in "abcdef"]
        streams.append([f"{s}".replace("'", '"').replace("None", "null").encode() for s in spaced])
        streams.append([chunk(cid, 9, c, usage=usage(3, i)) for i, c in enumerate("abcdef")])
    fast, full = replay(p, [(pos % 2, data, event) for pos, data, event in interleave(streams)])
    assert fast == full


def test_the_pacer_chunk_is_stitched_from_a_template_equal_to_the_full_path() -> None:
    from bench.pacer import chunk as pacer_chunk

    p = plan({"n": 4, "stream": True})
    streams = [
        [
            pacer_chunk(i / 20)[6:-2].replace(
                b"chatcmpl-pacer", f"chatcmpl-{c.request_id}".encode()
            )
            for i in range(20)
        ]
        for c in p.children
    ]
    fast, full = replay(p, interleave(streams))
    assert fast == full
    # each child's first two chunks; the second teaches its template
    assert full_path_chunks(p, interleave(streams)) == 2 * 4


def test_a_number_spelled_otherwise_is_respelled_by_the_template() -> None:
    from bench.pacer import chunk as pacer_chunk

    p = plan({"n": 2, "stream": True})
    cid = f"chatcmpl-{p.children[0].request_id}".encode()
    # the pacer writes "%.6f": orjson writes 1.500000 as 1.5 and 1.540000 as 1.54
    times = [1.512345, 1.5, 1.523456, 1.534567, 1.54, 1.556789]
    steps = [(0, pacer_chunk(at)[6:-2].replace(b"chatcmpl-pacer", cid), "message") for at in times]
    fast, full = replay(p, steps)
    assert fast == full
    assert b'"ts":1.54}' in fast[4]
    assert full_path_chunks(p, steps) == 2  # the first, and the one it learns from


def test_a_vllm_stream_is_stitched_from_templates() -> None:
    p = plan({"n": 2, "stream": True})
    steps = interleave([vllm_stream(p, pos, [f" tok{i}" for i in range(10)]) for pos in (0, 1)])
    # the role chunk, two content chunks, the finishing chunk, usage and [DONE] per child
    assert full_path_chunks(p, steps) == 6 * 2


def full_path_chunks(p: Plan, steps: list[Step]) -> int:
    s = StreamStitcher(p)
    for pos, data, event in steps:
        s.chunk(pos, data, event)
    return s.rewrites


# --- fuzzed streams ---

TEXT = st.one_of(
    st.text(max_size=6),
    st.sampled_from([" tok", " tok", "", "\\", '"', "\n", "/", "caf\u00e9", "\u2028", "\x00\x7f"]),
)
WHITESPACE = st.sampled_from([b" ", b"\n", b"\t", b"\n \n"])  # no CR: SSE data cannot hold one
LINE_END = st.sampled_from([b"\n", b"\n", b"\r\n", b"\r"])
EXTRA_LINE = st.sampled_from([b": ping", b":", b"id: 7", b"retry: 10", b"event: message", b"id"])
_SLOT = "\x00slot\x00"


@st.composite
def spelled(draw: st.DrawFn, payload: dict[str, Any], slot: tuple[str | int, ...]) -> bytes:
    """``payload`` as JSON: mostly as orjson writes it, else spelled some other valid way."""
    how = draw(
        st.sampled_from(["orjson"] * 30 + ["ascii", "spaced", "reordered"] + ["value", "cut"] * 3)
    )
    if how == "ascii":  # \\uXXXX for every non-ASCII character
        return json.dumps(payload, separators=(",", ":")).encode()
    if how == "spaced":
        return json.dumps(payload, ensure_ascii=False).encode()
    if how == "reordered":
        return orjson.dumps(dict(reversed(payload.items())))
    raw = orjson.dumps(payload)
    if how == "cut":  # a multi-line event: a line break after a comma, colon or bracket
        places = [at for at in range(1, len(raw)) if raw[at - 1] in b",:{["]
        at = draw(st.sampled_from(places) if draw(st.integers(0, 9)) else st.just(len(raw) // 2))
        return raw[:at] + b"\n" + raw[at:]
    if how == "value":  # the varying value alone spelled another way, the rest as learned
        parent: Any = payload
        for key in slot[:-1]:
            parent = parent[key]
        value = parent[slot[-1]]
        parent[slot[-1]] = _SLOT
        head, tail = orjson.dumps(payload).split(orjson.dumps(_SLOT))
        parent[slot[-1]] = value
        return head + draw(value_spelling(value)) + tail
    return raw


def value_spelling(value: Any) -> st.SearchStrategy[bytes]:
    canonical = orjson.dumps(value)
    spellings = [
        st.tuples(WHITESPACE, st.just(canonical)).map(b"".join),
        st.tuples(st.just(canonical), WHITESPACE).map(b"".join),
        st.just(json.dumps(value).encode()),
    ]
    if isinstance(value, str):
        spellings.append(st.just(canonical.replace(b"/", b"\\/")))
        spellings.append(st.just(b'"' + "".join(f"\\u{ord(c):04X}" for c in value).encode() + b'"'))
    if isinstance(value, float):
        spellings += [st.just(b"%.6f" % value), st.just(b"%E" % value), st.just(b"%r" % value)]
    return st.one_of(spellings)


@st.composite
def child_events(draw: st.DrawFn, planned: Plan, pos: int, chat: bool) -> list[tuple[bytes, str]]:
    """One child's events: (data as sent, event type)."""
    envelope: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{planned.children[pos].request_id}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": draw(st.sampled_from([7, 7, 8])),
        "model": "m",
    }
    continuous = planned.continuous_usage and draw(st.integers(0, 3)) == 0
    vendor: dict[str, Any] = draw(st.sampled_from([{}, {"system_fingerprint": "fp"}, {"ts": 1.5}]))

    def payload(text: Any, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = (
            {"delta": {"role": "assistant", "content": text} if role else {"content": text}}
            if chat
            else {"text": text}
        )
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": finish}
        out: dict[str, Any] = {**envelope, "choices": [choice], **vendor}
        if continuous:
            out["usage"] = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
        return out

    text_slot: tuple[str | int, ...] = ("choices", 0, "delta" if chat else "text")
    text_slot += ("content",) if chat else ()
    events: list[tuple[bytes, str]] = []
    if chat and draw(st.booleans()):
        events.append((draw(spelled(payload("", role=True), text_slot)), "message"))
    for _ in range(draw(st.integers(0, 16))):
        if "ts" in vendor and draw(st.booleans()):  # the pacer's chunk: only a number varies
            number = draw(st.floats(0, 1e6, allow_nan=False).map(lambda x: round(x, 6)))
            paced = {**payload(" token"), "ts": number}
            events.append((draw(spelled(paced, ("ts",))), "message"))
        else:
            events.append((draw(spelled(payload(draw(TEXT)), text_slot)), "message"))
        if draw(st.integers(0, 150)) == 0:
            events.append(draw(a_failure()))
    if draw(st.integers(0, 11)):
        events.append((orjson.dumps(payload(None if chat else "", "stop")), "message"))
        usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
        if draw(st.booleans()):
            events.append((orjson.dumps({**envelope, "choices": [], "usage": usage}), "message"))
        if draw(st.booleans()):
            events.append((b"[DONE]", "message"))
    return events


def a_failure() -> st.SearchStrategy[tuple[bytes, str]]:
    return st.sampled_from(
        [
            (b'{"error":{"message":"boom"}}', "error"),
            (b'{"error":{"message":"boom"}}', "message"),
            (b"not json", "message"),
            (b"[1]", "message"),
        ]
    )


@st.composite
def framed(draw: st.DrawFn, data: bytes, kind: str) -> bytes:
    """One event as SSE bytes: a ``data:`` line per line of ``data``, any line ends, extra lines."""
    end = draw(LINE_END)
    lines = [b"event: " + kind.encode()] if kind != "message" else []
    for line in data.split(b"\n"):
        if draw(st.integers(0, 7)) == 0:
            lines.append(draw(EXTRA_LINE))
        lines.append((b"data:" if draw(st.integers(0, 7)) == 0 else b"data: ") + line)
    if draw(st.integers(0, 7)) == 0:
        lines.append(draw(EXTRA_LINE))
    blank = draw(LINE_END) if draw(st.integers(0, 3)) == 0 else end
    if end == b"\r" and blank == b"\n" and draw(st.integers(0, 9)):
        blank = b"\r"  # mostly: CR then LF is one line end, which runs two events together
    return b"".join(line + end for line in lines) + blank


@st.composite
def child_stream(draw: st.DrawFn, planned: Plan, pos: int, chat: bool) -> list[bytes]:
    """One child's bytes cut into network reads."""
    frames = [draw(framed(data, kind)) for data, kind in draw(child_events(planned, pos, chat))]
    if frames and draw(st.integers(0, 9)) == 0:
        frames[0] = b"\xef\xbb\xbf" + frames[0]
    if draw(st.booleans()):  # one read per event, as servers mostly send
        return frames
    raw = b"".join(frames)
    cuts = draw(st.lists(st.integers(0, max(len(raw) - 1, 0)), max_size=len(frames) * 2 + 2))
    offsets = sorted({0, len(raw), *cuts})
    return [raw[a:b] for a, b in itertools.pairwise(offsets)]


@st.composite
def streams(draw: st.DrawFn) -> tuple[Plan, list[tuple[int, bytes | None]]]:
    """A plan and every child's reads, interleaved; None is a child's end of stream."""
    chat = draw(st.integers(0, 3)) > 0
    body: dict[str, Any] = {"n": draw(st.integers(2, 3)), "stream": True}
    options = draw(st.sampled_from([{}, {"include_usage": True}, {"continuous_usage_stats": True}]))
    if options:
        body["stream_options"] = {"include_usage": True, **options}
    planned = plan_request(body, "abc", 10, endpoint="chat" if chat else "completions")
    assert planned is not None
    queues: list[list[bytes | None]] = [
        [*draw(child_stream(planned, pos, chat)), None] for pos in range(len(planned.children))
    ]
    order = draw(st.lists(st.integers(0, len(queues) - 1), max_size=60))
    reads: list[tuple[int, bytes | None]] = []
    for pos in order + [pos for pos, q in enumerate(queues) for _ in q]:
        if queues[pos]:
            reads.append((pos, queues[pos].pop(0)))
    return planned, reads


def stitch(
    stitcher: Stitching, decoders: Sequence[Decoding], reads: list[tuple[int, bytes | None]]
) -> list[Any]:
    """What the client is sent, as ``sink.merge`` sends it: chunk by chunk, then the tail."""
    sent: list[Any] = []
    try:
        for pos, read in reads:
            decoder = decoders[pos]
            for data, kind in decoder.feed_raw(read) if read is not None else decoder.close_raw():
                sent.append(stitcher.chunk(pos, data, kind))
            if read is None and not stitcher.finished(pos):
                raise StreamError(plan_index(stitcher, pos), "stream ended before finishing")
    except StreamError as error:
        return [*sent, ("error", error.choice, error.reason)]
    except SSEError as error:
        return [*sent, ("sse error", str(error))]
    return [*sent, stitcher.tail(), stitcher.chunks]


def plan_index(stitcher: Stitching, pos: int) -> int:
    return stitcher.plan.children[pos].index


@settings(max_examples=EXAMPLES, deadline=None)
@given(streams())
def test_templates_send_the_bytes_the_full_path_sends(
    case: tuple[Plan, list[tuple[int, bytes | None]]],
) -> None:
    planned, reads = case
    count = len(planned.children)
    fast = Counted(planned)
    got = stitch(fast, [SSEDecoder() for _ in range(count)], reads)
    want = stitch(FullPath(planned), [LineByLine() for _ in range(count)], reads)
    hypothesis.event("templated chunks" if fast.filled else "no templated chunk")
    assert got == want
