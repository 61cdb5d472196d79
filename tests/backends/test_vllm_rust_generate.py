"""Opt-in: n for vLLM's generate endpoint behind vLLM's Rust frontend, which serves n = 1 only
(docs/behaviour.md#generate, docs/backends.md#vllm).

Through n-proxy, each choice of an ``n = k`` request must be the Rust frontend's own ``n = 1``
answer for ``seed + i``: the same token ids, logprobs, finish and stop reasons; and the Rust
frontend's own refusal of ``n > 1`` is what n-proxy exists to lift.

The Rust frontend is the session's ``vllm_rust_url`` (tests/backends/conftest.py), with
``/inference/v1/generate`` served; unless its opt-in variables are set these tests are skipped
with the reason.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.config.models import Config, single_upstream_config
from tests.support.client import post, sse_payloads
from tests.support.servers import Proxy

pytestmark = [pytest.mark.vllm_rust, pytest.mark.timeout(300), pytest.mark.http_timeout(120)]

GENERATE = "/inference/v1/generate"
PROMPT = [60, 61, 62, 63, 64]  # within the tiny model's vocabulary
SEED = 77
N = 4


@pytest.fixture
def rust_url(vllm_rust_url: str) -> str:
    return vllm_rust_url  # tests/backends/conftest.py; skipped with its reason unless opted in


def body(n: int | None, seed: int, **fields: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"seed": seed, "max_tokens": 8, "logprobs": 1}
    if n is not None:
        params["n"] = n
    return {"model": "tiny", "token_ids": PROMPT, "sampling_params": params, **fields}


async def own_choice(http: aiohttp.ClientSession, url: str, seed: int) -> dict[str, Any]:
    status, raw, _ = await post(http, url + GENERATE, body(None, seed))
    assert status == 200, raw
    (choice,) = orjson.loads(raw)["choices"]
    assert isinstance(choice, dict)
    return choice


async def test_the_rust_frontend_refuses_generate_n_above_one(
    http: aiohttp.ClientSession, rust_url: str
) -> None:
    status, raw, _ = await post(http, rust_url + GENERATE, body(N, SEED))
    assert status == 400
    error = orjson.loads(raw)["error"]
    assert (error["message"], error["param"]) == ("Only n=1 is supported.", "n")


async def test_each_generate_choice_is_the_rust_frontends_own_answer_for_seed_plus_i(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    rust_url: str,
) -> None:
    proxy = await make_proxy(single_upstream_config(rust_url))
    status, raw, _ = await post(http, proxy.url + GENERATE, body(N, SEED), "grp")
    assert status == 200, raw
    merged = orjson.loads(raw)
    alone = [await own_choice(http, rust_url, SEED + i) for i in range(N)]
    assert merged["choices"] == [{**choice, "index": i} for i, choice in enumerate(alone)]
    assert len({tuple(c["token_ids"]) for c in alone}) == N  # choices that differ
    assert "grp" in merged["request_id"]
    assert "0_grp" not in merged["request_id"]


async def test_a_generate_stream_through_n_proxy_joins_into_the_rust_frontends_answers(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    rust_url: str,
) -> None:
    proxy = await make_proxy(single_upstream_config(rust_url))
    status, raw, _ = await post(http, proxy.url + GENERATE, body(N, SEED, stream=True), "st")
    assert status == 200, raw
    payloads = sse_payloads(raw)
    assert payloads.count("[DONE]") == 1
    assert payloads[-1] == "[DONE]"
    tokens: dict[int, list[int]] = {}
    finishes: dict[int, str] = {}
    for chunk in payloads[:-1]:
        for choice in chunk["choices"]:
            tokens.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
            if choice.get("finish_reason") is not None:
                finishes[choice["index"]] = choice["finish_reason"]
    for i in range(N):
        alone = await own_choice(http, rust_url, SEED + i)
        assert tokens[i] == alone["token_ids"], f"choice {i}"
        assert finishes[i] == alone["finish_reason"], f"choice {i}"
