"""Runs llama.cpp's own server (the llama-server embedded in the xllamacpp wheel) for the test
suite and the bench.

The server lives in a child process: its native threads never share pytest's process, and a
hung or crashed server is ended by killing one pid. The child exits when its stdin closes, so it
also goes away when pytest itself dies.
"""

import asyncio
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

READY_MARKER = "LLAMA_SERVER_LISTENING "
STARTUP_TIMEOUT_S = 60.0  # a bound on a hang: on an idle machine it starts in under a second
STOP_TIMEOUT_S = 5.0

# Port 0 lets the kernel pick a free port inside the server itself, so there is no window in
# which another process could take a port we probed. stdout is pointed at stderr after the
# marker line so that nothing can ever block on a full stdout pipe.
_CHILD_SOURCE = f"""
import json, os, sys
import xllamacpp

cfg = json.loads(sys.argv[1])
params = xllamacpp.CommonParams()
params.model.path = cfg["model"]
params.hostnames = ["127.0.0.1"]
params.port = 0
params.n_parallel = cfg["n_parallel"]
params.n_ctx = cfg["n_ctx"]
params.n_threads_http = cfg["n_threads_http"]
params.cpuparams.n_threads = cfg["n_threads"]
params.cpuparams_batch.n_threads = cfg["n_threads"]
server = xllamacpp.Server(params)
print({READY_MARKER!r} + server.listening_address, flush=True)
os.dup2(2, 1)
sys.stdin.read()
del server
"""


@dataclass(frozen=True)
class LlamaServer:
    """A running server: ``base_url`` is ``http://127.0.0.1:PORT`` (no trailing slash)."""

    base_url: str
    model_path: Path
    pid: int
    log_path: Path


def _log_tail(log_path: Path, lines: int = 30) -> str:
    text = log_path.read_text(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _read_address(proc: subprocess.Popen[str], deadline: float) -> str:
    assert proc.stdout is not None
    while (remaining := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([proc.stdout], [], [], remaining)
        if not readable:
            break
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama server exited early with code {proc.wait()}")
        if line.startswith(READY_MARKER):
            return line[len(READY_MARKER) :].strip().rstrip("/")
    raise TimeoutError("llama server did not report its address in time")


def _wait_healthy(base_url: str, deadline: float) -> None:
    # The server is a foreign process with no readiness signal besides /health, so polling is
    # the contract here; the loop is bounded by the deadline and sleeps only between probes.
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{base_url}/health did not answer 200 in time")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)
    if proc.stdout is not None:
        proc.stdout.close()


@contextmanager
def llama_server(
    model_path: Path,
    *,
    n_parallel: int = 1,
    n_ctx: int = 512,
    n_threads: int = 1,
    n_threads_http: int = 16,
    startup_timeout: float = STARTUP_TIMEOUT_S,
) -> Iterator[LlamaServer]:
    """Starts a server on 127.0.0.1 for ``model_path``; stops it (and waits for it) on exit.

    ``n_parallel=1`` makes the server reject ``n != 1`` with 400 and queue concurrent requests.
    ``n_threads_http`` is generous because every idle keep-alive connection of a client pool
    pins one of the server's HTTP threads.
    """
    cfg = {
        "model": str(model_path),
        "n_parallel": n_parallel,
        "n_ctx": n_ctx,
        "n_threads": n_threads,
        "n_threads_http": n_threads_http,
    }
    fd, log_name = tempfile.mkstemp(prefix="llama-server-", suffix=".log", dir=model_path.parent)
    log_path = Path(log_name)
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD_SOURCE, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        deadline = time.monotonic() + startup_timeout
        try:
            base_url = _read_address(proc, deadline)
            _wait_healthy(base_url, deadline)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; server log tail:\n{_log_tail(log_path)}") from exc
        yield LlamaServer(base_url=base_url, model_path=model_path, pid=proc.pid, log_path=log_path)
    finally:
        _stop(proc)


@asynccontextmanager
async def start_llama_server(
    model_path: Path,
    *,
    n_parallel: int = 1,
    n_ctx: int = 512,
    n_threads: int = 1,
    n_threads_http: int = 16,
) -> AsyncIterator[LlamaServer]:
    """Async form of :func:`llama_server`; blocking start and stop run in a worker thread."""
    with ExitStack() as stack:
        cm = llama_server(
            model_path,
            n_parallel=n_parallel,
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_threads_http=n_threads_http,
        )
        server = await asyncio.to_thread(stack.enter_context, cm)
        try:
            yield server
        finally:
            await asyncio.to_thread(stack.close)
