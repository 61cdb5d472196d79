"""SIGHUP reload: the file is read and validated again; new requests use the new config while a
request in flight ends on the one it began with; a bad file keeps the running config."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.config.models import load_config
from proxy.observe.census import UpstreamCensus
from proxy.server.app import take_census
from proxy.server.process import Server
from tests.support.client import Answer, post, sse_payloads
from tests.support.logs import capture_logs
from tests.support.polling import until
from tests.support.ports import free_port
from tests.support.servers import Backend, Servers, metric
from tests.support.upstreams import HoldingUpstream

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
WITHIN = 30.0  # seconds: a bound on every wait, not a timing


def write_config(path: Path, text: str) -> None:
    path.write_text(
        "listen: {host: 127.0.0.1, port: 0}\nadmin: {host: 127.0.0.1, port: 0}\n"
        "drain_grace_seconds: 0.05\n" + text,
        encoding="utf-8",
    )


def one_upstream(backend: Backend, name: str = "a", extra: str = "") -> str:
    return f"upstreams: [{{name: {name}, url: '{backend.url}'{extra}}}]\n"


@pytest.fixture
async def started(tmp_path: Path, servers: Servers, backend: Backend) -> AsyncIterator[Server]:
    """A whole server whose loader reads ``tmp_path / "config.yaml"``, as SIGHUP has it do."""
    path = tmp_path / "config.yaml"
    write_config(path, one_upstream(backend))
    server = Server(load_config(path), loader=lambda: load_config(path))
    await server.start()
    yield server
    await server.close()


def chat(server: Server) -> str:
    return f"http://127.0.0.1:{server.proxy_port}{CHAT}"


async def test_stream_running_across_a_reload_ends_on_the_old_config(
    http: aiohttp.ClientSession,
    started: Server,
    backend: Backend,
    servers: Servers,
    tmp_path: Path,
) -> None:
    other = await servers.backend()
    body = {
        "model": "m", "messages": MESSAGES, "n": 2, "stream": True, "max_tokens": 100,
        "ignore_eos": True, "x_demo": {"token_delay": 0.02},
    }  # fmt: skip
    async with http.post(chat(started), json=body) as r:
        assert r.status == 200
        first = await r.content.readline()
        assert first.startswith(b"data: ")
        old = started.generations.current
        write_config(tmp_path / "config.yaml", one_upstream(other, name="b"))
        assert await started.reload()
        assert started.generations.current is not old
        assert old.begun.requests == 1  # the stream, still running in the generation it began in
        # A new request goes to the new upstream while the stream still runs on the old one.
        async with http.post(chat(started), json={"model": "m", "messages": MESSAGES}) as quick:
            assert quick.status == 200
        rest = await r.read()
    events = (first + rest).decode().split("\n\n")
    assert not [e for e in events if '"error"' in e]
    assert events[-2:] == ["data: [DONE]", ""]
    assert len(backend.state.seen) == 2  # both children of the stream, and nothing after it
    assert len(other.state.seen) == 1
    # The old generation is closed once its last request ended: loops done, pool closed.
    async with asyncio.timeout(WITHIN):
        await started.generations.retired()
    assert old.upstreams.loops
    assert all(loop.done() for loop in old.upstreams.loops)
    assert not old.upstreams.connections.in_use
    assert metric(started.metrics, "n_proxy_config_reloads_total", result="ok") == 1


async def test_bad_file_keeps_the_running_config_and_logs_one_line_naming_the_key(
    http: aiohttp.ClientSession, started: Server, backend: Backend, tmp_path: Path
) -> None:
    running = started.generations.current
    write_config(tmp_path / "config.yaml", one_upstream(backend) + "max_n: 0\n")
    with capture_logs() as logs:
        assert not await started.reload()
    (line,) = [r for r in logs.records if "reload" in r]
    assert "config reload failed" in line
    assert "max_n: must be an integer from 1 to 128" in line
    # An operator's alert: at warning, not among the request lines at info.
    assert logs.levels("config reload failed; the running config is kept") == [
        ("warning", {"error": "max_n: must be an integer from 1 to 128"})
    ]
    assert started.generations.current is running
    async with http.post(chat(started), json={"model": "m", "messages": MESSAGES, "n": 3}) as r:
        assert r.status == 200  # max_n is still 10
    assert metric(started.metrics, "n_proxy_config_reloads_total", result="failed") == 1
    assert metric(started.metrics, "n_proxy_config_reloads_total", result="ok") == 0


async def test_good_file_switches_to_its_new_route_and_upstream(
    http: aiohttp.ClientSession,
    started: Server,
    backend: Backend,
    servers: Servers,
    tmp_path: Path,
) -> None:
    other = await servers.backend()
    text = (
        f"upstreams: [{{name: a, url: '{backend.url}'}}, {{name: b, url: '{other.url}'}}]\n"
        "routes: [{model: 'big-*', upstream: b}]\nmax_n: 4\n"
    )
    write_config(tmp_path / "config.yaml", text)
    with capture_logs() as logs:
        assert await started.reload()
    assert [r for r in logs.records if "config reloaded" in r]
    for model in ("big-one", "small"):
        async with http.post(chat(started), json={"model": model, "messages": MESSAGES}) as r:
            assert r.status == 200
    assert [body["model"] for _, body, _ in other.state.seen] == ["big-one"]
    assert [body["model"] for _, body, _ in backend.state.seen] == ["small"]
    body = {"model": "small", "messages": MESSAGES, "n": 5}
    async with http.post(chat(started), json=body) as r:
        assert r.status == 400  # the new max_n
    async with asyncio.timeout(WITHIN):
        await started.generations.retired()


async def test_reload_keeps_the_listeners_and_names_what_needs_a_restart(
    started: Server, backend: Backend, tmp_path: Path
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(one_upstream(backend) + "listen: {host: 127.0.0.1, port: 1}\n", "utf-8")
    with capture_logs() as logs:
        assert await started.reload()
    (line,) = [r for r in logs.records if "config reloaded" in r]
    assert "listen,admin" in line  # the sockets stay as they are
    assert started.config.listen.port == 0
    async with asyncio.timeout(WITHIN):
        await started.generations.retired()


async def wait_line(stream: asyncio.StreamReader, needle: str, logs: list[str]) -> str:
    async with asyncio.timeout(WITHIN):
        while True:
            line = (await stream.readline()).decode()
            if not line:
                raise AssertionError(f"no {needle!r} in {logs}")
            logs.append(line)
            if needle in line:
                return line


@pytest.mark.parametrize("workers", [1, 2])
async def test_sighup_reloads_a_running_process(
    http: aiohttp.ClientSession,
    backend: Backend,
    servers: Servers,
    tmp_path: Path,
    workers: int,
) -> None:
    """The real process: SIGHUP with a bad file keeps serving; with a good one the new upstream
    answers. With --workers the supervisor forwards SIGHUP to every worker."""
    other = await servers.backend()
    path = tmp_path / "config.yaml"
    port = free_port()
    path.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\nlog_format: text\n"
        "drain_grace_seconds: 0.05\n" + one_upstream(backend),
        "utf-8",
    )
    environ = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "proxy", "--config", str(path), "--workers", str(workers)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=environ,
    )
    seen: list[str] = []
    try:
        assert process.stdout is not None
        for _ in range(workers):
            await wait_line(process.stdout, "listening", seen)
        url = f"http://127.0.0.1:{port}{CHAT}"
        path.write_text(path.read_text("utf-8") + "max_n: -1\n", "utf-8")
        process.send_signal(signal.SIGHUP)
        for _ in range(workers):
            await wait_line(process.stdout, "max_n: must be an integer", seen)
        async with http.post(url, json={"model": "m", "messages": MESSAGES}) as r:
            assert r.status == 200
        path.write_text(
            path.read_text("utf-8").replace("max_n: -1\n", "").replace(backend.url, other.url),
            "utf-8",
        )
        process.send_signal(signal.SIGHUP)
        for _ in range(workers):
            await wait_line(process.stdout, "config reloaded", seen)
        for _ in range(2 * workers):  # whichever worker the kernel hands a connection to
            fresh = aiohttp.ClientSession()  # a new connection each time
            async with fresh, fresh.post(url, json={"model": "m", "messages": MESSAGES}) as r:
                assert r.status == 200
        assert len(backend.state.seen) == 1
        assert len(other.state.seen) == 2 * workers
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(WITHIN):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


# --- one line per upstream across generations (docs/operating.md#reload) ----------------------


STREAM = {"model": "m", "messages": MESSAGES, "stream": True}


@pytest.fixture
async def holding(servers: Servers) -> HoldingUpstream:
    return await servers.start(HoldingUpstream())


def limited(
    path: Path, *upstreams: tuple[str, HoldingUpstream | Backend, int], extra: str = ""
) -> None:
    """A config of ``(name, server, max_concurrency)`` upstreams, the first the default."""
    listed = ", ".join(
        f"{{name: {name}, url: '{server.url}', max_concurrency: {limit}, max_queue: 100}}"
        for name, server, limit in upstreams
    )
    write_config(path, f"upstreams: [{listed}]\n" + extra)


@pytest.fixture
async def serving(tmp_path: Path) -> AsyncIterator[Callable[[], Awaitable[Server]]]:
    """A whole server on ``tmp_path / "config.yaml"`` (written by the test first), reloading it."""
    path = tmp_path / "config.yaml"
    running: list[Server] = []

    async def serve() -> Server:
        server = Server(load_config(path), loader=lambda: load_config(path))
        await server.start()
        running.append(server)
        return server

    yield serve
    for server in running:
        await server.close()


def census(server: Server, upstream: str) -> UpstreamCensus:
    (found,) = [u for u in take_census(server.in_flight, server.generations).upstreams
                if u.name == upstream]  # fmt: skip
    return found


def stream_ok(answer: Answer, n: int) -> None:
    assert answer.status == 200
    payloads = sse_payloads(answer.body)
    assert payloads[-1] == "[DONE]"
    assert not [p for p in payloads if isinstance(p, dict) and "error" in p]
    finished = {c["index"] for p in payloads[:-1] for c in p["choices"] if c["finish_reason"]}
    assert finished == set(range(n))


async def test_three_reloads_under_open_streams_never_take_the_upstream_past_its_limit(
    http: aiohttp.ClientSession,
    holding: HoldingUpstream,
    serving: Callable[[], Awaitable[Server]],
    tmp_path: Path,
) -> None:
    """max_concurrency 2, an n = 2 stream open, then three reloads with another n = 2 stream
    after each: their children wait in the one line the four generations share, so the upstream
    never has more than 2 at once (it had 8 when each generation built a line of its own), and
    every stream ends whole once the upstream lets them."""
    path = tmp_path / "config.yaml"
    limited(path, ("a", holding, 2))
    server = await serving()
    body = {**STREAM, "n": 2}
    streams = [asyncio.create_task(post(http, chat(server), body))]
    await holding.wait_for(lambda: holding.active == 2)
    for reload in range(1, 4):
        limited(path, ("a", holding, 2), extra=f"max_n: {4 + reload}\n")  # a change, same limit
        assert await server.reload()
        streams.append(asyncio.create_task(post(http, chat(server), body)))
        await until(lambda: census(server, "a").queued == 2 * reload or holding.active > 2, WITHIN)  # noqa: B023
        assert holding.active == 2
        # The line is counted once, not once per generation that names it.
        assert (census(server, "a").slots_held, metric(server.metrics, "n_proxy_slots_in_use")) == (
            2,
            2,
        )
    assert len(server.generations.retiring) == 3
    holding.release()
    for answer in await asyncio.gather(*streams):
        stream_ok(answer, 2)
    assert (holding.peak, len(holding.seen)) == (2, 8)
    async with asyncio.timeout(WITHIN):
        await server.generations.retired()


async def test_a_reload_that_lowers_the_limit_keeps_the_streams_running_and_starts_none_until_below(
    http: aiohttp.ClientSession,
    holding: HoldingUpstream,
    serving: Callable[[], Awaitable[Server]],
    tmp_path: Path,
) -> None:
    path = tmp_path / "config.yaml"
    limited(path, ("a", holding, 3))
    server = await serving()
    running = asyncio.create_task(post(http, chat(server), {**STREAM, "n": 3}))
    await holding.wait_for(lambda: holding.active == 3)
    limited(path, ("a", holding, 1))
    assert await server.reload()
    waiting = asyncio.create_task(post(http, chat(server), STREAM))
    await until(lambda: census(server, "a").queued == 1, WITHIN)
    for held in (2, 1):  # the old stream's children end one by one: still none may start
        holding.release(1)
        await until(lambda: census(server, "a").slots_held == held, WITHIN)  # noqa: B023
        assert census(server, "a").queued == 1
    holding.release()
    stream_ok(await running, 3)
    stream_ok(await waiting, 1)
    assert holding.peak == 3  # the old limit's, never more


async def test_a_reload_that_raises_the_limit_grants_the_waiting_children_at_once(
    http: aiohttp.ClientSession,
    holding: HoldingUpstream,
    serving: Callable[[], Awaitable[Server]],
    tmp_path: Path,
) -> None:
    path = tmp_path / "config.yaml"
    limited(path, ("a", holding, 1))
    server = await serving()
    first = asyncio.create_task(post(http, chat(server), STREAM))
    await holding.wait_for(lambda: holding.active == 1)
    queued = asyncio.create_task(post(http, chat(server), {**STREAM, "n": 2}))
    await until(lambda: census(server, "a").queued == 2, WITHIN)
    limited(path, ("a", holding, 3))
    assert await server.reload()
    await holding.wait_for(lambda: holding.active == 3)  # the first stream still open
    holding.release()
    stream_ok(await first, 1)
    stream_ok(await queued, 2)


async def test_an_upstream_dropped_and_named_again_while_its_stream_runs_finds_its_line(
    http: aiohttp.ClientSession,
    holding: HoldingUpstream,
    backend: Backend,
    serving: Callable[[], Awaitable[Server]],
    tmp_path: Path,
) -> None:
    path = tmp_path / "config.yaml"
    limited(path, ("a", holding, 1))
    server = await serving()
    running = asyncio.create_task(post(http, chat(server), STREAM))
    await holding.wait_for(lambda: holding.active == 1)
    limited(path, ("b", backend, 1))
    assert await server.reload()
    limited(path, ("a", holding, 1), ("b", backend, 1))
    assert await server.reload()
    again = asyncio.create_task(post(http, chat(server), STREAM))
    await until(lambda: census(server, "a").queued == 1 or holding.active > 1, WITHIN)
    assert holding.active == 1
    holding.release()
    stream_ok(await running, 1)
    stream_ok(await again, 1)
    assert holding.peak == 1


async def test_the_old_generations_health_checks_stop_at_the_hand_over(
    http: aiohttp.ClientSession,
    holding: HoldingUpstream,
    serving: Callable[[], Awaitable[Server]],
    tmp_path: Path,
) -> None:
    path = tmp_path / "config.yaml"
    limited(path, ("a", holding, 1))
    server = await serving()
    running = asyncio.create_task(post(http, chat(server), STREAM))
    await holding.wait_for(lambda: holding.active == 1)
    old = server.generations.current
    limited(path, ("a", holding, 2))
    assert await server.reload()
    async with asyncio.timeout(WITHIN):  # health checks, discovery, watchdog: all over
        await asyncio.wait(old.upstreams.loops)
    assert old.begun.requests == 1  # while its stream still runs
    old_replica = old.upstreams.state(old.config.upstreams[0]).replicas.get(holding.url)
    new_state = server.upstreams.state(server.config.upstreams[0])
    assert new_state.replicas.get(holding.url) is old_replica  # one replica, checked by the new
    holding.release()
    stream_ok(await running, 1)


# --- the series of what a reload drops (docs/operating.md#reload) ------------------------------

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
# The census's gauges: what every generation still alive holds, read at each scrape.
HELD = {"n_proxy_queue_depth", "n_proxy_slots_in_use", "n_proxy_children_in_flight",
        "n_proxy_replica_outstanding"}  # fmt: skip


async def scrape(http: aiohttp.ClientSession, server: Server) -> Series:
    """Every sample of the admin port's /metrics, by name and labels."""
    async with http.get(f"http://127.0.0.1:{server.admin_port}/metrics") as response:
        text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def naming(found: Series, label: str, value: str) -> set[str]:
    return {name for name, labels in found if (label, value) in labels}


async def test_a_reload_removes_every_series_of_the_replica_and_the_upstream_it_drops(
    http: aiohttp.ClientSession,
    backend: Backend,
    servers: Servers,
    serving: Callable[[], Awaitable[Server]],
    tmp_path: Path,
) -> None:
    """A dead replica's n_proxy_replica_up stays 0 while it is configured; once a reload drops
    it, its series go, and so does every series of an upstream the reload drops."""
    other = await servers.backend()
    dead = f"http://127.0.0.1:{free_port()}"
    path = tmp_path / "config.yaml"
    a = f"{{name: a, urls: ['{backend.url}', '{dead}'], fallback: b}}"
    write_config(path, f"upstreams: [{a}, {{name: b, url: '{other.url}'}}]\n")
    server = await serving()
    up = ("n_proxy_replica_up", (("replica", dead), ("upstream", "a")))
    for _ in range(int(WITHIN / 0.01)):  # until its first health check failed
        if (await scrape(http, server)).get(up) == 0:
            break
        await asyncio.sleep(0.01)
    before = await scrape(http, server)
    assert before[up] == 0
    assert naming(before, "replica", dead) == {
        "n_proxy_replica_up", "n_proxy_ejections_total", "n_proxy_replica_outstanding"
    }  # fmt: skip
    assert "n_proxy_upstream_responses_total" in naming(before, "upstream", "b")
    assert naming(before, "fallback", "b") == {"n_proxy_fallbacks_total"}
    write_config(path, f"upstreams: [{{name: a, url: '{backend.url}'}}]\n")
    assert await server.reload()
    after = await scrape(http, server)
    # What the old generation holds is counted until it retired (all 0 here); the rest is gone.
    assert naming(after, "replica", dead) - HELD == set()
    assert naming(after, "upstream", "b") - HELD == set()
    assert naming(after, "fallback", "b") == set()
    assert after["n_proxy_replica_up", (("replica", backend.url), ("upstream", "a"))] == 1
    assert naming(after, "upstream", "a") == naming(before, "upstream", "a") - {
        "n_proxy_fallbacks_total"
    }
    async with asyncio.timeout(WITHIN):
        await server.generations.retired()
    retired = await scrape(http, server)
    assert naming(retired, "replica", dead) | naming(retired, "upstream", "b") == set()


async def test_series_an_old_request_names_after_the_reload_go_when_its_generation_retires(
    http: aiohttp.ClientSession,
    backend: Backend,
    holding: HoldingUpstream,
    serving: Callable[[], Awaitable[Server]],
    tmp_path: Path,
) -> None:
    """A request that began before the reload is served by the old config to its end: refused
    by the upstream the reload dropped, it counts a 429 there again. Once the old generation's
    last request is over, that series goes too."""
    path = tmp_path / "config.yaml"
    b = f"{{name: b, url: '{holding.url}', max_concurrency: 1, max_queue: 0}}"
    write_config(
        path,
        f"upstreams: [{{name: a, url: '{backend.url}'}}, {b}]\n"
        "routes: [{model: 'held', upstream: b}]\n",
    )
    server = await serving()
    running = asyncio.create_task(post(http, chat(server), {**STREAM, "model": "held"}))
    await holding.wait_for(lambda: holding.active == 1)  # b's one slot taken
    go = asyncio.Event()

    async def slow_body() -> AsyncIterator[bytes]:
        yield b'{"model": "held", '
        await go.wait()
        yield b'"messages": [{"role": "user", "content": "hi"}]}'

    late = asyncio.create_task(post_stream(http, chat(server), slow_body()))
    await until(lambda: server.generations.current.begun.requests == 2, WITHIN)
    write_config(path, f"upstreams: [{{name: a, url: '{backend.url}'}}]\n")
    assert await server.reload()
    assert naming(await scrape(http, server), "upstream", "b") - HELD == set()
    go.set()
    assert await late == 429  # the old config's b, full
    assert metric(server.metrics, "n_proxy_rejected_total", upstream="b") == 1  # named again
    holding.release()
    stream_ok(await running, 1)
    async with asyncio.timeout(WITHIN):
        await server.generations.retired()
    assert naming(await scrape(http, server), "upstream", "b") == set()


async def post_stream(http: aiohttp.ClientSession, url: str, body: AsyncIterator[bytes]) -> int:
    """POST a body that comes in pieces (chunked); the answer's status."""
    headers = {"Content-Type": "application/json"}
    async with asyncio.timeout(WITHIN), http.post(url, data=body, headers=headers) as response:
        await response.read()
        return response.status
