"""The listen backlog of the proxy, admin and demo backend listeners, as the kernel reports it
(``ss``), and where its number comes from."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config.models import Listen, single_upstream_config
from proxy.devserver import DevConfig, start_devserver
from proxy.server.backlog import FLOOR, SOMAXCONN, listen_backlog
from proxy.server.process import Server
from tests.support.ports import free_port
from tests.support.servers import Backend

WITHIN = 30.0  # seconds any one wait may take


def kernel_backlog(port: int) -> int:
    """The backlog of the socket listening on ``port``: ``ss`` shows it as a listener's
    Send-Q (the kernel's ``sk_max_ack_backlog``, after its cap at ``somaxconn``)."""
    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    (line,) = out.splitlines()
    return int(line.split()[2])


def expected() -> int:
    """What a listener asking for ``listen_backlog()`` gets: Linux caps it at somaxconn."""
    somaxconn = int(SOMAXCONN.read_text())
    assert somaxconn > 128, "a system that caps every listener at aiohttp's default"
    return min(listen_backlog(), somaxconn)


@pytest.mark.parametrize(
    ("somaxconn", "backlog"), [("128\n", FLOOR), ("4096\n", 4096), ("65535", 65535)]
)
def test_the_backlog_is_somaxconn_and_at_least_nginx_s(
    tmp_path: Path, somaxconn: str, backlog: int
) -> None:
    (tmp_path / "somaxconn").write_text(somaxconn)
    assert listen_backlog(tmp_path / "somaxconn") == backlog


def test_without_a_readable_somaxconn_the_backlog_is_nginx_s(tmp_path: Path) -> None:
    assert listen_backlog(tmp_path / "missing") == FLOOR
    (tmp_path / "garbled").write_text("lots")
    assert listen_backlog(tmp_path / "garbled") == FLOOR


@pytest.mark.parametrize("listener", ["proxy", "admin"])
async def test_the_proxy_and_admin_listeners_queue_more_than_aiohttp_s_128(
    backend: Backend, listener: str
) -> None:
    config = single_upstream_config(backend.url).model_copy(
        update={
            "listen": Listen(host="127.0.0.1", port=0),
            "admin": Listen(host="127.0.0.1", port=0),
        }
    )
    server = Server(config)
    await server.start()
    try:
        port = server.proxy_port if listener == "proxy" else server.admin_port
        assert kernel_backlog(port) == expected()
    finally:
        await server.close()


async def test_the_demo_backend_listener_queues_more_than_aiohttp_s_128() -> None:
    runner, port, _ = await start_devserver(DevConfig())
    try:
        assert kernel_backlog(port) == expected()
    finally:
        await runner.cleanup()


async def test_the_devserver_command_listens_with_the_same_backlog() -> None:
    port = free_port()
    command = [sys.executable, "-m", "proxy.devserver", "--port", str(port)]
    process = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        async with asyncio.timeout(WITHIN):
            while b"Running on" not in await process.stdout.readline():
                pass
        assert kernel_backlog(port) == expected()
    finally:
        process.terminate()
        await process.wait()
