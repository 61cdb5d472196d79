"""Differential fuzzing of the byte templates against the full path (issue 17 item 8).

Child streams as a server might send them (token chunks of any text, multi-line ``data:``
events, JSON whitespace, escapes, number spellings and key orders orjson would not write, LF, CRLF
and CR line ends, comments, ``id``/``event``/``retry`` fields, a BOM, role, finishing, usage and
error chunks), split into any network reads and interleaved, go through the stitcher twice: with
templates and the decoder's fast paths, and through the full path with the line-by-line decoder.
What the client would be sent must be the same bytes.

``N_PROXY_FUZZ_EXAMPLES=5000 pytest tests/test_template.py`` runs it longer than CI does.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import orjson
from hypothesis import event, given, settings
from hypothesis import strategies as st

from proxy.plan import Plan, plan_request
from proxy.sse import Event, RawEvent, SSEDecoder, SSEError
from proxy.stitch import StreamError, StreamStitcher

EXAMPLES = int(os.environ.get("N_PROXY_FUZZ_EXAMPLES", "200"))


class FullPath(StreamStitcher):
    """Every chunk parsed, rewritten and serialized: what the templates must equal."""

    def chunk(self, pos: int, data: bytes, event: str = "message") -> bytes | None:
        return self._rewrite(pos, data, event)


class Counted(StreamStitcher):
    """The stitcher as it runs, counting the chunks that a template stitched."""

    rewrites = 0
    filled = 0

    def chunk(self, pos: int, data: bytes, event: str = "message") -> bytes | None:
        rewrites = self.rewrites
        out = super().chunk(pos, data, event)
        self.filled += self.rewrites == rewrites
        return out

    def _rewrite(self, pos: int, data: bytes, event: str) -> bytes | None:
        self.rewrites += 1
        return super()._rewrite(pos, data, event)


class LineByLine(SSEDecoder):
    """The decoder's general path only: no whole-event fast path, data decoded and re-encoded."""

    __slots__ = ()

    def _whole_data_events(self, chunk: bytes) -> list[Event] | None:
        return None

    def feed_raw(self, chunk: bytes) -> list[RawEvent]:
        return [(e.data.encode(), e.event) for e in self.feed(chunk)]


# --- what a child sends ---

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
        parent = payload
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
def child_events(draw: st.DrawFn, plan: Plan, pos: int, chat: bool) -> list[tuple[bytes, str]]:
    """One child's events: (data as sent, event type)."""
    envelope = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{plan.children[pos].request_id}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": draw(st.sampled_from([7, 7, 8])),
        "model": "m",
    }
    continuous = plan.continuous_usage and draw(st.integers(0, 3)) == 0
    vendor = draw(st.sampled_from([{}, {"system_fingerprint": "fp"}, {"ts": 1.5}]))

    def payload(text: Any, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = (
            {"delta": {"role": "assistant", "content": text} if role else {"content": text}}
            if chat
            else {"text": text}
        )
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": finish}
        out = {**envelope, "choices": [choice], **vendor}
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
            chunk = {**payload(" token"), "ts": number}
            events.append((draw(spelled(chunk, ("ts",))), "message"))
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
def child_stream(draw: st.DrawFn, plan: Plan, pos: int, chat: bool) -> list[bytes]:
    """One child's bytes cut into network reads."""
    frames = [draw(framed(data, kind)) for data, kind in draw(child_events(plan, pos, chat))]
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
    planned = plan_request(body, "abc", 10, completions=not chat)
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
    stitcher: StreamStitcher, decoders: list[SSEDecoder], reads: list[tuple[int, bytes | None]]
) -> list[Any]:
    """What the client is sent, as ``fanout._merge`` sends it: chunk by chunk, then the tail."""
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


def plan_index(stitcher: StreamStitcher, pos: int) -> int:
    return stitcher.plan.children[pos].index


@settings(max_examples=EXAMPLES, deadline=None)
@given(streams())
def test_templates_send_the_bytes_the_full_path_sends(
    case: tuple[Plan, list[tuple[int, bytes | None]]],
) -> None:
    plan, reads = case
    count = len(plan.children)
    fast = Counted(plan)
    got = stitch(fast, [SSEDecoder() for _ in range(count)], reads)
    want = stitch(FullPath(plan), [LineByLine() for _ in range(count)], reads)
    event("templated chunks" if fast.filled else "no templated chunk")
    assert got == want
