"""The lifecycle check itself (tests/support/lifecycle.py): run on a file of tests that leak on
purpose, each must fail by name with what it held, and the clean ones must pass."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = """
pytest_plugins = ("tests.support.lifecycle",)
from tests.conftest import backend, http, make_backend, make_proxy, proxy, servers  # noqa: F401
"""

TESTS = """
import asyncio
import threading

import pytest

from proxy.server.app import GENERATIONS
from proxy.devserver import DevConfig, start_devserver
from proxy.config.models import Listen
from proxy.request.mailbox import Mailbox
from proxy.server.process import Server
from tests.support.servers import Backend, proxy_config, start_proxy

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


async def test_clean_fanout(proxy, http):
    body = {"model": "m", "messages": MESSAGES, "n": 2, "stream": True, "max_tokens": 4}
    async with http.post(proxy.url + CHAT, json=body) as r:
        assert r.status == 200
        await r.read()


async def test_slot_left_held(proxy):
    (upstream,) = proxy.config.upstreams
    proxy.pool.admit(upstream, 1)  # a place in line taken and never given back


async def test_stream_left_unread(proxy, http):
    body = {
        "model": "m", "messages": MESSAGES, "n": 2, "stream": True, "max_tokens": 10_000,
        "ignore_eos": True, "x_demo": {"token_delay": 0.05},
    }
    r = await http.post(proxy.url + CHAT, json=body)
    assert r.status == 200  # and the test ends with the stream open


async def test_fails_and_leaks(proxy):
    (upstream,) = proxy.config.upstreams
    proxy.pool.admit(upstream, 1)
    assert False, "a failure of its own"


async def test_task_of_the_proxy_left_pending():
    mailbox = Mailbox(1)
    await mailbox.put((0, None))
    asyncio.ensure_future(mailbox.put((0, None)))  # waits for a writer that never comes
    await asyncio.sleep(0)


async def test_proxy_never_shut_down(backend):
    await start_proxy(proxy_config(backend))


async def server_with_a_request_in_flight(backend, http, drain_seconds):
    config = proxy_config(
        backend, listen=Listen(host="127.0.0.1", port=0), drain_seconds=drain_seconds,
        drain_grace_seconds=0,
    )
    server = Server(config)
    await server.start()
    body = {"model": "m", "messages": MESSAGES, "x_demo": {"headers_delay": 30}}
    url = f"http://127.0.0.1:{server.proxy_port}{CHAT}"
    request = asyncio.ensure_future(http.post(url, json=body))
    for _ in range(500):
        if server.in_flight.requests:
            break
        await asyncio.sleep(0.01)
    assert server.in_flight.requests == 1
    return server, request


async def test_server_closed_mid_request(backend, http):
    server, request = await server_with_a_request_in_flight(backend, http, 30)
    await server.close()  # cancels the handler: its finally gives everything back
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)


@pytest.fixture(scope="module")
def threaded():
    # A backend and a proxy on a loop of their own, in a thread (as test_hostile's stack).
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        backend, port, _ = await start_devserver(DevConfig())
        runner, _ = await start_proxy(proxy_config(Backend(f"http://127.0.0.1:{port}", None)))
        return backend, runner

    backend, runner = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield loop, runner
    for each in (runner, backend):
        asyncio.run_coroutine_threadsafe(each.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_slot_left_held_on_a_thread_s_loop(threaded):
    loop, runner = threaded

    async def admit():
        (upstream,) = runner.app[GENERATIONS].upstreams.config.upstreams
        runner.app[GENERATIONS].upstreams.admit(upstream, 1)

    asyncio.run_coroutine_threadsafe(admit(), loop).result(30)


async def test_server_drained_mid_request(backend, http):
    server, request = await server_with_a_request_in_flight(backend, http, 0.1)
    await server.drain()  # out of time with the request in flight: cut on purpose
    await server.close()
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
"""


@pytest.fixture
def outcome(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_leaks=TESTS)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("N_PROXY_LIFECYCLE_SETTLE", "1")
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-o", "asyncio_mode=auto",
        "-o", "asyncio_default_fixture_loop_scope=function", "-rA", timeout=120,
    )  # fmt: skip


def teardown_errors(text: str) -> dict[str, str]:
    """Each test's "ERROR at teardown" section of the report."""
    parts = re.split(r"_+ ERROR at teardown of (\w+) _+\n", text)
    return {name: body.split("\n=")[0] for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_leaks_fail_by_name_with_what_was_held_and_clean_tests_pass(
    outcome: pytest.RunResult,
) -> None:
    text = outcome.stdout.str()
    outcome.assert_outcomes(passed=8, failed=1, errors=6)
    errors = teardown_errors(text)
    assert set(errors) == {
        "test_slot_left_held",
        "test_stream_left_unread",
        "test_task_of_the_proxy_left_pending",
        "test_proxy_never_shut_down",
        "test_server_closed_mid_request",
        "test_slot_left_held_on_a_thread_s_loop",
    }
    assert (
        "at the end of the test, after 1 s: upstream default: 1 slots held"
        in (errors["test_slot_left_held"])
    )
    threaded = errors["test_slot_left_held_on_a_thread_s_loop"]
    assert "at the end of the test, after 1 s: upstream default: 1 slots held" in threaded
    unread = errors["test_stream_left_unread"]
    assert "at the end of the test" in unread
    assert "1 requests in flight; 2 fan-out children running; 1 fan-out streams open" in unread
    assert re.search(r"replica http://127.0.0.1:\d+ has 2 outstanding", unread)
    # Where each task of the proxy waits, to find the leak from the report alone.
    assert "proxy/request/fanout.py:" in unread
    assert "run_child" in unread
    pending = errors["test_task_of_the_proxy_left_pending"]
    assert "1 tasks of the proxy still pending after the test's fixtures were torn down" in pending
    assert "proxy/request/mailbox.py:" in pending
    assert "was never shut down" in errors["test_proxy_never_shut_down"]
    # Judged before aiohttp's cleanup cancels the handler, whose finally would hide the leak.
    closed = errors["test_server_closed_mid_request"]
    assert "at its shutdown" in closed
    assert "1 requests in flight" in closed
    assert "upstream default: 1 slots held" in closed
    # Drained on purpose, then judged once shut down: nothing held by then.
    assert "PASSED test_leaks.py::test_server_drained_mid_request" in text
    assert "PASSED test_leaks.py::test_clean_fanout" in text
    # A test that failed is reported for its own failure: its leftovers are not judged.
    assert "FAILED test_leaks.py::test_fails_and_leaks - AssertionError" in text
    assert "test_fails_and_leaks" not in errors
