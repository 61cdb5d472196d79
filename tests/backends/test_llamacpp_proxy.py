"""n-proxy in front of llama.cpp's own server: n>1, best_of and prompt lists, end to end.

Each expected choice is what the same server answers when asked directly for n=1 with seed + i.
The clients are the official openai client and raw aiohttp, where the SSE bytes matter.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI, LengthFinishReasonError, Omit, OpenAI, omit
from openai.types.chat import ChatCompletionStreamOptionsParam

from proxy.config.models import Config, single_upstream_config
from tests.support.llamacpp import CHAT, COMPLETIONS, MESSAGES, PROMPT, request_body
from tests.support.servers import Proxy

OTHER_PROMPT = "tell me more"
SEED = 100
N = 3
MAX_TOKENS = 8
TIMEOUT = aiohttp.ClientTimeout(total=60)  # a bound on a hang, for a loaded machine
DONE = "data: [DONE]\n\n"
INVALID = "invalid_request_error"
N3_REJECTED = "Field 'n': Value must be between 1 <= value <= 1, but got 3"
Headers = dict[str, str] | None


@pytest.fixture
async def proxy_url(make_proxy: Callable[[Config], Awaitable[Proxy]], llama_url: str) -> str:
    return (await make_proxy(single_upstream_config(llama_url))).url


_body = functools.partial(request_body, model="tiny", max_tokens=MAX_TOKENS)


async def _post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: Headers = None
) -> tuple[int, dict[str, Any]]:
    async with http.post(url, json=body, headers=headers, timeout=TIMEOUT) as resp:
        return resp.status, await resp.json()


async def _direct(
    http: aiohttp.ClientSession, llama_url: str, path: str, seeds: range, **fields: Any
) -> list[dict[str, Any]]:
    """The server's own n=1 answers, one request per seed: the reference for every choice."""
    answers = []
    for seed in seeds:
        status, answer = await _post(http, llama_url + path, _body(path, seed=seed, **fields))
        assert status == 200
        answers.append(answer)
    return answers


async def _direct_per_prompt(
    http: aiohttp.ClientSession, llama_url: str, prompts: list[str], *, n: int
) -> list[dict[str, Any]]:
    """References for a prompt list in choice order: prompt p with seed + i sits at p * n + i."""
    answers = []
    for prompt in prompts:
        answers += await _direct(http, llama_url, COMPLETIONS, range(SEED, SEED + n), prompt=prompt)
    return answers


def _text(path: str, answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if path == CHAT else choice["text"])


def _finish(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["finish_reason"])


def _merged_usage(answers: list[dict[str, Any]], prompt_heads: list[int]) -> tuple[int, int, int]:
    """(prompt, completion, total) as docs/behaviour.md#usage merges them: each prompt once, every
    completion."""
    prompt = sum(answers[h]["usage"]["prompt_tokens"] for h in prompt_heads)
    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    return prompt, completion, prompt + completion


def _counts(usage: Any) -> tuple[int, int, int]:
    """The token counts of a usage dict or of the openai client's usage object."""
    if isinstance(usage, dict):
        return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def _mean_logprob(answer: dict[str, Any]) -> float:
    values = [entry["logprob"] for entry in answer["choices"][0]["logprobs"]["content"]]
    return math.fsum(values) / len(values)


async def _raw_stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: Headers = None
) -> tuple[aiohttp.ClientResponse, list[dict[str, Any]]]:
    """Checks the SSE framing byte by byte; returns the response and its JSON payloads."""
    async with http.post(url, json={**body, "stream": True}, headers=headers, timeout=TIMEOUT) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream"
        raw = (await r.read()).decode()
    assert raw.endswith(DONE)
    assert raw.count("[DONE]") == 1
    events = raw.removesuffix(DONE).split("\n\n")
    assert events[-1] == ""
    assert all(event.startswith("data: {") for event in events[:-1])
    return r, [json.loads(event.removeprefix("data: ")) for event in events[:-1]]


def _streamed_texts(path: str, chunks: list[dict[str, Any]]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            piece = choice["delta"].get("content") if path == CHAT else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return texts


def _streamed_finishes(chunks: list[dict[str, Any]]) -> dict[int, str]:
    return {
        choice["index"]: choice["finish_reason"]
        for chunk in chunks
        for choice in chunk["choices"]
        if choice["finish_reason"] is not None
    }


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_server_alone_rejects_n3_and_through_the_proxy_answers_three_choices(
    http: aiohttp.ClientSession, llama_url: str, proxy_url: str, path: str
) -> None:
    status, alone = await _post(http, llama_url + path, _body(path, n=N, seed=SEED))
    assert (status, alone["error"]["type"]) == (400, INVALID)
    assert alone["error"]["message"] == N3_REJECTED

    status, proxied = await _post(http, proxy_url + path, _body(path, n=N, seed=SEED))
    assert status == 200
    assert [c["index"] for c in proxied["choices"]] == [0, 1, 2]


async def test_chat_n3_choices_are_the_servers_answers_for_seed_plus_i(
    openai_client: AsyncOpenAI, http: aiohttp.ClientSession, llama_url: str, llama_model: Path
) -> None:
    direct = await _direct(http, llama_url, CHAT, range(SEED, SEED + N))
    resp = await openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=N, seed=SEED, max_tokens=MAX_TOKENS
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.message.content for c in resp.choices] == [_text(CHAT, a) for a in direct]
    assert [c.finish_reason for c in resp.choices] == [_finish(a) for a in direct]
    assert {c.message.role for c in resp.choices} == {"assistant"}
    assert (resp.object, resp.model) == ("chat.completion", str(llama_model))
    assert resp.id.startswith("chatcmpl-")
    assert _counts(resp.usage) == _merged_usage(direct, [0])


async def test_completions_n3_choices_are_the_servers_answers_for_seed_plus_i(
    openai_client: AsyncOpenAI, http: aiohttp.ClientSession, llama_url: str, llama_model: Path
) -> None:
    direct = await _direct(http, llama_url, COMPLETIONS, range(SEED, SEED + N))
    # This seed gives both endings, so the merged usage counts an EOS token as well.
    assert [_finish(a) for a in direct] == ["length", "stop", "length"]
    resp = await openai_client.completions.create(
        model="tiny", prompt=PROMPT, n=N, seed=SEED, max_tokens=MAX_TOKENS
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [_text(COMPLETIONS, a) for a in direct]
    assert [c.finish_reason for c in resp.choices] == ["length", "stop", "length"]
    assert [c.logprobs for c in resp.choices] == [None, None, None]
    assert (resp.object, resp.model) == ("text_completion", str(llama_model))
    assert _counts(resp.usage) == _merged_usage(direct, [0])


@pytest.mark.parametrize("include_usage", [None, False, True])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_openai_client_streams_n3_with_one_id_and_usage_only_when_asked(
    openai_client: AsyncOpenAI,
    http: aiohttp.ClientSession,
    llama_url: str,
    path: str,
    include_usage: bool | None,
) -> None:
    direct = await _direct(http, llama_url, path, range(SEED, SEED + N))
    options: ChatCompletionStreamOptionsParam | Omit = (
        omit if include_usage is None else {"include_usage": include_usage}
    )
    if path == CHAT:
        chat_stream = await openai_client.chat.completions.create(
            model="tiny", messages=MESSAGES, n=N, seed=SEED, max_tokens=MAX_TOKENS,
            stream=True, stream_options=options,
        )  # fmt: skip
        chunks = [chunk.model_dump() async for chunk in chat_stream]
    else:
        text_stream = await openai_client.completions.create(
            model="tiny", prompt=PROMPT, n=N, seed=SEED, max_tokens=MAX_TOKENS,
            stream=True, stream_options=options,
        )  # fmt: skip
        chunks = [chunk.model_dump() async for chunk in text_stream]

    assert len({c["id"] for c in chunks}) == 1
    assert _streamed_texts(path, chunks) == {i: _text(path, a) for i, a in enumerate(direct)}
    assert _streamed_finishes(chunks) == {i: _finish(a) for i, a in enumerate(direct)}
    with_usage = [c for c in chunks if c["usage"] is not None]
    if include_usage:
        assert with_usage == [chunks[-1]]
        assert chunks[-1]["choices"] == []
        assert _counts(chunks[-1]["usage"]) == _merged_usage(direct, [0])
    else:
        assert with_usage == []


@pytest.mark.parametrize("include_usage", [None, False, True])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_raw_n3_stream_has_one_done_and_no_per_choice_usage_posing_as_total(
    http: aiohttp.ClientSession,
    llama_url: str,
    proxy_url: str,
    llama_model: Path,
    path: str,
    include_usage: bool | None,
) -> None:
    direct = await _direct(http, llama_url, path, range(SEED, SEED + N))
    body = _body(path, n=N, seed=SEED)
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    resp, chunks = await _raw_stream(http, proxy_url + path, body, {"X-Request-Id": "e2e-1"})

    # llama.cpp does not echo request ids, so the parent id is only in the header.
    assert resp.headers["X-Request-Id"] == "e2e-1"
    choice_chunks = [c for c in chunks if c["choices"]]
    usage_chunks = [c for c in chunks if not c["choices"]]
    assert {len(c["choices"]) for c in choice_chunks} == {1}
    assert all(c.get("usage") is None for c in choice_chunks)
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    assert chunks[0]["model"] == str(llama_model)
    assert _streamed_texts(path, chunks) == {i: _text(path, a) for i, a in enumerate(direct)}
    assert _streamed_finishes(chunks) == {i: _finish(a) for i, a in enumerate(direct)}
    if include_usage:
        assert usage_chunks == [chunks[-1]]
        assert _counts(chunks[-1]["usage"]) == _merged_usage(direct, [0])
    else:
        assert usage_chunks == []


async def test_best_of_returns_the_n_highest_mean_logprob_answers_without_logprobs(
    openai_client: AsyncOpenAI, http: aiohttp.ClientSession, llama_url: str
) -> None:
    direct = await _direct(http, llama_url, COMPLETIONS, range(SEED, SEED + 4), logprobs=1)
    ranked = sorted(range(4), key=lambda i: -_mean_logprob(direct[i]))
    # The winners are not simply the first two seeds, so the ranking is really exercised.
    assert ranked[:2] == [3, 0]

    resp = await openai_client.completions.create(
        model="tiny", prompt=PROMPT, n=2, best_of=4, seed=SEED, max_tokens=MAX_TOKENS
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [_text(COMPLETIONS, direct[i]) for i in ranked[:2]]
    assert [c.finish_reason for c in resp.choices] == [_finish(direct[i]) for i in ranked[:2]]
    assert [c.logprobs for c in resp.choices] == [None, None]
    assert _counts(resp.usage) == _merged_usage(direct, [0])


async def test_best_of_keeps_the_winners_logprobs_when_the_client_asked(
    http: aiohttp.ClientSession, llama_url: str, proxy_url: str
) -> None:
    direct = await _direct(http, llama_url, COMPLETIONS, range(SEED, SEED + 4), logprobs=1)
    winners = [direct[i] for i in sorted(range(4), key=lambda i: -_mean_logprob(direct[i]))[:2]]

    body = _body(COMPLETIONS, n=2, best_of=4, seed=SEED, logprobs=1)
    status, resp = await _post(http, proxy_url + COMPLETIONS, body)
    assert status == 200
    assert [c["index"] for c in resp["choices"]] == [0, 1]
    for choice, winner in zip(resp["choices"], winners, strict=True):
        expected = winner["choices"][0]["logprobs"]["content"]
        got = choice["logprobs"]["content"]
        assert [e["token"] for e in got] == [e["token"] for e in expected]
        assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in expected])
        assert {len(e["top_logprobs"]) for e in got} == {1}
    assert resp["usage"]["completion_tokens"] == _merged_usage(direct, [0])[1]


@pytest.mark.parametrize(
    "fields",
    [{"n": 2, "best_of": 4, "stream": True}, {"n": 3, "best_of": 2}],
    ids=["with-stream", "below-n"],
)
async def test_best_of_with_stream_or_below_n_is_rejected_by_the_proxy(
    http: aiohttp.ClientSession, proxy_url: str, fields: dict[str, Any]
) -> None:
    status, resp = await _post(http, proxy_url + COMPLETIONS, _body(COMPLETIONS, **fields))
    assert status == 400
    error = resp["error"]
    assert (error["type"], error["param"], error["code"]) == (INVALID, "best_of", None)
    assert "best_of" in error["message"]


async def test_prompt_list_with_n2_gives_choice_p_times_n_plus_i(
    openai_client: AsyncOpenAI, http: aiohttp.ClientSession, llama_url: str
) -> None:
    direct = await _direct_per_prompt(http, llama_url, [PROMPT, OTHER_PROMPT], n=2)
    resp = await openai_client.completions.create(
        model="tiny", prompt=[PROMPT, OTHER_PROMPT], n=2, seed=SEED, max_tokens=MAX_TOKENS
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [_text(COMPLETIONS, a) for a in direct]
    assert [c.finish_reason for c in resp.choices] == [_finish(a) for a in direct]
    assert _counts(resp.usage) == _merged_usage(direct, [0, 2])


async def test_prompt_list_with_n2_streams_every_choice_and_one_merged_usage(
    http: aiohttp.ClientSession, llama_url: str, proxy_url: str
) -> None:
    direct = await _direct_per_prompt(http, llama_url, [PROMPT, OTHER_PROMPT], n=2)
    body = _body(
        COMPLETIONS, prompt=[PROMPT, OTHER_PROMPT], n=2, seed=SEED,
        stream_options={"include_usage": True},
    )  # fmt: skip
    _, chunks = await _raw_stream(http, proxy_url + COMPLETIONS, body)
    assert _streamed_texts(COMPLETIONS, chunks) == {
        i: _text(COMPLETIONS, a) for i, a in enumerate(direct)
    }
    assert [c for c in chunks if c.get("usage") is not None] == [chunks[-1]]
    assert _counts(chunks[-1]["usage"]) == _merged_usage(direct, [0, 2])


# --- streams that start at the first child (docs/behaviour.md#stream-start) ------------------

RUNS = 20


@pytest.fixture(params=[1, 4], ids=["np1", "np4"])
async def slots_proxy_url(
    request: pytest.FixtureRequest, make_proxy: Callable[[Config], Awaitable[Proxy]]
) -> tuple[int, str, str]:
    """n-proxy in front of llama-server with one slot, or with four."""
    fixture = "llama_url" if request.param == 1 else "llama_url_np4"
    llama = str(request.getfixturevalue(fixture))
    return request.param, llama, (await make_proxy(single_upstream_config(llama))).url


def _final(get: Callable[[], Any]) -> Any:
    """The helper's accumulated completion; it refuses "length" ends but still carries them."""
    try:
        return get()
    except LengthFinishReasonError as exc:
        return exc.completion


async def test_openai_stream_helper_20_of_20_runs_sync_and_async(
    http: aiohttp.ClientSession, slots_proxy_url: tuple[int, str, str]
) -> None:
    np, llama, proxy_url = slots_proxy_url
    direct = [_text(CHAT, a) for a in await _direct(http, llama, CHAT, range(SEED, SEED + N))]
    fields: dict[str, Any] = {
        "model": "tiny", "messages": MESSAGES, "n": N, "seed": SEED, "max_tokens": MAX_TOKENS,
    }  # fmt: skip

    async def run_async(client: AsyncOpenAI) -> Any:
        async with client.chat.completions.stream(**fields) as stream:
            async for _ in stream:
                pass
            try:
                return await stream.get_final_completion()
            except LengthFinishReasonError as exc:
                return exc.completion

    def run_sync() -> list[Any]:
        with OpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0) as client:
            finals = []
            for _ in range(RUNS):
                with client.chat.completions.stream(**fields) as stream:
                    for _ in stream:
                        pass
                    finals.append(_final(stream.get_final_completion))
            return finals

    async with AsyncOpenAI(base_url=proxy_url + "/v1", api_key="x", max_retries=0) as client:
        finals = [await run_async(client) for _ in range(RUNS)]
    finals += await asyncio.to_thread(run_sync)
    for final in finals:
        assert [c.index for c in final.choices] == [0, 1, 2]
        assert {c.message.role for c in final.choices} == {"assistant"}
        assert all(c.finish_reason in ("stop", "length") for c in final.choices)
        if np == 1:  # one slot decodes one child at a time: the same as asking directly
            assert [c.message.content for c in final.choices] == direct


async def test_one_slot_n3_stream_opens_at_once_and_relays_each_child_as_the_slot_runs_it(
    http: aiohttp.ClientSession, llama_url: str, proxy_url: str
) -> None:
    """With one slot the children run one after another: the stream opens with every choice and
    then carries each child's chunks, in its own order and whole, the first child's before the last
    child's. Neighbours may overlap by a chunk or two: llama-server writes each stream from its own
    thread, so the one that just finished can be written after the next one's first token. The
    first and the last are a whole child's run apart. How early the first chunk comes is a timing:
    ``python -m bench llamacpp``."""
    fields = {"max_tokens": 24, "ignore_eos": True}
    direct = [
        _text(CHAT, a)
        for a in await _direct(http, llama_url, CHAT, range(SEED, SEED + N), **fields)
    ]
    _, chunks = await _raw_stream(http, proxy_url + CHAT, _body(CHAT, n=N, seed=SEED, **fields))
    opening = [c["choices"][0] for c in chunks[:N]]
    assert [(c["index"], c["delta"]) for c in opening] == [
        (i, {"role": "assistant", "content": ""}) for i in range(N)
    ]
    places: dict[int, list[int]] = {}  # each choice's chunks, by their place in the stream
    ends: dict[int, list[int]] = {}  # the places of its chunks that carry a finish_reason
    for place, chunk in enumerate(chunks[N:]):
        (choice,) = chunk["choices"]
        places.setdefault(choice["index"], []).append(place)
        if choice["finish_reason"]:
            ends.setdefault(choice["index"], []).append(place)
    assert _streamed_texts(CHAT, chunks) == dict(enumerate(direct))
    assert ends == {i: [places[i][-1]] for i in range(N)}  # each finishes once, with its last chunk
    first, *_, last = sorted(places, key=lambda i: places[i][0])
    assert places[first][-1] < places[last][0]
