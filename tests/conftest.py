"""Shared fixtures: the demo backend and n-proxy, both real servers on 127.0.0.1."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.config.models import Config, single_upstream_config
from proxy.devserver import DevConfig, DevState, start_devserver
from proxy.server.app import build_app

# After every test, every in-process proxy must have given back all it held
# (tests/support/lifecycle.py).
pytest_plugins = ("tests.support.lifecycle", "pytester")


@dataclass
class Backend:
    url: str
    state: DevState


@dataclass
class Proxy:
    url: str
    config: Config
    app: web.Application


async def start_proxy(config: Config) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(build_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def make_backend() -> AsyncIterator[Callable[..., Awaitable[Backend]]]:
    runners: list[web.AppRunner] = []

    async def make(**options: Any) -> Backend:
        runner, port, state = await start_devserver(DevConfig(**options))
        runners.append(runner)
        return Backend(f"http://127.0.0.1:{port}", state)

    yield make
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def backend(make_backend: Callable[..., Awaitable[Backend]]) -> Backend:
    return await make_backend()


@pytest.fixture
async def make_proxy() -> AsyncIterator[Callable[[Config], Awaitable[Proxy]]]:
    runners: list[web.AppRunner] = []

    async def make(config: Config) -> Proxy:
        runner, url = await start_proxy(config)
        runners.append(runner)
        return Proxy(url, config, runner.app)

    yield make
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def proxy(make_proxy: Callable[[Config], Awaitable[Proxy]], backend: Backend) -> Proxy:
    return await make_proxy(single_upstream_config(backend.url))


def proxy_config(backend: Backend, **overrides: Any) -> Config:
    return single_upstream_config(backend.url).model_copy(update=overrides)


def with_upstream(config: Config, **changes: Any) -> Config:
    """The one-upstream ``config`` with that upstream's fields changed."""
    (upstream,) = config.upstreams
    return config.model_copy(update={"upstreams": (upstream.model_copy(update=changes),)})


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


# llama.cpp's own server (via xllamacpp) on a tiny self-built model, one per test session. The
# heavy imports stay inside the fixtures so tests that never ask for them do not pay for them.
from pathlib import Path  # noqa: E402


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GGUF with EOS reachable, so choices end with both "stop" and "length"."""
    from tests.support.tinymodel import build_tiny_gguf

    return build_tiny_gguf(tmp_path_factory.mktemp("llama") / "tiny.gguf", eos_reachable=True)


@pytest.fixture(scope="session")
def llama_url(llama_model: Path) -> Iterator[str]:
    """A llama-server with one slot: it rejects every n != 1, so n>1 only works via n-proxy."""
    from tests.support.llamacpp import llama_server

    with llama_server(llama_model, n_parallel=1) as server:
        yield server.base_url


@pytest.fixture(scope="session")
def llama_url_np4(llama_model: Path) -> Iterator[str]:
    """A llama-server with four slots, as the README recommends: children decode side by side."""
    from tests.support.llamacpp import llama_server

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
