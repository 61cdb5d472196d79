"""Pins down how llama.cpp's own server behaves, talked to directly, in the ways n-proxy relies on.

If a new llama.cpp build changes one of these, the proxy's assumptions about it need a look.
"""

import asyncio
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.backends.llamacpp import LlamaServer, llama_server
from bench.backends.tinymodel import build_tiny_gguf
from tests.support.llamacpp import CHAT, COMPLETIONS, request_body

pytestmark = pytest.mark.http_timeout(10)
N_REJECTED = {
    "error": {
        "code": 400,
        "message": "Field 'n': Value must be between 1 <= value <= 1, but got 2",
        "type": "invalid_request_error",
    }
}


@pytest.fixture(scope="module")
def eos_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    model = build_tiny_gguf(tmp_path_factory.mktemp("eos") / "tiny.gguf", eos_reachable=True)
    with llama_server(model) as server:
        yield server


@pytest.fixture(scope="module")
def no_eos_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    model = build_tiny_gguf(tmp_path_factory.mktemp("no_eos") / "tiny.gguf", eos_reachable=False)
    with llama_server(model) as server:
        yield server


_body = functools.partial(request_body, max_tokens=16)


async def _post(
    http: aiohttp.ClientSession, server: LlamaServer, path: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    async with http.post(server.base_url + path, json=body) as resp:
        return resp.status, await resp.json()


async def _stream(
    http: aiohttp.ClientSession, server: LlamaServer, path: str, body: dict[str, Any]
) -> list[dict[str, Any]]:
    """Returns the decoded `data:` events; asserts the stream ends with exactly one [DONE]."""
    async with http.post(server.base_url + path, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        raw = await resp.text()
    events = [block for block in raw.split("\n\n") if block.strip()]
    assert all(event.startswith("data: ") for event in events)
    payloads = [event.removeprefix("data: ") for event in events]
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    return [json.loads(p) for p in payloads[:-1]]


def _text(path: str, response: dict[str, Any]) -> str:
    choice = response["choices"][0]
    return str(choice["message"]["content"] if path == CHAT else choice["text"])


def _streamed_text(path: str, chunks: list[dict[str, Any]]) -> str:
    parts: list[str] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            piece = choice["delta"].get("content") if path == CHAT else choice["text"]
            parts.append(piece or "")
    return "".join(parts)


async def test_chat_completion_returns_one_assistant_choice_of_vocabulary_words(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer
) -> None:
    status, resp = await _post(http, no_eos_server, CHAT, _body(CHAT, seed=1))
    assert status == 200
    assert resp["object"] == "chat.completion"
    assert resp["id"].startswith("chatcmpl-")
    assert len(resp["choices"]) == 1
    choice = resp["choices"][0]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    words = choice["message"]["content"].split()
    assert len(words) == 16
    assert all(word.isalpha() and word.islower() for word in words)
    assert resp["usage"]["completion_tokens"] == 16
    assert resp["usage"]["total_tokens"] == resp["usage"]["prompt_tokens"] + 16
    assert set(resp["usage"]["prompt_tokens_details"]) == {"cached_tokens"}


async def test_completion_returns_text_completion_with_chatcmpl_id(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer
) -> None:
    status, resp = await _post(http, no_eos_server, COMPLETIONS, _body(COMPLETIONS, seed=1))
    assert status == 200
    assert resp["object"] == "text_completion"
    # llama.cpp uses the chat prefix for text completions too.
    assert resp["id"].startswith("chatcmpl-")
    choice = resp["choices"][0]
    assert (choice["index"], choice["logprobs"], choice["finish_reason"]) == (0, None, "length")
    assert len(choice["text"].split()) == 16
    assert resp["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_model_field_is_the_model_path_whatever_the_request_names(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer, path: str
) -> None:
    status, resp = await _post(http, no_eos_server, path, _body(path, model="gpt-4o", seed=1))
    assert status == 200
    assert resp["model"] == str(no_eos_server.model_path)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_n_of_two_is_rejected_with_400_before_streaming(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer, path: str, stream: bool
) -> None:
    status, resp = await _post(http, no_eos_server, path, _body(path, n=2, stream=stream))
    assert status == 400
    assert resp == N_REJECTED


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_same_seed_gives_same_text_streamed_or_not(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer, path: str
) -> None:
    body = _body(path, seed=7)
    _, first = await _post(http, no_eos_server, path, body)
    _, second = await _post(http, no_eos_server, path, body)
    streamed = _streamed_text(path, await _stream(http, no_eos_server, path, body))
    assert _text(path, first) == _text(path, second) == streamed


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_different_seeds_give_different_text(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer, path: str
) -> None:
    texts = {
        _text(path, (await _post(http, no_eos_server, path, _body(path, seed=s)))[1])
        for s in (1, 2, 3)
    }
    assert len(texts) == 3


async def test_completion_logprobs_come_in_chat_style_content_list(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer
) -> None:
    body = _body(COMPLETIONS, seed=3, max_tokens=4, logprobs=2)
    _, resp = await _post(http, no_eos_server, COMPLETIONS, body)
    logprobs = resp["choices"][0]["logprobs"]
    # Not the legacy OpenAI completions shape (tokens / token_logprobs / top_logprobs dicts).
    assert list(logprobs) == ["content"]
    assert len(logprobs["content"]) == 4
    for entry in logprobs["content"]:
        assert list(entry) == ["id", "token", "bytes", "logprob", "top_logprobs"]
        assert entry["logprob"] < 0
        assert list(entry["bytes"]) == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert list(entry["top_logprobs"][0]) == ["id", "token", "bytes", "logprob"]
    assert "".join(e["token"] for e in logprobs["content"]) == resp["choices"][0]["text"]


@pytest.mark.parametrize("include_usage", [None, True, False])
async def test_completion_stream_carries_usage_on_the_finish_chunk_always(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer, include_usage: bool | None
) -> None:
    body = _body(COMPLETIONS, seed=5, max_tokens=3)
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    chunks = await _stream(http, no_eos_server, COMPLETIONS, body)
    assert len(chunks) == 4
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert chunks[-1]["choices"][0]["text"] == ""
    assert [("usage" in c) for c in chunks] == [False, False, False, True]
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1
    assert chunks[0]["object"] == "text_completion"


async def test_chat_stream_without_include_usage_has_no_usage(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer
) -> None:
    chunks = await _stream(http, no_eos_server, CHAT, _body(CHAT, seed=5, max_tokens=3))
    assert len(chunks) == 5
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert not any("usage" in c for c in chunks)
    assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1
    assert chunks[0]["object"] == "chat.completion.chunk"


async def test_chat_stream_with_include_usage_ends_with_separate_empty_choices_chunk(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer
) -> None:
    body = _body(CHAT, seed=5, max_tokens=3, stream_options={"include_usage": True})
    chunks = await _stream(http, no_eos_server, CHAT, body)
    assert len(chunks) == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-2]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert not any("usage" in c for c in chunks[:-1])
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1


async def test_eos_unreachable_model_always_finishes_with_length(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer
) -> None:
    results = [
        (await _post(http, no_eos_server, COMPLETIONS, _body(COMPLETIONS, seed=s)))[1]
        for s in range(6)
    ]
    assert {r["choices"][0]["finish_reason"] for r in results} == {"length"}
    assert {r["usage"]["completion_tokens"] for r in results} == {16}


async def test_eos_reachable_model_finishes_with_stop_or_length_and_counts_eos(
    http: aiohttp.ClientSession, eos_server: LlamaServer
) -> None:
    results = [
        (await _post(http, eos_server, COMPLETIONS, _body(COMPLETIONS, seed=s)))[1]
        for s in range(10)
    ]
    assert {r["choices"][0]["finish_reason"] for r in results} == {"stop", "length"}
    for r in results:
        if r["choices"][0]["finish_reason"] == "stop":
            # The EOS token is billed as a completion token although it adds no text.
            assert len(r["choices"][0]["text"].split()) == r["usage"]["completion_tokens"] - 1


async def test_request_id_header_is_not_echoed(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer
) -> None:
    url = no_eos_server.base_url + CHAT
    headers = {"X-Request-Id": "req-42"}
    async with http.post(url, json=_body(CHAT, seed=1), headers=headers) as resp:
        assert resp.status == 200
        assert "X-Request-Id" not in resp.headers
        assert "req-42" not in (await resp.json())["id"]


async def test_concurrent_requests_queue_on_one_slot_and_match_sequential_results(
    http: aiohttp.ClientSession, no_eos_server: LlamaServer
) -> None:
    seeds = (11, 12, 13, 14)
    sequential = [
        _text(CHAT, (await _post(http, no_eos_server, CHAT, _body(CHAT, seed=s)))[1]) for s in seeds
    ]
    concurrent = await asyncio.gather(
        *(_post(http, no_eos_server, CHAT, _body(CHAT, seed=s)) for s in seeds)
    )
    assert [status for status, _ in concurrent] == [200] * len(seeds)
    assert [_text(CHAT, resp) for _, resp in concurrent] == sequential


def test_tiny_model_build_is_byte_identical_and_small(tmp_path: Path) -> None:
    first = build_tiny_gguf(tmp_path / "a.gguf", eos_reachable=True).read_bytes()
    second = build_tiny_gguf(tmp_path / "b.gguf", eos_reachable=True).read_bytes()
    other = build_tiny_gguf(tmp_path / "c.gguf", eos_reachable=False).read_bytes()
    assert first == second
    assert first != other
    assert len(first) < 512 * 1024
