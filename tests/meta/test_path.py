"""What one streaming fan-out runs through, on the production path, as a reader needs it:

- it enters the upstream layer once per child (``Front.exchange``, whose object the child
  then uses with ``async with``), besides once each per request to route, admit and release;
- every function a chunk calls is in a module the build compiles (setup.py's ``COMPILED``); the
  only Python frames a chunk resumes are the request's own await chain above the stream's writer;
- it crosses the layers ``CROSSED`` and no other.

Read with the profiler in the pure build, where every module runs as Python frames: compiled
modules run none to count, so the compiled build's run of this file skips, and the pure build's
run (which .ci/run makes as well) checks.
"""

from __future__ import annotations

import ast
import asyncio
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import pytest

from proxy.config import Listen, single_upstream_config
from proxy.devserver import DevConfig, start_devserver
from proxy.http import stream_path_compiled
from proxy.server import Server, connection

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "proxy"
CHILDREN = 3
CROSSED = {"server", "request", "upstream", "http", "core", "observe"}
# The request's await chain above the stream's writer: each wake-up of the writer resumes these
# frames (that is how an await chain runs), though none of them is called per chunk.
# The handler's own frames are compiled (setup.py), and the app's one route (``direct_route``)
# and ``Generations.dispatch`` return its coroutine without being frames of the chain.
AWAIT_CHAIN: set[tuple[str, str]] = set()
if connection.COPIES_START:  # the connection's loop awaits the handler in its own task
    AWAIT_CHAIN.add(("proxy.server.connection", "ClientConnection.start"))
    AWAIT_CHAIN.add(("proxy.server.connection", "ClientConnection._handle_request"))
# Into the upstream layer, per request and per child (dunder methods are the ``async with`` of
# the object an entry returned, not entries of their own).
ENTRIES = {
    ("proxy.upstream.exchange", "Front.route"): 1,
    ("proxy.upstream.exchange", "Front.admit"): 1,
    ("proxy.upstream.exchange", "Front.exchange"): CHILDREN,
    ("proxy.upstream.exchange", "Tickets.release"): 1,
}
_COROUTINE = 0x80 | 0x100 | 0x200  # CO_COROUTINE, CO_ITERABLE_COROUTINE, CO_ASYNC_GENERATOR

pytestmark = pytest.mark.skipif(
    stream_path_compiled(),
    reason="compiled modules run without Python frames to count: the pure build's run checks this",
)

Where = tuple[str, str]  # module, qualified name


def module_of(filename: str) -> str | None:
    """The proxy module a code object's file is, or None outside the proxy (the demo backend
    is outside: it only stands in for the upstream)."""
    path = Path(filename)
    if not path.is_relative_to(PACKAGE) or path.is_relative_to(PACKAGE / "devserver"):
        return None
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def compiled_modules() -> set[str]:
    """setup.py's ``COMPILED``, as module names."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "COMPILED":
            paths = ast.literal_eval(node.value)
            return {p.removesuffix(".py").replace("/", ".") for p in paths}
    raise AssertionError("setup.py names no COMPILED")


class Profile:
    """Calls into the proxy's modules while it is on: each function's calls (a coroutine's first
    run), its resumptions (a coroutine run on after an await), and the calls into the upstream
    layer from outside it."""

    def __init__(self) -> None:
        self.calls: Counter[Where] = Counter()
        self.resumed: Counter[Where] = Counter()
        self.entries: Counter[Where] = Counter()
        self._running: set[int] = set()  # the coroutine frames that already ran

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or (module := module_of(frame.f_code.co_filename)) is None:
            return
        where = (module, frame.f_code.co_qualname)
        if frame.f_code.co_flags & _COROUTINE and id(frame) in self._running:
            self.resumed[where] += 1
            return
        if frame.f_code.co_flags & _COROUTINE:
            self._running.add(id(frame))
        self.calls[where] += 1
        caller = module_of(frame.f_back.f_code.co_filename) if frame.f_back else None
        entering = module.startswith("proxy.upstream.") and not frame.f_code.co_name.startswith(
            "__"
        )
        if entering and caller is not None and not caller.startswith("proxy.upstream."):
            self.entries[where] += 1

    @contextmanager
    def on(self) -> Iterator[None]:
        sys.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(None)


async def _profiled_streams(tokens: tuple[int, ...]) -> list[Profile]:
    """One warm proxy in front of a demo backend pacing its tokens; one profiled streaming
    fan-out of ``CHILDREN`` children per count of tokens."""
    runner, port, _ = await start_devserver(DevConfig(token_delay=0.002))
    config = single_upstream_config(f"http://127.0.0.1:{port}").model_copy(
        update={"listen": Listen(host="127.0.0.1", port=0)}
    )
    server = Server(config)
    await server.start()
    url = f"http://127.0.0.1:{server.proxy_port}/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": CHILDREN,
            "stream": True, "ignore_eos": True}  # fmt: skip
    profiles = []
    try:
        async with aiohttp.ClientSession() as http:
            for count in (4, 4, *tokens):  # warm: connections pooled, labelled metrics looked up
                profile = Profile()
                with profile.on():
                    async with http.post(url, json={**body, "max_tokens": count}) as r:
                        assert r.status == 200
                        raw = await r.read()
                assert raw.count(b"data: [DONE]") == 1
                profiles.append(profile)
    finally:
        await server.close()
        await runner.cleanup()
    return profiles[2:]


@pytest.fixture(scope="module")
def short_and_long() -> tuple[Profile, Profile]:
    """A stream of 10 tokens a choice and one of 110: what grows with the chunks is per chunk."""
    short, long = asyncio.run(_profiled_streams((10, 110)))
    return short, long


def per_chunk(short: Counter[Where], long: Counter[Where]) -> set[Where]:
    """What ran at least once for every two of the 300 chunks the longer stream added."""
    return {where for where in long if long[where] - short[where] >= 150}


def test_a_streaming_fan_out_enters_the_upstream_layer_once_per_child(
    short_and_long: tuple[Profile, Profile],
) -> None:
    for profile in short_and_long:
        assert dict(profile.entries) == ENTRIES


def test_every_function_a_chunk_calls_is_compiled(short_and_long: tuple[Profile, Profile]) -> None:
    short, long = short_and_long
    called = per_chunk(short.calls, long.calls)
    assert called, "the profile saw no chunk"
    compiled = compiled_modules()
    assert sorted(w for w in called if w[0] not in compiled) == []


def test_a_chunk_resumes_no_python_frame_but_the_requests_await_chain(
    short_and_long: tuple[Profile, Profile],
) -> None:
    short, long = short_and_long
    assert per_chunk(short.calls, long.calls), "the profile saw no chunk"
    compiled = compiled_modules()
    resumed = {w for w in per_chunk(short.resumed, long.resumed) if w[0] not in compiled}
    # At most the chain: on a busy machine one wake-up of the writer takes several chunks, and
    # the chain is resumed less often than every other chunk.
    assert resumed <= AWAIT_CHAIN


def test_a_streaming_fan_out_crosses_these_layers(short_and_long: tuple[Profile, Profile]) -> None:
    for profile in short_and_long:
        assert {module.split(".")[1] for module, _ in profile.calls} == CROSSED


def test_the_profile_tells_a_call_from_a_resumption() -> None:
    async def inner() -> None:
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    profile = Profile()
    here = str(PACKAGE / "request" / "example.py")  # as if it were a module of the proxy
    code = compile("async def outer(inner):\n    await inner()\n", here, "exec")
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # a literal function, filed under a proxy module's path
    with profile.on():
        asyncio.run(namespace["outer"](inner))
    where = ("proxy.request.example", "outer")
    assert (profile.calls[where], profile.resumed[where]) == (1, 2)
