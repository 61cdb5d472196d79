"""SIGHUP reload: the file is read and validated again; new requests use the new config while a
request in flight ends on the one it began with; a bad file keeps the running config."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.config.models import load_config
from proxy.server.process import Server
from tests.support.logs import capture_logs
from tests.support.ports import free_port
from tests.support.servers import Backend, Servers

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
WITHIN = 20.0  # seconds: a bound on every wait, not a timing


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


def metric(server: Server, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(server.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


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
    assert metric(started, "n_proxy_config_reloads_total", result="ok") == 1


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
    assert metric(started, "n_proxy_config_reloads_total", result="failed") == 1
    assert metric(started, "n_proxy_config_reloads_total", result="ok") == 0


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
