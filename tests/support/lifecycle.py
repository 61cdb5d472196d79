"""The lifecycle check after every test: each in-process n-proxy gives back everything it held.

Every proxy app of the suite runs under an aiohttp ``AppRunner`` (conftest's ``start_proxy``, the
rigs of the failover, fault, limit, ops... tests, and ``proxy.server.process.Server``), so the check
hooks ``AppRunner.setup`` and ``cleanup`` and sees each runner whose app is a proxy (it has
``proxy.server.app.IN_FLIGHT``). A proxy is judged on its census (``proxy.observe.census``: requests
and fan-out children in flight, slots held or queued, replicas' outstanding counts, upstream
requests in flight, pooled connections checked out), which must settle to 0 within
``SETTLE_SECONDS``:

- at the end of the test, before any fixture is torn down (the backends are still up);
- at its shutdown, before aiohttp's cleanup cancels the handlers still running, whose
  ``finally`` blocks would give back what a stuck child held and so hide the leak. A proxy
  being drained (``Server.drain``) is shut down mid-request on purpose: it is judged once its
  cleanup is over instead, and every proxy is judged then too;
- when the test's event loop is done with its fixtures: no asyncio task in or under the
  proxy's code (its demo backend aside) may still be pending, and every proxy of that loop
  must have been shut down.

A test that leaks fails by name, at its teardown, with what was held and where each task of the
proxy waits. A test that failed already is not judged (its leftovers are the failure's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from aiohttp import web
from pytest_asyncio import is_async_test

import proxy
from proxy.observe.census import Census
from proxy.server.app import GENERATIONS, IN_FLIGHT, take_census
from proxy.upstream.service import Upstreams

# Generous for a loaded 2-core machine: a request that ends normally settles in milliseconds.
# (The check's own tests run it with less, through the environment.)
SETTLE_SECONDS = float(os.environ.get("N_PROXY_LIFECYCLE_SETTLE", "10"))
_POLL = 0.01
_PROXY_DIR = str(Path(proxy.__file__).parent) + "/"
_BACKEND_DIR = _PROXY_DIR + "devserver/"


@dataclass(eq=False)
class LiveProxy:
    runner: web.AppRunner
    loop: asyncio.AbstractEventLoop
    started_by: str  # the test (or fixture) that set it up
    leaked: bool = False  # found holding something: not waited for again

    @property
    def app(self) -> web.Application:
        return self.runner.app

    @property
    def name(self) -> str:
        addresses = self.runner.addresses
        where = f" on {addresses[0][0]}:{addresses[0][1]}" if addresses else ""
        return f"proxy{where} (started in {self.started_by})"

    def census(self) -> Census:
        return take_census(self.app[IN_FLIGHT], self.app[GENERATIONS])

    def own_tasks(self) -> set[asyncio.Future[Any]]:
        """The pool's background loops: health checks, discovery, the slot watchdog."""
        return set(self.app[GENERATIONS].tasks())


def _health_check(task: asyncio.Future[Any]) -> bool:
    """One replica's check, run by a live pool's health loop (a task of ``asyncio.gather``)."""
    return getattr(_coro(task), "cr_code", None) is Upstreams._check.__code__


@dataclass
class Judge:
    """The state of the test being run, and every proxy alive in this process."""

    live: dict[int, LiveProxy] = field(default_factory=dict)  # id(runner) -> proxy
    test_loop: asyncio.AbstractEventLoop | None = None  # the running async test's
    test: str = "(no test)"
    judging: bool = False  # the test's setup and call passed: its leftovers are judged
    findings: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # rigs on a thread's loop

    def found(self, finding: str) -> None:
        with self.lock:
            self.findings.append(finding)

    def on_loop(self, loop: asyncio.AbstractEventLoop) -> list[LiveProxy]:
        return [p for p in list(self.live.values()) if p.loop is loop]


JUDGE = Judge()


async def settle(live: LiveProxy, within: float = SETTLE_SECONDS) -> Census:
    """The census once it shows nothing held, or as it is when ``within`` seconds are up.

    Polled, not awaited on an event: a census is a few integer reads, and the counts it reads
    live in many places (slots, replicas, the pool, the requests in flight)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        census = live.census()
        if not census.held() or loop.time() >= deadline:
            return census
        await asyncio.sleep(_POLL)


def _judge_census(live: LiveProxy, census: Census, moment: str) -> None:
    held = census.held()
    if held:
        live.leaked = True
        tasks = _describe(_proxy_tasks(live.loop))
        JUDGE.found(
            f"{live.name} still held, {moment}, after {SETTLE_SECONDS:g} s: "
            + "; ".join(held)
            + (f"\n    proxy tasks:\n{tasks}" if tasks else "")
        )


def _own_tasks(loop: asyncio.AbstractEventLoop) -> set[asyncio.Future[Any]]:
    own: set[asyncio.Future[Any]] = set()
    for live in JUDGE.on_loop(loop):
        own |= live.own_tasks()
    return own


def _coro(task: asyncio.Future[Any]) -> Any:
    get_coro = getattr(task, "get_coro", None)
    return get_coro() if get_coro is not None else None


def _frames(task: asyncio.Future[Any]) -> Iterator[FrameType]:
    """The frames of a task's await chain, outermost first, down to the future it waits on."""
    coro = _coro(task)
    for _ in range(64):  # bounded: an await chain is never this deep
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            return
        yield frame
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)


def _in_proxy(task: asyncio.Future[Any]) -> bool:
    """The task runs the proxy's code, or waits in it (the demo backend's is not the proxy's).
    A coroutine compiled by mypyc (setup.py) has no frames: its type names its module."""
    module = type(_coro(task)).__module__
    if module.startswith("proxy.") and not module.startswith("proxy.devserver"):
        return True
    for frame in _frames(task):
        path = frame.f_code.co_filename
        if path.startswith(_PROXY_DIR) and not path.startswith(_BACKEND_DIR):
            return True
    return False


def _chain(task: asyncio.Future[Any]) -> str:
    """Where a task waits, as ``file:line function > ...`` (the proxy's files from proxy/); a
    compiled coroutine as ``file: its type``."""
    out = []
    compiled = type(_coro(task))
    if compiled.__module__.startswith("proxy."):
        out.append(f"{compiled.__module__.replace('.', '/')}.py: {compiled.__qualname__}")
    for frame in _frames(task):
        path = frame.f_code.co_filename
        short = path[len(_PROXY_DIR) - len("proxy/") :] if path.startswith(_PROXY_DIR) else path
        out.append(f"{short}:{frame.f_lineno} {frame.f_code.co_name}")
    return " > ".join(out) or repr(task)


def _proxy_tasks(loop: asyncio.AbstractEventLoop) -> list[asyncio.Future[Any]]:
    """The tasks on ``loop`` in the proxy's code, but for the live proxies' own loops."""
    current = asyncio.current_task() if _running(loop) else None
    own = _own_tasks(loop)
    return [
        task
        for task in asyncio.all_tasks(loop)
        if task is not current
        and not task.done()
        and task not in own
        and not (own and _health_check(task))
        and _in_proxy(task)
    ]


def _running(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _describe(tasks: list[asyncio.Future[Any]]) -> str:
    lines = sorted(_chain(task) for task in tasks)
    return "\n".join(f"      {line}" for line in lines[:20])


async def _tasks_done(loop: asyncio.AbstractEventLoop, moment: str) -> None:
    """No task of the proxy pending once no proxy is left on ``loop`` (bounded wait: cancelled
    children may still be unwinding)."""
    deadline = loop.time() + SETTLE_SECONDS
    while True:
        pending = _proxy_tasks(loop)
        if not pending or loop.time() >= deadline:
            break
        await asyncio.sleep(_POLL)
    if pending:
        JUDGE.found(
            f"{len(pending)} tasks of the proxy still pending {moment}, after "
            f"{SETTLE_SECONDS:g} s:\n{_describe(pending)}"
        )


# --- the hooks into aiohttp's runner: every proxy app of the suite runs under one -----------

_original_setup: Callable[[web.AppRunner], Awaitable[None]] | None = None
_original_cleanup: Callable[[web.AppRunner], Awaitable[None]] | None = None


async def _setup(runner: web.AppRunner) -> None:
    assert _original_setup is not None
    await _original_setup(runner)
    if IN_FLIGHT in runner.app:
        loop = asyncio.get_running_loop()
        JUDGE.live[id(runner)] = LiveProxy(runner, loop, JUDGE.test)


async def _cleanup(runner: web.AppRunner) -> None:
    assert _original_cleanup is not None
    live = JUDGE.live.get(id(runner))
    if live is None or live.runner is not runner:
        await _original_cleanup(runner)
        return
    judging = JUDGE.judging
    drained = live.app[IN_FLIGHT].draining
    if judging and not drained and not live.leaked:
        _judge_census(live, await settle(live), "at its shutdown")
    try:
        await _original_cleanup(runner)
    finally:
        JUDGE.live.pop(id(runner), None)
    if judging and not live.leaked:
        _judge_census(live, await settle(live), "once it was shut down")
        if not JUDGE.on_loop(live.loop) and live.loop is not JUDGE.test_loop:
            # A rig on a loop of its own (a thread's): the test's loop check never sees it.
            await _tasks_done(
                live.loop, f"after the last proxy on its loop shut down ({live.name})"
            )


def _patch() -> None:
    global _original_setup, _original_cleanup
    _original_setup = web.AppRunner.setup
    _original_cleanup = web.AppRunner.cleanup
    web.AppRunner.setup = _setup  # type: ignore[method-assign, assignment]
    web.AppRunner.cleanup = _cleanup  # type: ignore[method-assign, assignment]


def _unpatch() -> None:
    if _original_setup is not None and _original_cleanup is not None:
        web.AppRunner.setup = _original_setup  # type: ignore[method-assign, assignment]
        web.AppRunner.cleanup = _original_cleanup  # type: ignore[method-assign, assignment]


def _run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` on ``loop``: a test's own loop between its call and its teardown (idle
    then), or a rig's loop running in another thread."""
    if loop.is_closed():
        coro.close()
    elif loop.is_running():
        if _running(loop):  # cannot wait for a loop from inside it
            coro.close()
            return
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            future.result(SETTLE_SECONDS + 10)
        except concurrent.futures.TimeoutError:
            future.cancel()
            JUDGE.found(f"the lifecycle check timed out on a loop of another thread ({loop!r})")
    else:
        loop.run_until_complete(coro)


async def _judge_alive(live: LiveProxy) -> None:
    _judge_census(live, await settle(live), "at the end of the test")


# --- pytest hooks and the fixture --------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    _patch()


def pytest_unconfigure(config: pytest.Config) -> None:
    _unpatch()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    JUDGE.test = item.nodeid
    JUDGE.findings = []
    JUDGE.judging = False
    result = yield
    JUDGE.judging = True  # reached only when the setup passed
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    try:
        result = yield
    except BaseException:
        JUDGE.judging = False
        raise
    if JUDGE.judging:
        for live in list(JUDGE.live.values()):
            if not live.app[IN_FLIGHT].draining and not live.leaked:
                _run_on(live.loop, _judge_alive(live))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    result = yield  # a teardown that failed by itself reports that, not what follows
    for key, live in list(JUDGE.live.items()):
        if live.loop.is_closed():
            del JUDGE.live[key]
            JUDGE.found(f"{live.name} was never shut down (its event loop closed under it)")
    findings, JUDGE.findings = JUDGE.findings, []
    judged, JUDGE.judging = JUDGE.judging, False
    JUDGE.test = "(no test)"
    if findings and judged:
        pytest.fail("lifecycle check:\n  " + "\n  ".join(findings), pytrace=False)
    return result


@pytest.fixture(autouse=True)
def lifecycle(request: pytest.FixtureRequest) -> None:
    """An async test gets its loop checked once its other fixtures are torn down."""
    if is_async_test(request.node):
        request.getfixturevalue("_lifecycle_loop")


@pytest.fixture
async def _lifecycle_loop() -> AsyncIterator[None]:
    loop = JUDGE.test_loop = asyncio.get_running_loop()
    try:
        yield
    finally:
        JUDGE.test_loop = None
    if not JUDGE.judging:
        return
    for live in JUDGE.on_loop(loop):
        JUDGE.live.pop(id(live.runner), None)
        JUDGE.found(f"{live.name} was never shut down")
    await _tasks_done(loop, "after the test's fixtures were torn down")
