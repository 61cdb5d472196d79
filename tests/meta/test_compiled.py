"""The compiled build against its own source, in one process: each module setup.py compiles is
loaded a second time from its ``.py`` beside the compiled one, and both are fed the same fuzz
inputs: SSE streams cut into reads anywhere, children's streams through the stitcher and its
byte templates, chunked bodies through the framing read without the parser and through an
upstream connection relaying them. They must answer alike, byte for byte, failures included.

The per-request core (the plan, header filtering, the answer's facts, the usage merge) is fed
random bodies, header sets and answers the same way. The modules that do I/O or keep state over
time (the client sink, the mailbox, the stream's writer, the fan-out, the pool, the slots, the
replicas, the retry budget, the plain metrics) are run by the whole suite on each build instead
(.ci/run): their behaviour is the suite's.

In the pure build the two copies are the same code: its run of this file skips, and the
compiled build's run (which .ci/run makes first) checks.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from multidict import CIMultiDict

from proxy.core import answer as compiled_answer
from proxy.core import headers as compiled_headers
from proxy.core import plan as compiled_plan
from proxy.core import remembered as compiled_remembered
from proxy.core import sse as compiled_sse
from proxy.core import stitch as compiled_stitch
from proxy.core import usage as compiled_usage
from proxy.core.plan import Plan
from proxy.http import chunks as compiled_chunks
from proxy.http import connection as compiled_connection
from proxy.http import response as compiled_response
from proxy.http import stream_path_compiled
from tests.core.test_sse import REALISTIC
from tests.core.test_template import EXAMPLES, streams
from tests.http.test_chunks import HEAD, Transport, a_body, reads

ROOT = Path(__file__).resolve().parents[2]
# The pure modules, loaded in this order: each one's siblings in its own layer are the copies
# loaded before it (``from proxy.core.template import ...`` in stitch.py takes the copy).
ORDER = (
    "proxy.core.remembered",
    "proxy.core.sse",
    "proxy.core.template",
    "proxy.core.stitch",
    "proxy.http.chunks",
    "proxy.http.response",
    "proxy.http.connection",
    "proxy.core.plan",
    "proxy.core.usage",
    "proxy.core.answer",
    "proxy.core.headers",
)

pytestmark = pytest.mark.skipif(
    not stream_path_compiled(),
    reason="the pure build: its two copies are the same code (the compiled build's run checks)",
)


@contextmanager
def standing_in(copies: dict[str, ModuleType]) -> Iterator[None]:
    """The copies stand in for their compiled modules (while the next copy loads)."""
    saved = {name: sys.modules[name] for name in copies}
    sys.modules.update(copies)
    try:
        yield
    finally:
        sys.modules.update(saved)


def load_pure(names: Sequence[str]) -> dict[str, ModuleType]:
    """Each module of ``names`` from its ``.py``, as a module of its own beside the compiled one
    (which stays what ``import`` gives everyone else)."""
    copies: dict[str, ModuleType] = {}
    for name in names:
        path = ROOT / (name.replace(".", "/") + ".py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        with standing_in({**copies, name: module}):
            spec.loader.exec_module(module)
        assert (module.__file__ or "").endswith(".py")
        copies[name] = module
    return copies


PURE = load_pure(ORDER)
COMPILED = {
    "proxy.core.remembered": compiled_remembered,
    "proxy.core.sse": compiled_sse,
    "proxy.core.stitch": compiled_stitch,
    "proxy.http.chunks": compiled_chunks,
    "proxy.http.response": compiled_response,
    "proxy.http.connection": compiled_connection,
    "proxy.core.plan": compiled_plan,
    "proxy.core.usage": compiled_usage,
    "proxy.core.answer": compiled_answer,
    "proxy.core.headers": compiled_headers,
}


def test_the_copies_are_the_source_and_the_build_is_compiled() -> None:
    for name, module in COMPILED.items():
        assert not (module.__file__ or "").endswith(".py"), name
        assert PURE[name] is not module


def outcome(call: Any, *args: Any) -> Any:
    """What a call gives, or its failure as its class's name and message."""
    try:
        return call(*args)
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))


def decode(sse: ModuleType, pieces: Sequence[bytes], limit: int) -> list[Any]:
    """Every piece fed, what each gave and the comment it left, then the close."""
    decoder = sse.SSEDecoder(max_event_bytes=limit)
    out: list[Any] = []
    for piece in pieces:
        out.append(outcome(decoder.feed_raw, piece))
        out.append(decoder.comment)
        decoder.comment = None
        if isinstance(out[-2], tuple):
            return out
    out.append(outcome(decoder.close_raw))
    return out


SSE_ALPHABET = [b"data: ", b"data:", b"event: x", b": ping", b"id: 1", b"\n", b"\r\n", b"\r",
                b"{\"a\": 1}", b"\xef\xbb\xbf", b"x" * 40, b"\xe2\x82\xac", b" "]  # fmt: skip


def test_the_sse_decoder_decodes_alike_on_streams_cut_anywhere() -> None:
    rng = random.Random(20261205)
    for case in range(400):
        stream = (
            REALISTIC
            if case % 4 == 0
            else b"".join(rng.choice(SSE_ALPHABET) for _ in range(rng.randint(1, 60)))
        )
        cuts = sorted(rng.sample(range(len(stream) + 1), min(len(stream), rng.randint(0, 8))))
        pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        limit = rng.choice([64, 1024, 1 << 20])
        assert decode(PURE["proxy.core.sse"], pieces, limit) == decode(
            compiled_sse, pieces, limit
        ), pieces


def stitched(
    sse: ModuleType, stitch: ModuleType, planned: Plan, reads: list[tuple[int, bytes | None]]
) -> list[Any]:
    """What the client is sent, chunk by chunk, then the tail; a failure as its name and
    message (each build raises its own copy of the class)."""
    stitcher = stitch.StreamStitcher(planned)
    decoders = [sse.SSEDecoder() for _ in planned.children]
    sent: list[Any] = []
    for pos, read in reads:
        decoder = decoders[pos]
        events = outcome(decoder.feed_raw, read) if read is not None else decoder.close_raw()
        if isinstance(events, tuple):
            return [*sent, events]
        for data, kind in events:
            sent.append(outcome(stitcher.chunk, pos, data, kind))
            if isinstance(sent[-1], tuple):
                return sent
        if read is None:
            sent.append(stitcher.finished(pos))
    return [*sent, stitcher.tail(), stitcher.chunks, stitcher.usage(), stitcher.finish_reasons()]


@settings(max_examples=EXAMPLES, deadline=None)
@given(streams())
def test_the_stitcher_and_its_templates_send_alike(
    case: tuple[Plan, list[tuple[int, bytes | None]]],
) -> None:
    planned, child_reads = case
    pure = stitched(PURE["proxy.core.sse"], PURE["proxy.core.stitch"], planned, child_reads)
    assert pure == stitched(compiled_sse, compiled_stitch, planned, child_reads)


def framing(chunks: ModuleType, data: bytes) -> tuple[int, list[bytes]]:
    size = chunks.whole_chunks(data)
    pieces: list[bytes] = []
    if size:
        chunks.chunk_pieces(data, pieces.append)
    return size, pieces


def test_the_chunk_framing_reads_alike_on_bodies_cut_anywhere() -> None:
    rng = random.Random(20261206)
    for _ in range(300):
        chunked, _ = a_body(rng)
        for data in reads(rng, chunked):
            body = data.removeprefix(HEAD)
            assert framing(PURE["proxy.http.chunks"], body) == framing(compiled_chunks, body)
    for _ in range(300):  # bytes that only look like chunks, now and then
        data = bytes(rng.choice(b"0123456789abcdefAF\r\n;x") for _ in range(rng.randint(1, 40)))
        assert framing(PURE["proxy.http.chunks"], data) == framing(compiled_chunks, data)


def test_the_framing_decision_is_alike_on_any_transfer_encoding() -> None:
    rng = random.Random(20261207)
    words = ["chunked", "Chunked", "identity", "gzip", "xchunked", "chun\u212aed", ";q=1", ""]
    for _ in range(1000):
        values = [
            rng.choice([",", ", ", " ", "\t", ",\t"]).join(rng.choices(words, k=rng.randint(1, 3)))
            for _ in range(rng.randint(1, 3))
        ]
        pure = PURE["proxy.http.chunks"].framing(values)
        assert pure == compiled_chunks.framing(values), values


async def relayed(connection: ModuleType, response: ModuleType, cut: list[bytes]) -> list[Any]:
    """``cut`` read by an upstream connection and relayed to a chunked client: what the client
    is written (framed pieces and whole chunks as they came), then how the response ended."""
    loop = asyncio.get_running_loop()
    upstream = connection.UpstreamConnection(loop, ("127.0.0.1", 1, None))
    upstream.connection_made(Transport())
    answer = response.UpstreamResponse(upstream, "GET", 1 << 20, True)
    upstream.begin(answer)
    written: list[Any] = []

    def write(data: bytes) -> bool:
        written.append(("piece", data))
        return False

    class Framed(response.FramedSink):  # type: ignore[name-defined,misc]
        def write_framed(self, data: bytes, size: int) -> bool:
            written.append(("as it came", data, size))
            return False

    async def drain() -> None:
        raise AssertionError("never full")

    pending = iter(cut)
    for data in pending:
        upstream.data_received(data)
        if answer.head.done():
            break
    task = asyncio.ensure_future(answer.relay(write, lambda: False, drain, Framed()))
    await asyncio.sleep(0)
    for data in pending:
        upstream.data_received(data)
    async with asyncio.timeout(30):
        failure = await asyncio.gather(task, return_exceptions=True)
    ended = [answer.state, answer.status, type(failure[0]).__name__, upstream.state]
    return [*written, ended]


async def test_an_upstream_connection_relays_alike_on_bodies_cut_anywhere() -> None:
    rng = random.Random(20261207)
    pure = (PURE["proxy.http.connection"], PURE["proxy.http.response"])
    for _ in range(200):
        chunked, _ = a_body(rng)
        cut = reads(rng, chunked)
        assert await relayed(*pure, cut) == await relayed(
            compiled_connection, compiled_response, cut
        ), cut


# The per-request core: values a client may send in each field, valid or not.
FIELDS: dict[str, list[Any]] = {
    "n": [1, 2, 3, 0, -1, 2.0, "2", True, None, 10**20, 1e300, 11],
    "seed": [None, 0, 5, -3, 2**63 - 1, 2**63, -(2**63), 1.5, "7", True, float(2**64)],
    "stream": [True, False, None, "true"],
    "stream_options": [None, {}, {"include_usage": True}, {"continuous_usage_stats": True}, [1]],
    "prompt": ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]], [], None, 5, ["a", 1]],
    "best_of": [None, 1, 2, 3, 0, "2", 2.5],
    "logprobs": [None, False, True, 0, 2],
    "sampling_params": [None, {"n": 2, "seed": 3}, {"n": 3}, {}, "x"],
    "messages": [[{"role": "user", "content": "x"}], "x"],
    "request_id": ["r-1", 7, " edge", None],
}


def a_request_body(rng: random.Random) -> dict[str, Any]:
    chosen = rng.sample(sorted(FIELDS), rng.randint(0, len(FIELDS)))
    return {name: rng.choice(FIELDS[name]) for name in chosen}


def planned_facts(plan: ModuleType, body: dict[str, Any], endpoint: str, cap: int) -> Any:
    """What plan_request makes of a body, as plain values (each build has its own classes)."""
    made = outcome(lambda: plan.plan_request(body, "p", 10, endpoint=endpoint, max_children=cap))
    if made is None or isinstance(made, tuple):
        return made
    children = [(c.index, c.prompt, c.body, c.request_id) for c in made.children]
    flags = [made.stream, made.include_usage, made.continuous_usage, made.keep_logprobs]
    return [made.parent_id, made.endpoint, made.n, made.best_of, made.prompts, flags, children]


def test_the_plan_is_alike_for_any_body() -> None:
    rng = random.Random(20261208)
    for _ in range(1500):
        body = a_request_body(rng)
        endpoint = rng.choice(["chat", "completions", "generate"])
        cap = rng.choice([2048, 4])
        pure = planned_facts(PURE["proxy.core.plan"], body, endpoint, cap)
        assert pure == planned_facts(compiled_plan, body, endpoint, cap), (body, endpoint)
        raw = json.dumps(body).encode() if rng.random() < 0.8 else rng.randbytes(8)
        pure_parse = outcome(PURE["proxy.core.plan"].parse_body, raw)
        assert pure_parse == outcome(compiled_plan.parse_body, raw), raw


HEADER_NAMES = ["Connection", "Keep-Alive", "TE", "Transfer-Encoding", "Content-Length", "Host",
                "X-Request-Id", "Authorization", "Accept-Encoding", "Content-Encoding", "Upgrade",
                "Proxy-Connection", "Proxy-Foo", "X-Foo", "Trailer", "Expect"]  # fmt: skip
HEADER_VALUES = ["close", "keep-alive, X-Foo", " Upgrade ,, x-foo", "gzip", "br, deflate;q=0.5",
                 "identity", "", "1", "a b", "GZIP , zstd"]  # fmt: skip


def filtered(headers: ModuleType, incoming: CIMultiDict[str], injected: dict[str, str]) -> Any:
    return [
        list(headers.request_headers(incoming, injected).items()),
        list(headers.child_headers(incoming, injected).items()),
        list(headers.response_headers(incoming).items()),
        list(headers.rebased_headers(incoming, injected, {"X-Other": "1"}).items()),
        headers.client_request_id(incoming.get("X-Request-Id"), incoming.get("X-Foo")),
    ]


def test_the_headers_are_filtered_alike_for_any_set() -> None:
    rng = random.Random(20261209)
    for _ in range(1000):
        incoming: CIMultiDict[str] = CIMultiDict()
        for _ in range(rng.randint(0, 8)):
            name = rng.choice(HEADER_NAMES)
            incoming.add(rng.choice([name, name.lower(), name.upper()]), rng.choice(HEADER_VALUES))
        injected = dict(
            rng.sample([("Authorization", "Bearer k"), ("X-Foo", "set")], rng.randint(0, 2))
        )
        pure = filtered(PURE["proxy.core.headers"], incoming, injected)
        assert pure == filtered(compiled_headers, incoming, injected), incoming


USAGES: list[Any] = [None, "x", {}, {"prompt_tokens": 3, "completion_tokens": 4},
                     {"prompt_tokens": 3.0, "completion_tokens": True, "total_tokens": 9},
                     {"prompt_tokens": 5, "completion_tokens": 2,
                      "prompt_tokens_details": {"cached_tokens": 4},
                      "completion_tokens_details": {"reasoning_tokens": 1, "x": "y"}},
                     {"completion_tokens_details": [1], "prompt_tokens": -1}]  # fmt: skip


def an_answer(rng: random.Random) -> bytes:
    """A JSON answer, an SSE stream's tail, or bytes that are neither."""
    usage = rng.choice(USAGES)
    fields = {"id": rng.choice(["chatcmpl-1", 5, None]), "model": rng.choice(["m", None, 1])}
    if usage is not None:
        fields["usage"] = usage
    text = orjson.dumps(fields)
    kind = rng.randrange(4)
    if kind == 1:
        return b"data: " + text + b"\n\ndata: [DONE]\n\n"
    if kind == 2:
        return text[: rng.randint(0, len(text))]
    if kind == 3:
        return rng.randbytes(rng.randint(0, 30))
    return text


def facts(answer: ModuleType, usage: ModuleType, data: bytes, usages: list[Any]) -> Any:
    """The answer's facts, the merged usage and each usage's token counts (the values of either
    build, each of its own class, compared by their fields)."""
    heads = [0, len(usages) - 1] if usages else []
    found = outcome(answer.answer_facts, data)
    tokens = [outcome(usage.token_counts, u) for u in usages if isinstance(u, dict)]
    return [
        _fields(found, ("usage", "id", "model")),
        outcome(usage.merge_usage, usages, heads),
        [_fields(t, ("prompt", "completion", "cached", "reasoning")) for t in tokens],
    ]


def _fields(value: Any, names: tuple[str, ...]) -> Any:
    """A value's fields in order; a failure (``outcome``'s tuple) as it is."""
    return value if isinstance(value, tuple) else tuple(getattr(value, n) for n in names)


def test_the_answer_facts_and_the_usage_merge_are_alike() -> None:
    rng = random.Random(20261210)
    for _ in range(1500):
        data = an_answer(rng)
        usages = rng.choices(USAGES, k=rng.randint(0, 4))
        pure = facts(PURE["proxy.core.answer"], PURE["proxy.core.usage"], data, usages)
        assert pure == facts(compiled_answer, compiled_usage, data, usages), (data, usages)
