"""The compiled build against its own source, in one process: each module setup.py compiles is
loaded a second time from its ``.py`` beside the compiled one, and both are fed the same fuzz
inputs: SSE streams cut into reads anywhere, children's streams through the stitcher and its
byte templates, chunked bodies through the framing read without the parser and through an
upstream connection relaying them. They must answer alike, byte for byte, failures included.

The modules that do I/O (the client sink, the mailbox, the stream's writer, the fan-out) are
run by the whole suite on each build instead (.ci/run): their behaviour is the suite's.

In the pure build the two copies are the same code: its run of this file skips, and the
compiled build's run (which .ci/run makes first) checks.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings

from proxy.core import sse as compiled_sse
from proxy.core import stitch as compiled_stitch
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
    "proxy.core.sse",
    "proxy.core.template",
    "proxy.core.stitch",
    "proxy.http.chunks",
    "proxy.http.response",
    "proxy.http.connection",
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
    "proxy.core.sse": compiled_sse,
    "proxy.core.stitch": compiled_stitch,
    "proxy.http.chunks": compiled_chunks,
    "proxy.http.response": compiled_response,
    "proxy.http.connection": compiled_connection,
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

    def framed(data: bytes, size: int) -> bool:
        written.append(("as it came", data, size))
        return False

    async def drain() -> None:
        raise AssertionError("never full")

    pending = iter(cut)
    for data in pending:
        upstream.data_received(data)
        if answer.head.done():
            break
    task = asyncio.ensure_future(answer.relay(write, lambda: False, drain, framed))
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
