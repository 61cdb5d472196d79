"""Shared fixtures: the demo backend and n-proxy, both real servers on 127.0.0.1.

pytest             # every test: the default, and what the whole check runs
pytest -m core     # the pure core's tests only (tests/core/: no server, no I/O), in seconds
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

import proxy as package_root
from proxy.config.models import Config, single_upstream_config
from proxy.http import stream_path_compiled
from proxy.server.process import Server
from proxy.upstream.service import Upstreams
from tests.support.logs import LogCapture, capture_logs
from tests.support.rawupstream import RawUpstream
from tests.support.rig import MakeRig, Rig
from tests.support.servers import Backend, Proxy, Servers, running_server

# After every test, every in-process proxy must have given back all it held
# (tests/support/lifecycle.py).
pytest_plugins = ("tests.support.lifecycle", "pytester")

# ``-m core``: the tests of the pure layer, proxy/core/, are those in tests/core/ (the folders
# mirror the layers): literal input, literal output. None of them may ask for a server, a client
# or a sub-pytest (``servers`` is behind every server fixture).
CORE_TESTS = Path("tests") / "core"
_SERVING = {"servers", "http", "llama_model", "pytester"}


def pytest_sessionstart(session: pytest.Session) -> None:
    """The suite runs against the build it was asked for (``N_PROXY_EXPECT_BUILD``: compiled or
    pure; .ci/run runs both), and never against compiled modules older than their source: an
    editable install compiles in place (setup.py), and its ``.so`` shadows a ``.py`` edited
    since."""
    compiled = stream_path_compiled()
    expected = os.environ.get("N_PROXY_EXPECT_BUILD")
    if expected and expected != ("compiled" if compiled else "pure"):
        pytest.exit(f"N_PROXY_EXPECT_BUILD={expected}, but the stream path is the other build", 2)
    package = Path(package_root.__file__ or ".").parent
    for built in package.rglob("*.so"):
        source = built.parent / (built.name.split(".", 1)[0] + ".py")
        if source.exists() and source.stat().st_mtime > built.stat().st_mtime:
            pytest.exit(
                f"{source} changed after {built.name} was compiled from it: rebuild it "
                "(pip install -e .) or delete the proxy/**/*.so files (the pure build)",
                2,
            )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    core = config.rootpath / CORE_TESTS
    for item in items:
        if not item.path.is_relative_to(core):
            continue
        serving = _SERVING & set(getattr(item, "fixturenames", ()))
        if serving:
            raise pytest.UsageError(f"{item.nodeid}: a pure core test asks for {sorted(serving)}")
        item.add_marker(pytest.mark.core)


# --- the servers ---------------------------------------------------------------------------------


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    """Every server the test starts (``tests/support/servers.py``), stopped newest first."""
    async with Servers() as started:
        yield started


MakeBackend = Callable[..., Awaitable[Backend]]
MakeProxy = Callable[[Config], Awaitable[Proxy]]


@pytest.fixture
def make_backend(servers: Servers) -> MakeBackend:
    return servers.backend


@pytest.fixture
async def backend(servers: Servers) -> Backend:
    return await servers.backend()


@pytest.fixture
def make_proxy(servers: Servers) -> MakeProxy:
    return servers.proxy


@pytest.fixture
async def proxy(servers: Servers, backend: Backend) -> Proxy:
    return await servers.proxy(single_upstream_config(backend.url))


@pytest.fixture
async def proxy_url(proxy: Proxy) -> str:
    """Where the test's OpenAI client points: the ``proxy`` in front of the demo backend; a
    module in front of another server overrides it."""
    return proxy.url


@pytest.fixture
async def openai_client(proxy_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client on ``proxy_url``, without its own retries (a test sees each answer);
    its timeout bounds a hang, on a machine whose cores others may hold."""
    async with openai.AsyncOpenAI(
        base_url=proxy_url + "/v1", api_key="sk-test", timeout=60.0, max_retries=0
    ) as client:
        yield client


@pytest.fixture
async def server(backend: Backend) -> AsyncIterator[Server]:
    """A whole server, proxy and admin listeners, in front of the demo backend."""
    async with running_server(backend.url) as whole:
        yield whole


@pytest.fixture
async def raw_upstream(servers: Servers) -> RawUpstream:
    """A raw-bytes upstream (``tests/support/rawupstream.py``) with nothing scripted yet."""
    return await servers.start(RawUpstream())


@pytest.fixture
async def http(request: pytest.FixtureRequest) -> AsyncIterator[aiohttp.ClientSession]:
    """The test's client: no cap on its connections (a test may hold hundreds of requests
    open); ``@pytest.mark.http_timeout(seconds)`` bounds each of its requests."""
    marker = request.node.get_closest_marker("http_timeout")
    timeout = aiohttp.ClientTimeout(total=marker.args[0]) if marker else aiohttp.ClientTimeout()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield session


@pytest.fixture
def request_log() -> Iterator[LogCapture]:
    """The proxy's log lines; a test waits on the per-request line to know a handler is done."""
    with capture_logs() as capture:
        yield capture


@pytest.fixture
async def make_rig(
    monkeypatch: pytest.MonkeyPatch, servers: Servers, request_log: LogCapture
) -> AsyncIterator[MakeRig]:
    """Rigs with leak accounting (``tests/support/rig.py``); the proxy's health probe is stubbed
    so that every upstream connection is the test's."""

    async def always_healthy(self: Upstreams, *args: Any, **kwargs: Any) -> bool:
        return True

    monkeypatch.setattr(Upstreams, "healthy", always_healthy)
    clients: list[aiohttp.ClientSession] = []

    async def make(**options: Any) -> Rig:
        rig = await Rig.start(servers, request_log, **options)
        clients.append(rig.client)
        return rig

    yield make
    for client in clients:
        await client.close()


# --- llama.cpp's own server (via xllamacpp) on a tiny self-built model, one per test session ---
# The heavy imports stay inside the fixtures so tests that never ask for them do not pay for them.


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GGUF with EOS reachable, so choices end with both "stop" and "length"."""
    from bench.backends.tinymodel import build_tiny_gguf

    return build_tiny_gguf(tmp_path_factory.mktemp("llama") / "tiny.gguf", eos_reachable=True)


@pytest.fixture(scope="session")
def llama_url(llama_model: Path) -> Iterator[str]:
    """A llama-server with one slot: it rejects every n != 1, so n>1 only works via n-proxy."""
    from bench.backends.llamacpp import llama_server

    with llama_server(llama_model, n_parallel=1) as server:
        yield server.base_url


@pytest.fixture(scope="session")
def llama_url_np4(llama_model: Path) -> Iterator[str]:
    """A llama-server with four slots, as the README recommends: children decode side by side."""
    from bench.backends.llamacpp import llama_server

    with llama_server(llama_model, n_parallel=4, n_ctx=2048) as server:
        yield server.base_url


@pytest.fixture(autouse=True)
def no_unhandled_server_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A handler that raises is a bug even when the client saw the right bytes; and a request
    the parser refuses is the client's fault, never an error line (proxy.observe.clienterrors)."""
    yield
    errors = [
        r
        for r in caplog.get_records("call")
        if r.name.startswith("aiohttp") and r.levelno >= logging.ERROR
    ]
    assert not errors, [f"{r.name}: {r.getMessage()}" for r in errors]
