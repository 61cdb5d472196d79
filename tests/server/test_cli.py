"""The ``n-proxy`` command as a new user runs it: a real process on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.request
from asyncio.subprocess import Process
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.cli import main
from proxy.server.memory import YOUNG_THRESHOLD
from proxy.server.workers import EXIT_MARGIN, MiB, announce
from tests.support.ports import free_port
from tests.support.servers import with_upstream


def test_demo_mode_serves_n3_and_drains_on_sigterm() -> None:
    command = [sys.executable, "-m", "proxy", "--port", "0", "--admin-port", "0"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            assert process.stderr is not None
            banner = [process.stdout.readline(), process.stdout.readline()]
            assert "demo backend" in banner[0]
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", banner[1])
            assert found, banner
            # A client that forgot --upstream and asks for a real model: every answer says demo.
            body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "n": 3}
            request = urllib.request.Request(
                found.group(1) + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                assert "demo backend" in response.headers["X-N-Proxy-Demo"]
                answer = json.load(response)
            assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
            assert answer["model"] == "demo"
            for _ in range(5):  # n=1: passed through, for the log's durations below
                single = urllib.request.Request(
                    found.group(1) + "/v1/chat/completions",
                    data=json.dumps({**body, "n": 1}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(single, timeout=10) as response:
                    assert "demo backend" in response.headers["X-N-Proxy-Demo"]
                    single_answer = json.load(response)
                assert len(single_answer["choices"]) == 1
                assert single_answer["model"] == "demo"
            with urllib.request.urlopen(found.group(1) + "/v1/models", timeout=10) as response:
                assert "demo backend" in response.headers["X-N-Proxy-Demo"]
                assert [m["id"] for m in json.load(response)["data"]] == ["demo"]
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
            lines = process.stderr.read().splitlines()
        finally:
            if process.poll() is None:
                process.kill()
    log = [json.loads(line) for line in lines if line.startswith("{")]
    requests = [entry for entry in log if entry["msg"] == "request"]
    # n=3, five n=1 and the /v1/models list (logged as n=1: not fanned out)
    assert [(r["n"], r["children"], r["status"]) for r in requests] == [(3, 3, 200)] + [
        (1, 0, 200)
    ] * 6
    # Timed finer than uvloop's loop.time(), which moves in whole milliseconds.
    assert any(r["duration_ms"] != round(r["duration_ms"]) for r in requests)


async def test_a_configured_upstream_answers_without_the_demo_notice(
    proxy: Any, http: aiohttp.ClientSession
) -> None:
    body = {"model": "my-model", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    async with http.post(proxy.url + "/v1/chat/completions", json=body) as response:
        assert "X-N-Proxy-Demo" not in response.headers
        assert (await response.json())["model"] == "my-model"


async def test_demo_notice_is_on_every_kind_of_answer(
    make_backend: Any, http: aiohttp.ClientSession
) -> None:
    """Fan-out JSON and SSE (built by the proxy), pass-through (the backend's), and errors."""
    from proxy.cli import DEMO_MODEL, DEMO_NOTICE
    from proxy.config.models import single_upstream_config
    from proxy.server.app import build_app

    backend = await make_backend(model=DEMO_MODEL, model_override=True)
    runner = web.AppRunner(build_app(single_upstream_config(backend.url), notice=DEMO_NOTICE))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    try:
        for body, status in [
            ({**chat, "n": 2}, 200),
            ({**chat, "n": 2, "stream": True}, 200),
            (chat, 200),
            ({**chat, "n": 0}, 400),
        ]:
            async with http.post(url, json=body) as response:
                assert response.status == status
                assert response.headers.getall("X-N-Proxy-Demo") == [DEMO_NOTICE]
                text = await response.text()
            if status == 200:
                assert f'"model":"{DEMO_MODEL}"' in text.replace(" ", "")
                assert "gpt-4o" not in text
    finally:
        await runner.cleanup()


def test_version_flag_prints_the_package_version() -> None:
    import proxy

    done = subprocess.run(
        [sys.executable, "-m", "proxy", "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout == f"n-proxy {proxy.__version__}\n"
    # One source for the version: the wheel's metadata reads the same attribute.
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "proxy.__version__"}


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        (["check-config", "--help"], "usage: n-proxy check-config [-h] FILE"),
        (["config-schema", "--help"], "usage: n-proxy config-schema [-h]"),
        (["--help"], "usage: n-proxy [-h] [--version]"),
    ],
)
def test_every_command_has_help(
    command: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(command)
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(usage)


def test_check_config_needs_exactly_one_file(capsys: pytest.CaptureFixture[str]) -> None:
    for args in ([], ["a.yaml", "b.yaml"]):
        with pytest.raises(SystemExit) as exit_:
            main(["check-config", *args])
        assert exit_.value.code == 2
        assert "usage: n-proxy check-config" in capsys.readouterr().err


def test_check_config_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("upstreams: [{name: a, url: 'http://127.0.0.1:8000'}]\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstreams: [{name: a, url: 'http://127.0.0.1:8000'}, {name: b, url: nope}]\n")
    assert main(["check-config", str(good)]) == 0
    assert main(["check-config", str(bad)]) == 1
    assert "upstreams[1].url: not a URL" in capsys.readouterr().err


@pytest.mark.parametrize(
    "example", sorted((Path(__file__).resolve().parents[2] / "config").glob("*.yaml"))
)
def test_shipped_config_examples_pass_check_config(
    example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAT_API_KEY", "example-key")
    assert main(["check-config", str(example)]) == 0


async def _start_workers(
    backend: Any, port: int, admin: int, stderr: int | None = None
) -> tuple[Process, list[int]]:
    """``n-proxy --workers 2`` and its workers' pids, once both serve."""
    command = [
        sys.executable, "-m", "proxy", "--upstream", backend.url, "--workers", "2",
        "--port", str(port), "--admin-port", str(admin),
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE, stderr=stderr)
    assert process.stdout is not None
    try:
        async with asyncio.timeout(60):
            banners = [(await process.stdout.readline()).decode() for _ in range(2)]
    except BaseException:
        await _end(process, [])
        raise
    pids = [int(pid) for banner in banners for pid in re.findall(r"pid (\d+)", banner)]
    assert len(set(pids)) == 2, banners
    return process, pids


async def _end(process: Process, workers: list[int]) -> None:
    """Whatever a test left running, gone (``workers``: those not yet seen to exit); bounded: the
    workers hold the supervisor's stdout, and asyncio's ``wait`` waits for it to close as well as
    for the supervisor to exit."""
    for pid in [process.pid, *workers]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    async with asyncio.timeout(30):
        await process.wait()


async def test_workers_share_one_port_and_metrics_add_up(make_backend: Any) -> None:
    backend = await make_backend()
    port, admin = free_port(), free_port()
    process, workers = await _start_workers(backend, port, admin)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}
        async with aiohttp.ClientSession() as http:
            for _ in range(20):
                # a fresh connection each time, so the kernel spreads them over the workers
                async with http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json=body,
                    headers={"Connection": "close"},
                ) as response:
                    assert response.status == 200
            async with http.get(f"http://127.0.0.1:{admin}/metrics") as response:
                text = await response.text()
        total = sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "n_proxy_requests_total"
        )
        assert total == 20
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):  # a generous bound: a busy machine is slow, not wrong
            assert await process.wait() == 0
        workers.clear()  # waited for by their supervisor: their pids may be another's now
    finally:
        await _end(process, workers)


async def test_workers_stop_when_their_supervisor_is_killed(make_backend: Any) -> None:
    """A supervisor SIGKILLed (the OOM killer) forwards no SIGTERM: its workers must not serve on,
    unsupervised, on the port a new n-proxy would share with them (SO_REUSEPORT)."""
    backend = await make_backend()
    port, admin = free_port(), free_port()
    process, workers = await _start_workers(backend, port, admin, stderr=subprocess.PIPE)
    try:
        process.kill()
        assert process.stdout is not None
        assert process.stderr is not None
        # The workers hold the supervisor's stdout and stderr: their end of file is the workers'
        # exit (the multiprocessing resource tracker's too, which leaves once they have).
        async with asyncio.timeout(60):
            await process.stdout.read()
            lines = (await process.stderr.read()).decode().splitlines()
            assert await process.wait() == -signal.SIGKILL
        workers.clear()  # gone: their pids may be another's now
        said = [json.loads(line)["msg"] for line in lines if line.startswith("{")]
        assert said.count("the supervisor is gone; stopping") == 2, lines
        with pytest.raises(ConnectionRefusedError):  # nobody listens on the port any more
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        await _end(process, workers)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 2),
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
    ids=["v2-unlimited", "v2-1.5", "v2-0.5", "v1-1", "v1-unlimited", "none"],
)
def test_workers_auto_is_the_cgroup_cpu_quota_within_the_affinity(
    tmp_path: Path, files: dict[str, str], expected: int | None
) -> None:
    from proxy.server.workers import available_cpus

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path) == (affinity if expected is None else min(expected, affinity))


def test_workers_flag_takes_auto_or_a_positive_count() -> None:
    from proxy.cli import AUTO, _parser

    assert _parser().parse_args(["--workers", "auto"]).workers == AUTO  # resolved with the config
    assert _parser().parse_args(["--workers", "3"]).workers == 3
    with pytest.raises(SystemExit):
        _parser().parse_args(["--workers", "0"])


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"memory.max": "max\n"}, None),
        ({"memory.max": f"{512 * MiB}\n"}, 1),  # the sidecar's 512Mi: (512 - 64) // 256
        ({"memory.max": f"{1024 * MiB}\n"}, 3),  # the gateway's 1Gi
        ({"memory.max": f"{1024 * MiB}\n", "cpu.max": "200000 100000\n"}, 2),  # CPU the lower
        ({"memory.max": f"{100 * MiB}\n"}, 1),  # never below one
        ({"memory/memory.limit_in_bytes": f"{2048 * MiB}\n"}, 7),
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1 "unlimited"
    ],
    ids=["v2-unlimited", "v2-512Mi", "v2-1Gi", "v2-1Gi-2cpu", "v2-100Mi", "v1-2Gi", "v1-max"],
)
def test_workers_auto_is_capped_by_the_cgroup_memory_limit(
    tmp_path: Path, files: dict[str, str], expected: int | None
) -> None:
    from proxy.server.workers import auto_workers

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    cpus = len(os.sched_getaffinity(0))
    if "cpu.max" in files:
        cpus = min(cpus, 2)
    assert auto_workers(tmp_path) == (cpus if expected is None else min(expected, cpus))


# --- Limits are the proxy's, whatever the worker count (docs/operating.md#workers-and-limits) -


@pytest.mark.parametrize(
    ("total", "count", "shares"),
    [(4096, 2, [2048, 2048]), (10, 3, [4, 3, 3]), (5, 5, [1] * 5), (7, 1, [7]), (3, 2, [2, 1])],
)
def test_each_worker_enforces_its_share_of_the_limits_and_the_shares_add_up(
    total: int, count: int, shares: list[int]
) -> None:
    from proxy.config.models import Listen, single_upstream_config
    from proxy.server.workers import worker_config

    config = single_upstream_config("http://127.0.0.1:1", max_connections=total + 1)
    config = with_upstream(config, max_concurrency=total, max_queue=total - 1)
    config = config.model_copy(update={"admin": Listen(port=0)})
    workers = [worker_config(config, index, count) for index in range(count)]
    assert [w.upstreams[0].max_concurrency for w in workers] == shares
    assert sum(w.upstreams[0].max_queue for w in workers) == total - 1
    assert sum(w.max_connections for w in workers) == total + 1
    assert all(w.upstreams[0].max_concurrency >= 1 and w.max_connections >= 1 for w in workers)
    assert [w.admin is not None for w in workers] == [True] + [False] * (count - 1)
    floor = config.upstreams[0].retry_budget.min_per_second
    assert sum(w.upstreams[0].retry_budget.min_per_second for w in workers) == pytest.approx(floor)
    # Everything else is the configured value.
    strip = {"max_concurrency": 0, "max_queue": 0, "retry_budget": config.upstreams[0].retry_budget}
    for worker in workers:
        assert with_upstream(worker, **strip).model_copy(
            update={"max_connections": 1, "admin": None}
        ) == with_upstream(config, **strip).model_copy(update={"max_connections": 1, "admin": None})


def _integer_limits(config: Any) -> dict[str, list[int]]:
    """Every integer field of the config and of each upstream, as ``name: [value, ...]``."""
    sections = [("", [config]), ("upstreams.", list(config.upstreams))]
    return {
        prefix + name: [getattr(value, name) for value in values]
        for prefix, values in sections
        for name in type(values[0]).model_fields
        if all(type(getattr(value, name)) is int for value in values)
    }


@pytest.mark.parametrize("count", [2, 3, 4])
def test_every_limit_the_schema_calls_a_total_is_divided_and_the_shares_add_up_to_it(
    count: int,
) -> None:
    """The schema tells users which limits are the proxy's totals under --workers N; those are
    exactly the integers ``worker_config`` divides, and each one's shares sum to the total."""
    from proxy.config.models import config_schema, parse_config
    from proxy.server.workers import worker_config

    schema = config_schema()
    said = "with --workers N each worker enforces its share"
    sections = [
        ("", schema["properties"]),
        ("upstreams.", schema["$defs"]["Upstream"]["properties"]),
    ]
    totals = {
        prefix + name
        for prefix, properties in sections
        for name, field in properties.items()
        if said in field.get("description", "")
    }
    config = parse_config(
        "max_connections: 11\n"
        "upstreams:\n"
        "  - {name: a, url: 'http://127.0.0.1:1', max_concurrency: 7, max_queue: 9}\n"
        "  - {name: b, url: 'http://127.0.0.1:2', max_concurrency: 10, max_queue: 4}\n",
        {},
    )
    configured = _integer_limits(config)
    shares = [_integer_limits(worker_config(config, index, count)) for index in range(count)]
    divided = {name for name in configured if any(s[name] != configured[name] for s in shares)}
    assert (
        divided == totals == {"max_connections", "upstreams.max_concurrency", "upstreams.max_queue"}
    )
    for name in divided:
        for at, total in enumerate(configured[name]):
            parts = [s[name][at] for s in shares]
            assert sum(parts) == total, name
            assert max(parts) - min(parts) <= 1, name  # as even as integers allow


def test_a_banner_leaves_in_one_write_so_workers_sharing_stdout_never_split_a_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Unbuffered (PYTHONUNBUFFERED), print() writes a line and its newline apart: two workers'
    # banners then came out as "banner banner" and an empty line.
    writes: list[str] = []

    class Stdout:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Stdout())
    announce("n-proxy: worker 1 (pid 7) listening on http://127.0.0.1:8080")
    assert writes == ["n-proxy: worker 1 (pid 7) listening on http://127.0.0.1:8080\n"]


async def test_two_workers_send_the_upstream_at_most_max_concurrency_children_at_once(
    tmp_path: Path,
) -> None:
    """Each worker holds 1 of the 2 slots: both busy at once reach 2 upstream, never 4."""
    in_flight, peak = 0, 0
    full, release = asyncio.Event(), asyncio.Event()

    async def complete(request: web.Request) -> web.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight >= 2:
            full.set()
        try:
            await asyncio.wait_for(release.wait(), 30)
        finally:
            in_flight -= 1
        message = {"role": "assistant", "content": "a"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m"}
        return web.json_response({**body, "choices": [choice], "usage": usage})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    upstream = f"http://127.0.0.1:{runner.addresses[0][1]}"
    path = tmp_path / "config.yaml"
    path.write_text(f"upstreams: [{{name: a, url: '{upstream}', max_concurrency: 2}}]\n")
    port = free_port()
    command = [sys.executable, "-m", "proxy", "--config", str(path), "--workers", "2"]
    command += ["--port", str(port)]
    # Its own session: on a failure the workers go down with the supervisor (killpg below).
    process = await asyncio.create_subprocess_exec(
        *command, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert process.stdout is not None
        for _ in range(2):
            assert "listening" in (await process.stdout.readline()).decode()
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}
        async with aiohttp.ClientSession() as http:

            async def ask() -> int:
                # A fresh connection each, so the kernel spreads them over both workers.
                async with http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json=body,
                    headers={"Connection": "close"},
                ) as response:
                    await response.read()
                    return response.status

            asks = [asyncio.ensure_future(ask()) for _ in range(16)]
            await asyncio.wait_for(full.wait(), 20)  # both workers hold their one slot
            await asyncio.sleep(0.5)  # room for any child past the limit to arrive
            assert peak == 2
            release.set()
            assert await asyncio.wait_for(asyncio.gather(*asks), 30) == [200] * 16
        assert peak == 2
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 15) == 0
    finally:
        release.set()
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await asyncio.wait_for(process.wait(), 10)
        await runner.cleanup()


async def test_a_worker_that_never_exits_is_killed_past_its_drain_and_the_supervisor_exits(
    make_backend: Any, tmp_path: Path
) -> None:
    backend = await make_backend()
    path = tmp_path / "config.yaml"
    path.write_text(
        f"upstreams: [{{name: a, url: '{backend.url}'}}]\n"
        "drain_seconds: 0.5\ndrain_grace_seconds: 0.1\n"
    )
    command = [sys.executable, "-m", "proxy", "--config", str(path), "--workers", "2"]
    command += ["--port", str(free_port())]
    # Its own session: whatever happens, the workers go down with it (killpg below).
    process = await asyncio.create_subprocess_exec(
        *command, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert process.stdout is not None
        banners = [(await process.stdout.readline()).decode() for _ in range(2)]
        stuck = int(re.findall(r"pid (\d+)", banners[0])[0])
        os.kill(stuck, signal.SIGSTOP)  # a hung worker: it will never handle its SIGTERM
        process.send_signal(signal.SIGTERM)
        # The bound: the drain, the margin, and room for a loaded machine.
        assert await asyncio.wait_for(process.wait(), 0.5 + EXIT_MARGIN + 15) == 1
        with pytest.raises(ProcessLookupError):
            os.kill(stuck, 0)  # killed, and reaped by the supervisor
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await asyncio.wait_for(process.wait(), 10)


def test_a_serving_process_freezes_its_start_up_objects_out_of_the_collector() -> None:
    """``run`` settles the cyclic collector before the proxy is announced (proxy.server.memory):
    what start-up made is frozen, so a full collection under load scans only what the requests
    hold, and young collections come every YOUNG_THRESHOLD objects rather than 700."""
    script = """
import asyncio, gc, json, os, signal
from proxy.config.models import Listen, single_upstream_config
from proxy.server.process import Server, run

async def main() -> None:
    config = single_upstream_config(
        "http://127.0.0.1:9", listen=Listen(host="127.0.0.1", port=0),
        drain_seconds=0.1, drain_grace_seconds=0.0,
    )
    server = Server(config)
    await server.start()
    before = gc.get_freeze_count(), gc.get_threshold()

    def ready() -> None:
        after = gc.get_freeze_count(), gc.get_threshold(), len(gc.get_objects())
        print(json.dumps([before, after]), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    await run(server, ready=ready)

asyncio.run(main())
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (frozen_before, thresholds_before), (frozen, thresholds, tracked) = json.loads(done.stdout)
    assert frozen_before == 0
    assert thresholds_before == [700, 10, 10]
    assert thresholds == [YOUNG_THRESHOLD, 10, 10]
    assert frozen > 20_000  # the modules, the app and the config
    assert tracked < frozen / 10  # what a later full collection scans
