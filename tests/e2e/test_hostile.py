"""Hostile input: any JSON body, SSE split anywhere, bad bytes, smuggled ids, spoofed targets.

The proxy, a fake upstream and a victim listener run in one background event loop, so that the
synchronous hypothesis tests can drive them over real sockets. The fake upstream never fails,
so any 5xx seen here is one the proxy caused itself.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import socket
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yarl import URL

from proxy.config.models import Listen, single_upstream_config
from proxy.server.process import Server
from tests.support.client import Answer, post, sse_payloads
from tests.support.logs import LogCapture, capture_logs
from tests.support.rawhttp import parse_raw
from tests.support.rawupstream import RawUpstream
from tests.support.servers import LoopThread, Servers
from tests.support.upstreams import RecordingUpstream, Seen

T = TypeVar("T")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_BODY = 1 << 20
MAX_CONCURRENCY = 16
CONFIG_SECRET = "cfg-SECRET-6"
# Keys the proxy rewrites or drops (docs/behaviour.md#children, #best-of); vendor fields take
# every other name.
OWNED = frozenset({"n", "seed", "request_id", "kv_transfer_params", "prompt", "best_of"})
CHILD_ID = re.compile(r"(\d+)_(.+?)(?:-(\d+))?")
VISIBLE = re.compile(r"[\x21-\x7e]+")
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same examples on every run: a failure is reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- the fake upstream, the victim, and the loop they run in ---------------------------------


class Mirror(RecordingUpstream):
    """Answers any child with a well-formed completion naming the seed it got, or plays a script.

    Scripts are keyed by parent request id: one list of byte pieces per child.
    """

    def __init__(self) -> None:
        super().__init__()
        self.scripts: dict[str, list[list[bytes]]] = {}

    async def respond(self, request: web.Request) -> web.StreamResponse:
        script = self._script(request.headers.get("X-Request-Id", ""))
        if script is not None:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for piece in script:
                await response.write(piece)
            await response.write_eof()
            return response
        if request.path not in (CHAT, COMPLETIONS):
            return web.json_response({"path": request.path})
        return await self._answer_seed(request, await request.read())

    def _script(self, rid: str) -> list[bytes] | None:
        if rid in self.scripts:
            return self.scripts[rid][0]
        match = CHILD_ID.fullmatch(rid)
        if match and match.group(2) in self.scripts:
            return self.scripts[match.group(2)][int(match.group(1))]
        return None

    async def _answer_seed(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # the fake must not fail where the proxy did not
            body = None
        body = body if isinstance(body, dict) else {}
        chat = request.path == CHAT
        text = json.dumps(body.get("seed"))
        rid = request.headers.get("X-Request-Id", "x")
        envelope = {"id": f"cmpl-{rid}", "created": 1, "model": "m"}
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        if body.get("stream") is not True:
            content = (
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            choice = {"index": 0, **content, "finish_reason": "stop"}
            return web.json_response({**envelope, "choices": [choice], "usage": usage})
        pieces = [({"content": text}, None), ({}, "stop")]
        chunks = [
            {**envelope, "choices": [{"index": 0, **_delta(chat, d), "finish_reason": f}]}
            for d, f in pieces
        ]
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            chunks.append({**envelope, "choices": [], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def children_of(self, parent: str) -> list[Seen]:
        def belongs(seen: Seen) -> bool:
            match = CHILD_ID.fullmatch(seen.request_id)
            return match is not None and match.group(2) == parent

        return [s for s in self.seen if belongs(s)]


def _delta(chat: bool, delta: dict[str, str]) -> dict[str, Any]:
    return {"delta": delta} if chat else {"text": delta.get("content", "")}


class Stack:
    """The mirror, a victim listener that only counts its connections, and the whole proxy
    server in front of the mirror: ``Servers`` on a ``LoopThread``, so that the synchronous
    hypothesis tests can drive them (``post``, ``get``), and one stack for the whole module,
    so that hundreds of examples do not each start servers. Its client (a fresh connection
    per request) runs on that loop too."""

    def __init__(self) -> None:
        self.thread = LoopThread()
        self.servers = Servers()
        self.mirror = Mirror()
        self.victim = RawUpstream()
        self.port = self.admin_port = 0
        self._http: aiohttp.ClientSession | None = None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.thread.run(coro, timeout=60)  # past the client's own bound

    @property
    def mirror_port(self) -> int:
        return int(self.mirror.url.rsplit(":", 1)[1])

    @property
    def victim_port(self) -> int:
        return int(self.victim.url.rsplit(":", 1)[1])

    async def start(self) -> None:
        await self.servers.start(self.mirror)
        await self.servers.start(self.victim)
        server = await self.start_proxy()
        self.port, self.admin_port = server.proxy_port, server.admin_port
        # A fresh connection per request, as a plain client's: none is reused after an error.
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))

    async def start_proxy(self, **overrides: Any) -> Server:
        config = single_upstream_config(
            self.mirror.url,
            listen=Listen(host="127.0.0.1", port=0),
            admin=Listen(host="127.0.0.1", port=0),
            max_body_bytes=MAX_BODY,
        )
        upstream = config.upstreams[0].model_copy(
            update={
                "headers": {"X-Upstream-Key": CONFIG_SECRET},
                "max_concurrency": MAX_CONCURRENCY,
                "max_queue": 1000,
            }
        )
        config = config.model_copy(update={"upstreams": (upstream,), **overrides})
        return await self.servers.server(config)

    def post(self, port: int, path: str, body: object, rid: str, **headers: str) -> Answer:
        """POST to ``port`` on the stack's loop and read the whole answer."""
        assert self._http is not None
        url = URL(f"http://127.0.0.1:{port}{path}", encoded=True)  # the query as written
        sent = {"Content-Type": "application/json", **headers}
        return self.run(post(self._http, str(url), body, rid, headers=sent))

    def get(self, port: int, path: str) -> Answer:
        async def get() -> Answer:
            assert self._http is not None
            async with self._http.get(f"http://127.0.0.1:{port}{path}") as response:
                return Answer(response.status, await response.read(), response.headers.copy())

        return self.run(get())

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.close()
        await self.servers.close()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    stack = Stack()
    stack.run(stack.start())
    yield stack
    stack.run(stack.stop())
    stack.thread.close()


@pytest.fixture
def capture() -> Iterator[LogCapture]:
    """Everything any logger says, exceptions included, as text."""
    with capture_logs(everything=True) as logs:
        yield logs


# --- clients: aiohttp for well-formed requests, raw sockets for everything else -------------


def post_json(stack: Stack, path: str, body: object, rid: str, **headers: str) -> Answer:
    """``body`` as JSON text with spaces, as most clients write it (bytes are sent as they are)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return stack.post(stack.port, path, raw, rid, **headers)


def raw_exchange(port: int, data: bytes) -> bytes:
    """Send raw bytes and read until the server closes; it may answer before reading them all.

    No half-close: a server may take a client's EOF for a disconnect and answer nothing.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def assert_openai_error(reply: Answer, status: int) -> dict[str, Any]:
    assert reply.status == status, reply
    body = orjson.loads(reply.body)
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None or isinstance(error["param"], str)
    return dict(error)


_ids = itertools.count()


def fresh_id(prefix: str) -> str:
    """A request id no other request of the module used: the fake upstream files by it."""
    return f"{prefix}{next(_ids)}"


# --- any JSON body --------------------------------------------------------------------------

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30])  # past what int64 JSON parsers read
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
n_values = (
    st.none()
    | st.integers(-2, 12)
    | st.sampled_from([True, False, 2.0, 2.5, "3", [2], {"n": 2}, 2**63, 2**64 - 1, 10**30])
    | json_values
)
seed_values = (
    st.none()
    | st.integers()
    | st.sampled_from([-1, 0, 2**63 - 1, 2**63 - 4, -(2**63), 2**64 - 1, 2**64, 10**30])
    | json_values
)
stream_values = st.booleans() | json_values
stream_options = (
    st.fixed_dictionaries(
        {}, optional={"include_usage": stream_values, "continuous_usage_stats": stream_values}
    )
    | json_values
)
prompts = (
    st.text(max_size=10)
    | st.lists(st.text(max_size=5), max_size=4)
    | st.lists(st.integers(0, 1000), max_size=4)
    | st.lists(st.lists(st.integers(0, 1000), max_size=3), max_size=3)
    | json_values
)
messages = st.just([{"role": "user", "content": "hi"}]) | json_values
vendor_keys = st.text(max_size=8).filter(lambda key: key not in OWNED and key != "stream")


def mostly(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``common`` three times in four, so that most bodies reach the fan-out paths."""
    return st.integers(0, 3).flatmap(lambda pick: common if pick else rare)


def bodies(chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    required = {
        "model": st.just("m"),
        "n": mostly(st.integers(2, 4), n_values),
        "stream": mostly(st.booleans(), stream_values),
    }
    optional: dict[str, st.SearchStrategy[Any]] = {
        "seed": mostly(st.integers(-3, 1000), seed_values),
        "stream_options": mostly(st.just({"include_usage": True}), stream_options),
        "request_id": st.text(max_size=20) | json_values,
        "kv_transfer_params": st.lists(json_values, max_size=4) | json_values,
    }
    if chat:
        optional["messages"] = messages
    else:
        optional["prompt"] = mostly(st.text(max_size=5), prompts)
    base = st.fixed_dictionaries(required, optional=optional)
    extra = st.dictionaries(vendor_keys, json_values, max_size=3)
    return st.builds(lambda b, e: {**e, **b}, base, extra)


def expected_seed(body: dict[str, Any], index: int) -> object:
    n = body["n"]
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed != -1:
        return seed + index % n
    return seed


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@FUZZ
@given(data=st.data())
def test_any_json_body_gets_an_openai_4xx_or_a_well_formed_answer_never_a_5xx(
    stack: Stack, path: str, data: st.DataObject
) -> None:
    body = data.draw(bodies(chat=path == CHAT), label="body")
    rid = fresh_id("h")
    reply = post_json(stack, path, body, rid)

    assert reply.status < 500, reply
    children = stack.mirror.children_of(rid)
    if reply.status >= 400:
        assert_openai_error(reply, 400)
        assert children == []
        return
    assert reply.status == 200
    passed = [s for s in stack.mirror.seen if s.headers.get("X-Request-Id") == rid]
    if passed:  # n missing, null or 1: the request unchanged (docs/behaviour.md#pass-through)
        assert children == []
        assert passed[0].body == json.dumps(body).encode()
        return
    assert is_int(body["n"])
    assert reply.headers["X-Request-Id"] == rid
    stream = body.get("stream") is True
    if stream:
        payloads = sse_payloads(reply.body)
        assert payloads[-1] == "[DONE]"
        assert payloads.count("[DONE]") == 1
        rest = payloads[:-1]
        if path == CHAT:
            # Every choice announced in index order before any other chunk; a completions
            # stream has no opening (docs/behaviour.md#opening).
            opening, rest = rest[: len(children)], rest[len(children) :]
            assert [p["choices"][0]["index"] for p in opening] == list(range(len(children)))
        choices = [c for p in rest for c in p["choices"] if c["finish_reason"] is None]
        usage_chunks = [p for p in payloads[:-1] if not p["choices"]]
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and options.get("include_usage") is True
        assert len(usage_chunks) == (1 if wants_usage else 0)
        if wants_usage:
            assert usage_chunks[0]["usage"]["completion_tokens"] == len(children)
    else:
        choices = orjson.loads(reply.body)["choices"]
    assert sorted(c["index"] for c in choices) == list(range(len(children)))
    for choice in choices:
        if path == COMPLETIONS:
            text = choice["text"]
        else:
            text = choice["delta"]["content"] if stream else choice["message"]["content"]
        assert json.loads(text) == expected_seed(body, choice["index"])


@FUZZ
@given(
    # Not the keys this test's body sets itself: those would be the body's, not the extra's.
    extra=st.dictionaries(
        vendor_keys.filter(lambda key: key not in ("model", "messages")), json_values,
        min_size=1, max_size=4,
    )
)  # fmt: skip
def test_fields_the_proxy_does_not_own_reach_every_child_unchanged(
    stack: Stack, extra: dict[str, Any]
) -> None:
    """Tools, logprobs, vendor fields... pass untouched, whatever JSON they hold
    (docs/behaviour.md#children)."""
    body = {**extra, "model": "m", "messages": [], "n": 2, "stream": False}
    rid = fresh_id("keep")
    reply = post_json(stack, CHAT, body, rid)
    assert reply.status == 200, reply
    children = stack.mirror.children_of(rid)
    assert len(children) == 2
    for child in children:
        got = json.loads(child.body)
        assert {k: got.get(k) for k in extra} == extra


@FUZZ
@given(body=bodies(chat=True), junk=st.binary(max_size=64))
def test_bodies_that_are_not_a_json_object_are_400(
    stack: Stack, body: dict[str, Any], junk: bytes
) -> None:
    for raw in (json.dumps([body]).encode(), json.dumps(body)[:-1].encode(), junk, b""):
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if isinstance(value, dict):
            continue
        rid = fresh_id("j")
        assert_openai_error(post_json(stack, CHAT, raw, rid), 400)
        assert stack.mirror.children_of(rid) == []


# Where 400 starts, by the depth of the nested "vendor" value (the body is one level deeper).
# Every body is parsed by orjson, which refuses more than 1024 levels. A fan-out writes each
# child again: orjson writes up to 254 levels, then json does, within Python's recursion limit
# (1000): past it the body is "nested too deeply". Where between 500 and 1000 json gives out
# depends on the stack it runs on, so it is not pinned here.
PARSE_LIMIT = "request body is not valid JSON: depth limit exceeded"
WRITE_LIMIT = "request body is nested too deeply"
NESTED = [
    *[(1, depth, None) for depth in (100, 254, 255, 1000, 1023)],
    *[(1, depth, PARSE_LIMIT) for depth in (1024, 5000)],
    *[(2, depth, None) for depth in (100, 252, 253, 254, 255, 500)],
    *[(2, depth, WRITE_LIMIT) for depth in (1000, 1023)],
    *[(2, depth, PARSE_LIMIT) for depth in (1024, 5000)],
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("n", "depth", "refused"), NESTED)
def test_deeply_nested_bodies_are_400_from_a_pinned_depth_and_never_a_5xx(
    stack: Stack, path: str, n: int, depth: int, refused: str | None
) -> None:
    nested = b"[" * depth + b"]" * depth
    base = b'"messages":[{"role":"user","content":"hi"}]' if path == CHAT else b'"prompt":"hi"'
    raw = b'{"model":"m",%s,"n":%d,"vendor":%s}' % (base, n, nested)
    rid = fresh_id("deep")
    reply = post_json(stack, path, raw, rid)
    if refused is not None:
        assert assert_openai_error(reply, 400)["message"].startswith(refused)
        assert stack.mirror.children_of(rid) == []
        assert stack.mirror.with_request_id(rid) == []
        return
    assert reply.status == 200, reply
    if n == 1:  # passed through, byte for byte
        (passed,) = stack.mirror.with_request_id(rid)
        assert passed.body == raw
        return
    children = stack.mirror.children_of(rid)
    assert len(children) == n
    for child in children:
        assert nested in child.body


def test_deeply_nested_bodies_elsewhere_pass_through_unparsed(stack: Stack) -> None:
    nested = b"[" * 5000 + b"]" * 5000
    raw = b'{"model":"m","input":"hi","vendor":%s}' % nested
    rid = fresh_id("deep")
    assert post_json(stack, "/v1/embeddings", raw, rid).status == 200
    (passed,) = stack.mirror.with_request_id(rid)
    assert passed.body == raw


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("messages", [{"role": "user", "content": f"m{i}"} for i in range(20_000)]),
        ("stop", ["x"] * 100_000),
        ("logit_bias", {str(i): 1 for i in range(20_000)}),
        ("vendor", list(range(100_000))),
    ],
)
def test_huge_arrays_are_forwarded_to_every_child_whole(
    stack: Stack, field: str, value: Any
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 7}
    body[field] = value
    rid = fresh_id("huge")
    reply = post_json(stack, CHAT, body, rid)
    assert reply.status == 200, reply
    assert [c["index"] for c in orjson.loads(reply.body)["choices"]] == [0, 1]
    for child in stack.mirror.children_of(rid):
        assert orjson.loads(child.body)[field] == value


def test_a_long_list_of_prompts_is_answered_whole(stack: Stack) -> None:
    prompts_list = [f"p{i}" for i in range(250)]
    body = {"model": "m", "prompt": prompts_list, "n": 4, "seed": 1}
    rid = fresh_id("many")
    reply = post_json(stack, COMPLETIONS, body, rid)
    assert reply.status < 500, reply
    if reply.status == 200:
        choices = orjson.loads(reply.body)["choices"]
        assert [c["index"] for c in choices] == list(range(1000))
        assert [json.loads(c["text"]) for c in choices[:8]] == [1, 2, 3, 4, 1, 2, 3, 4]
    else:
        assert_openai_error(reply, 400)


def test_one_request_never_holds_more_upstream_connections_than_max_concurrency(
    stack: Stack,
) -> None:
    """A list of prompts multiplies n; ``max_concurrency`` must still bound the upstream load."""
    server = stack.run(stack.start_proxy())
    body = {"model": "m", "prompt": [f"p{i}" for i in range(100)], "n": 4}
    rid = fresh_id("bound")
    reply = stack.post(server.proxy_port, COMPLETIONS, json.dumps(body).encode(), rid)
    assert reply.status < 500, reply
    children = stack.mirror.children_of(rid)
    if reply.status == 200:
        assert len(children) == 400
    # A fresh proxy opens a new upstream connection only when all of its others are busy; the
    # one extra is its health probe's.
    assert len({c.peer_port for c in children}) <= MAX_CONCURRENCY + 1


# --- SSE byte streams split anywhere, through the whole proxy ---------------------------------


@dataclass(frozen=True)
class ChildStream:
    tokens: list[str]
    eol: bytes
    pings: bool
    split_data: bool  # the JSON spread over two data: lines (joined by LF, still valid JSON)
    bom: bool


child_streams = st.builds(
    ChildStream,
    tokens=st.lists(st.text(max_size=6), max_size=5),
    eol=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    pings=st.booleans(),
    split_data=st.booleans(),
    bom=st.booleans(),
)


def render(stream: ChildStream, rid: str) -> bytes:
    """A child's SSE body: role, tokens, finish, usage, [DONE]."""
    envelope = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 5}
    envelope["model"] = "m"

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**envelope, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    usage = {"prompt_tokens": 5, "completion_tokens": len(stream.tokens)}
    usage["total_tokens"] = 5 + len(stream.tokens)
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": t}) for t in stream.tokens]
    events += [chunk({}, "stop"), {**envelope, "choices": [], "usage": usage}]
    eol = stream.eol
    out = bytearray(b"\xef\xbb\xbf" if stream.bom else b"")
    for data in [orjson.dumps(e) for e in events] + [b"[DONE]"]:
        if stream.pings:
            out += b": ping" + eol
        if stream.split_data and data.startswith(b"{"):
            out += b"data: {" + eol + b"data:" + data[1:] + eol
        else:
            out += b"data: " + data + eol
        out += eol
    return bytes(out)


def split_at(raw: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(raw)) for c in cuts})
    return [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]


@FUZZ
@given(
    streams=st.lists(child_streams, min_size=2, max_size=4),
    cuts=st.lists(st.lists(st.integers(0, 2000), max_size=8), min_size=4, max_size=4),
)
def test_child_streams_split_anywhere_are_stitched_end_to_end(
    stack: Stack, streams: list[ChildStream], cuts: list[list[int]]
) -> None:
    parent = fresh_id("sse")
    k = len(streams)
    stack.mirror.scripts[parent] = [
        split_at(render(s, f"{i}_{parent}"), cuts[i]) for i, s in enumerate(streams)
    ]
    body = {"model": "m", "messages": [], "n": k, "stream": True}
    body["stream_options"] = {"include_usage": True}
    reply = post_json(stack, CHAT, body, parent)

    assert reply.status == 200, reply
    payloads = sse_payloads(reply.body)
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    *chunks, usage_chunk = payloads[:-1]
    total = sum(len(s.tokens) for s in streams)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": total,
        "total_tokens": 5 + total,
    }
    texts = [""] * k
    finishes = [0] * k
    for chunk in chunks:
        assert chunk["id"] == f"chatcmpl-{parent}"
        (choice,) = chunk["choices"]
        assert finishes[choice["index"]] == 0  # nothing after a choice's finish
        texts[choice["index"]] += choice["delta"].get("content", "")
        finishes[choice["index"]] += choice["finish_reason"] == "stop"
    assert texts == ["".join(s.tokens) for s in streams]
    assert finishes == [1] * k


@FUZZ
@given(stream=child_streams, cuts=st.lists(st.integers(0, 2000), max_size=8))
def test_single_choice_stream_split_anywhere_passes_through_byte_for_byte(
    stack: Stack, stream: ChildStream, cuts: list[int]
) -> None:
    parent = fresh_id("one")
    raw = render(stream, parent)
    stack.mirror.scripts[parent] = [split_at(raw, cuts)]
    reply = post_json(stack, CHAT, {"model": "m", "messages": [], "stream": True}, parent)
    assert reply.status == 200
    assert reply.body == raw


# --- bytes and framing -----------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, "/v1/embeddings"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_body_is_413_and_never_reaches_upstream(
    stack: Stack, path: str, chunked: bool
) -> None:
    rid = fresh_id("big")
    payload = b'{"n": 2, "pad": "' + b"x" * MAX_BODY + b'"}'
    if chunked:
        framing = b"Transfer-Encoding: chunked\r\n\r\n"
        pieces = [payload[i : i + 65536] for i in range(0, len(payload), 65536)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    else:
        framing = b"Content-Length: %d\r\n\r\n" % len(payload)
        body = payload
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nX-Request-Id: %s\r\nConnection: close\r\n" % (
        path.encode(),
        rid.encode(),
    )
    status_line, headers, reply_body = parse_raw(raw_exchange(stack.port, head + framing + body))
    assert status_line == "HTTP/1.1 413 Request Entity Too Large"
    assert_openai_error(Answer(413, reply_body, headers), 413)
    assert not [s for s in stack.mirror.seen if rid in s.headers.get("X-Request-Id", "")]


@pytest.mark.parametrize("n", [None, 2])
def test_invalid_utf8_in_a_fanout_body_is_400(stack: Stack, n: int | None) -> None:
    n_field = b"" if n is None else b'"n": %d, ' % n
    raw = b'{%s"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}' % n_field
    rid = fresh_id("utf")
    assert_openai_error(post_json(stack, CHAT, raw, rid), 400)
    assert not [s for s in stack.mirror.seen if rid in s.headers.get("X-Request-Id", "")]


def test_invalid_utf8_elsewhere_passes_through_unchanged(stack: Stack) -> None:
    rid = fresh_id("utf")
    reply = post_json(stack, "/v1/embeddings?q=%FF", b'{"input": "\xff\xfe"}', rid)
    assert reply.status == 200
    (seen,) = [s for s in stack.mirror.seen if s.headers.get("X-Request-Id") == rid]
    assert seen.body == b'{"input": "\xff\xfe"}'
    assert seen.target == "/v1/embeddings?q=%FF"


# Control bytes in a header value are the parser's to refuse (400, nothing forwarded); any other
# byte is a valid header value. With n = 1 the id is the client's and passes as it came; a fan-out
# names its children after the parent, so an id that is not visible ASCII is replaced.
SMUGGLED_IDS = [
    pytest.param(b"abc\rInjected: 1", "refused", id="cr"),
    pytest.param(b"abc\nInjected: 1", "refused", id="lf"),
    pytest.param(b"abc\r\n Injected: 1", "refused", id="obs-fold"),
    pytest.param(b"abc\x00def", "refused", id="nul"),
    pytest.param(b"abc\x7fdef", "refused", id="del"),
    pytest.param(b"caf\xc3\xa9", "non-ascii", id="utf8"),
    pytest.param(b"caf\xe9", "non-ascii", id="latin1"),
    pytest.param(b"\xff\xfe\xfd", "non-ascii", id="not-utf8"),
]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(("value", "kind"), SMUGGLED_IDS)
def test_request_id_with_control_or_non_ascii_bytes_is_rejected_or_replaced(
    stack: Stack, value: bytes, kind: str, n: int
) -> None:
    """Control bytes: 400 and nothing upstream. Other bytes: n = 1 forwards them unchanged,
    a fan-out replaces the id with a fresh one that names every child and the answer."""
    marker = fresh_id("smuggle").encode()
    body = b'{"model": "m", "messages": [], "n": %d, "marker": "%s"}' % (n, marker)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nX-Request-Id: " + value + b"\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    status_line, headers, reply = parse_raw(raw_exchange(stack.port, request))
    status = int(status_line.split()[1])
    seen = [s for s in stack.mirror.seen if marker in s.body]
    if kind == "refused":
        assert status == 400, status_line
        assert_openai_error(Answer(status, reply, headers), 400)
        assert "X-Request-Id" not in headers
        assert seen == []
        return
    assert status == 200, status_line
    assert len(seen) == n
    for child in seen:
        assert "Injected" not in child.headers
        for name, header in child.headers.items():
            assert "\r" not in header, name
            assert "\n" not in header, name
    if n == 1:  # passed through: the upstream got the client's bytes, the client its answer
        (child,) = seen
        assert child.request_id.encode("utf-8", "surrogateescape") == value
        assert "X-Request-Id" not in headers  # the fake upstream sends none
        return
    parent = headers["X-Request-Id"]
    assert VISIBLE.fullmatch(parent)
    assert re.fullmatch(r"[0-9a-f]{32}", parent), parent
    assert sorted(child.request_id for child in seen) == [f"0_{parent}", f"1_{parent}"]
    assert orjson.loads(reply)["id"] == f"cmpl-{parent}"


@pytest.mark.parametrize("length", [201, 8_000, 60_000])
def test_over_long_request_id_is_never_the_child_prefix(stack: Stack, length: int) -> None:
    long_id = ("L" * length)[:length]
    body = {"model": "m", "messages": [], "n": 2}
    reply = post_json(stack, CHAT, body, long_id)
    assert reply.status == 200
    parent = reply.headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", parent)
    children = stack.mirror.children_of(parent)
    assert sorted(c.headers["X-Request-Id"] for c in children) == [f"0_{parent}", f"1_{parent}"]


@pytest.mark.parametrize(
    ("path", "body", "sse"),
    [
        (CHAT, {"model": "m", "messages": [], "n": 2}, False),
        (CHAT, {"model": "m", "messages": [], "n": 2, "stream": True}, True),
        (CHAT, {"model": "m", "messages": [], "stream": True}, True),
        ("/v1/embeddings", {"input": "x"}, False),
    ],
)
def test_http_1_0_client_gets_a_whole_answer_without_chunking(
    stack: Stack, path: str, body: dict[str, Any], sse: bool
) -> None:
    payload = json.dumps(body).encode()
    request = (
        b"POST %s HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (path.encode(), len(payload), payload)
    )
    status_line, headers, reply = parse_raw(raw_exchange(stack.port, request))
    assert re.fullmatch(r"HTTP/1\.[01] 200 OK", status_line), status_line
    assert "chunked" not in headers.get("Transfer-Encoding", "")
    if sse:
        payloads = sse_payloads(reply)
        assert payloads[-1] == "[DONE]"
        assert payloads.count("[DONE]") == 1
    else:
        orjson.loads(reply)


@pytest.mark.parametrize(
    "request_line",
    [
        b"POST http://127.0.0.1:{victim}/v1/chat/completions HTTP/1.1",
        b"POST HTTP://127.0.0.1:{victim}/v1/chat/completions HTTP/1.1",
        b"POST http://u:p@127.0.0.1:{victim}/v1/chat/completions HTTP/1.1",
        b"POST /v1/chat/completions HTTP/1.1",
        b"GET http://127.0.0.1:{victim}/v1/models HTTP/1.1",
        b"GET //127.0.0.1:{victim}/v1/models HTTP/1.1",
        b"CONNECT 127.0.0.1:{victim} HTTP/1.1",
    ],
)
def test_destination_comes_only_from_config_never_from_uri_or_host(
    stack: Stack, request_line: bytes
) -> None:
    victim = str(stack.victim_port).encode()
    marker = fresh_id("dest").encode()
    body = b'{"model": "m", "messages": [], "n": 2, "marker": "%s"}' % marker
    request = (
        request_line.replace(b"{victim}", victim)
        + b"\r\nHost: 127.0.0.1:"
        + victim
        + b"\r\nConnection: close\r\nContent-Type: application/json\r\nX-Marker: "
        + marker
        + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    before = stack.victim.connections
    status_line, _, _ = parse_raw(raw_exchange(stack.port, request))
    status = int(status_line.split()[1])
    assert status < 500, status_line
    assert stack.victim.connections == before
    for seen in stack.mirror.seen:
        if seen.headers.get("X-Marker") == marker.decode():
            assert seen.headers["Host"] == f"127.0.0.1:{stack.mirror_port}"


# --- secrets --------------------------------------------------------------------------------


SECRETS = {
    "Authorization": "Bearer sk-SECRET-1",
    "api-key": "SECRET-2",
    "X-Api-Key": "SECRET-3",
    "Proxy-Authorization": "Basic SECRET-4",
    "OpenAI-Organization": "org-SECRET-5",
}


def test_authorization_and_api_keys_never_reach_logs_or_metrics(
    stack: Stack, capture: LogCapture
) -> None:
    requests: list[tuple[str, object]] = [
        (CHAT, {"model": "m", "messages": [], "n": 2}),
        (CHAT, {"model": "m", "messages": [], "n": 2, "stream": True}),
        (CHAT, {"model": "m", "messages": []}),
        (CHAT, {"model": "m", "messages": [], "n": 0}),
        (CHAT, b"{not json"),
        (CHAT, b'{"n": 2, "pad": "' + b"x" * MAX_BODY + b'"}'),
        ("/v1/embeddings?api_key=SECRET-7", {"input": "x"}),
    ]
    for path, body in requests:
        reply = post_json(stack, path, body, fresh_id("sec"), **SECRETS)
        assert reply.status in (200, 400, 413)
    assert capture.wait_blocking(len(requests))
    metrics = stack.get(stack.admin_port, "/metrics")
    assert metrics.status == 200
    everything = "\n".join(capture.records) + metrics.body.decode()
    assert capture.records
    assert "SECRET" not in everything
    children = [s for s in stack.mirror.seen if "sec" in s.headers.get("X-Request-Id", "")]
    assert children
    # End-to-end credentials reach every child unchanged (docs/behaviour.md#headers).
    for child in children:
        assert child.headers["Authorization"] == SECRETS["Authorization"]
        assert child.headers["api-key"] == SECRETS["api-key"]
        assert child.headers["X-Upstream-Key"] == CONFIG_SECRET
        assert "Proxy-Authorization" not in child.headers
