"""A proxy that cannot start says why in one line in its log's format, never a traceback, and
exits non-zero: 2 for a bad flag value or config, 1 for anything else that stopped the start
(docs/operating.md#exit-status). Each failure through the real console entry, as a process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.ports import free_port
from tests.support.servers import Backend

HANG = 60.0  # seconds: a bound on a start that should fail at once, on a loaded machine
# The pure build's own notice at start (proxy.server.process.Server.start), at info: not a
# line about the failure, and the suite runs on both builds.
PURE_NOTICE = "the stream path runs as pure Python"
ONE = "upstreams: [{name: a, url: 'http://127.0.0.1:1'}]\n"
NOT_AN_ADDRESS_HERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never on this host; nothing is sent


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port another program listens on."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


class Exit:
    def __init__(self, status: int, stderr: str) -> None:
        self.status = status
        self.stderr = stderr
        self.lines = [line for line in stderr.splitlines() if PURE_NOTICE not in line]

    def line(self) -> dict[str, Any]:
        """The one line about the failure, as JSON."""
        assert "Traceback" not in self.stderr, self.stderr
        assert len(self.lines) == 1, self.stderr
        parsed: dict[str, Any] = json.loads(self.lines[0])
        assert parsed["level"] == "error"
        return parsed


async def n_proxy(*args: str, python: list[str] | None = None) -> Exit:
    """``python -m proxy ARGS`` to its exit (``python``: another way into the same entry)."""
    command = python or [sys.executable, "-m", "proxy"]
    # Its own session: whatever happens, its workers go down with it (killpg below).
    process = await asyncio.create_subprocess_exec(
        *command,
        *args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(HANG):
            _, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    assert process.returncode is not None
    return Exit(process.returncode, stderr.decode())


# --- listeners ---------------------------------------------------------------------------------


async def test_a_proxy_port_in_use_is_one_json_line_and_status_1(
    backend: Backend, held_port: int
) -> None:
    done = await n_proxy("--upstream", backend.url, "--port", str(held_port))
    assert done.status == 1
    line = done.line()
    assert line["msg"] == "cannot listen; not started"
    assert (line["listener"], line["host"], line["port"]) == ("proxy", "127.0.0.1", held_port)
    assert "address already in use" in line["error"]


async def test_an_admin_port_in_use_names_the_admin_listener(
    backend: Backend, held_port: int
) -> None:
    done = await n_proxy("--upstream", backend.url, "--port", "0", "--admin-port", str(held_port))
    assert done.status == 1
    line = done.line()
    assert (line["msg"], line["listener"], line["port"]) == (
        "cannot listen; not started",
        "admin",
        held_port,
    )


async def test_a_host_that_cannot_be_bound_is_one_line(backend: Backend) -> None:
    done = await n_proxy("--upstream", backend.url, "--host", NOT_AN_ADDRESS_HERE, "--port", "0")
    assert done.status == 1
    line = done.line()
    assert (line["msg"], line["host"]) == ("cannot listen; not started", NOT_AN_ADDRESS_HERE)
    assert "cannot assign requested address" in line["error"]


async def test_text_format_is_one_text_line(backend: Backend, held_port: int) -> None:
    done = await n_proxy(
        "--upstream", backend.url, "--port", str(held_port), "--log-format", "text"
    )
    assert done.status == 1
    assert "Traceback" not in done.stderr
    (line,) = done.lines
    assert " error cannot listen; not started listener=proxy host=127.0.0.1 " in line
    assert f"port={held_port} " in line


async def test_the_demo_backend_failing_to_start_is_one_line() -> None:
    # The demo backend bound where it cannot be: the real bind failure, through the real entry.
    script = (
        "import functools, runpy, proxy.devserver as d\n"
        "d.start_devserver = functools.partial("
        f"d.start_devserver, host={NOT_AN_ADDRESS_HERE!r})\n"
        "runpy.run_module('proxy', run_name='__main__')\n"
    )
    done = await n_proxy("--port", "0", python=[sys.executable, "-c", script])
    assert done.status == 1
    line = done.line()
    assert line["msg"] == "demo backend failed; not started"
    assert "cannot assign requested address" in line["error"]


# --- the config and the flags ------------------------------------------------------------------


def _not_utf8(path: Path) -> None:
    path.write_bytes(b"upstreams: [{name: caf\xe9, url: 'http://127.0.0.1:1'}]\n")


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda path: None, "cannot read: No such file or directory"),
        (lambda path: path.mkdir(), "cannot read: Is a directory"),
        (_not_utf8, "cannot read: not UTF-8 (byte 22)"),
        (lambda path: path.write_text("upstreams: [{name: a, url: nope}]\n"), ": not a URL"),
        (lambda path: path.write_text("upstreams: [\n"), "not valid YAML"),
        (
            lambda path: path.write_text(f"{ONE}max_n: 0\n"),
            "max_n: must be an integer from 1 to 128",
        ),
    ],
    ids=["missing", "a-directory", "not-utf8", "invalid-naming-the-key", "not-yaml", "bad-max_n"],
)
async def test_a_config_that_cannot_be_read_or_is_invalid_is_one_line_and_status_2(
    tmp_path: Path, make: Any, error: str
) -> None:
    path = tmp_path / "config.yaml"
    make(path)
    done = await n_proxy("--config", str(path))
    assert done.status == 2
    line = done.line()
    assert line["msg"] == "config error; not started"
    assert line["config"] == str(path)
    assert error in line["error"]


async def test_the_invalid_key_is_named_as_check_config_names_it(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("upstreams: [{name: a, url: 'http://127.0.0.1:1'}, {name: b, url: nope}]\n")
    done = await n_proxy("--config", str(path))
    assert done.line()["error"] == "upstreams[1].url: not a URL"
    checked = await n_proxy("check-config", str(path))
    assert checked.stderr == f"{path}: upstreams[1].url: not a URL\n"
    assert checked.status == 1


async def test_a_bad_flag_value_is_a_config_error_with_status_2() -> None:
    done = await n_proxy("--upstream", "http://127.0.0.1:1", "--max-n", "500")
    assert done.status == 2
    line = done.line()
    assert (line["msg"], line["config"]) == ("config error; not started", None)
    assert line["error"] == "--max-n: must be an integer from 1 to 128"


async def test_the_configs_log_format_is_used_once_the_config_loaded(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "log_format: text\nupstreams: [{name: a, url: 'http://127.0.0.1:1', max_concurrency: 2}]\n"
    )
    done = await n_proxy("--config", str(path), "--workers", "3")
    assert done.status == 2
    assert "Traceback" not in done.stderr
    (line,) = done.lines
    assert " error config error; not started " in line
    assert (
        'error="upstreams[0].max_concurrency: 2 cannot be divided among 3 workers (each needs at '
        'least one); run at most 2 workers or raise it"'
    ) in line
    # The flag wins over the file.
    done = await n_proxy("--config", str(path), "--workers", "3", "--log-format", "json")
    assert done.line()["workers"] == 3


async def test_workers_without_an_upstream_is_a_usage_error_with_status_2() -> None:
    done = await n_proxy("--workers", "2")
    assert done.status == 2
    line = done.line()
    assert (line["msg"], line["error"]) == (
        "usage error; not started",
        "--workers needs --upstream or --config",
    )


# --- --workers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("listener", ["proxy", "admin"])
async def test_under_workers_a_port_in_use_is_one_line_from_the_supervisor(
    backend: Backend, held_port: int, listener: str
) -> None:
    ports = {"proxy": str(free_port()), "admin": str(free_port()), listener: str(held_port)}
    done = await n_proxy(
        "--upstream", backend.url, "--workers", "2",
        "--port", ports["proxy"], "--admin-port", ports["admin"],
    )  # fmt: skip
    assert done.status == 1
    line = done.line()
    assert (line["msg"], line["listener"], line["port"]) == (
        "cannot listen; not started",
        listener,
        held_port,
    )
    assert "worker" not in line  # no worker was started


async def test_a_worker_that_cannot_listen_logs_one_line_and_the_supervisor_fails(
    backend: Backend,
) -> None:
    # The same port for both listeners: each is free alone, so the supervisor's check passes,
    # and worker 0 finds the port its own proxy listener took when it binds the admin one.
    port = str(free_port())
    done = await n_proxy(
        "--upstream", backend.url, "--workers", "2", "--port", port, "--admin-port", port
    )
    assert done.status == 1
    assert "Traceback" not in done.stderr
    lines = [json.loads(line) for line in done.lines]
    (error,) = [line for line in lines if line["level"] == "error"]
    assert (error["msg"], error["listener"], error["worker"]) == (
        "cannot listen; not started",
        "admin",
        0,
    )
    # Worker 1, stopped by the supervisor, may have begun to serve: its drain, and nothing else.
    assert [line["msg"] for line in lines if line is not error] in ([], ["draining"])
