"""Tests of the demo backend over HTTP: determinism, vLLM-shaped bodies and streams, abort
tracking, side routes and the command line.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.devserver import DevConfig, DevState, main, start_devserver

Server = tuple[str, DevState]
StartServer = Callable[[DevConfig], Awaitable[Server]]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
async def start() -> AsyncIterator[StartServer]:
    runners = []

    async def start_one(config: DevConfig) -> Server:
        runner, port, state = await start_devserver(config)
        runners.append(runner)
        return f"http://127.0.0.1:{port}", state

    yield start_one
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def devserver(start: StartServer) -> Server:
    return await start(DevConfig())


def chat_body(seed: object = 1, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "one two three"}], "seed": seed, **extra}


async def post_json(
    session: aiohttp.ClientSession, url: str, body: object, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with session.post(url, data=orjson.dumps(body), headers=headers) as response:
        return response.status, orjson.loads(await response.read())


async def post_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[list[Any], bytes]:
    """The decoded `data:` payloads of a stream (the text `[DONE]` kept as is) and its raw bytes."""
    async with session.post(url, json={**body, "stream": True}) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        raw = await response.read()
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    return [e.decode() if e == b"[DONE]" else orjson.loads(e) for e in events], raw


async def chat_text(session: aiohttp.ClientSession, base: str, seed: object) -> str:
    status, body = await post_json(session, base + CHAT, chat_body(seed))
    assert status == 200
    return str(body["choices"][0]["message"]["content"])


async def test_same_seed_gives_same_text_and_different_seeds_differ(
    session: aiohttp.ClientSession, devserver: Server
) -> None:
    base, _ = devserver
    first = await chat_text(session, base, 7)
    assert first == await chat_text(session, base, 7)
    assert first != await chat_text(session, base, 8)
    assert len(first.split()) == 16
    assert await chat_text(session, base, None) != await chat_text(session, base, None)


async def test_chat_response_shape_and_usage_numbers(
    session: aiohttp.ClientSession, devserver: Server
) -> None:
    base, state = devserver
    status, body = await post_json(
        session, base + CHAT, chat_body(max_tokens=9, model="m1"), {"X-Request-Id": "abc"}
    )
    assert status == 200
    assert body["id"] == "chatcmpl-abc"
    assert (body["object"], body["model"], body["system_fingerprint"]) == (
        "chat.completion",
        "m1",
        "fp_devserver",
    )
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert (choice["index"], choice["finish_reason"], choice["logprobs"]) == (0, "length", None)
    assert choice["message"]["role"] == "assistant"
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 9,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    assert state.finished == ["abc"]
    assert state.seen[0][0] == "abc"
    assert state.seen[0][2]["x-request-id"] == "abc"


async def test_completions_accept_one_prompt_in_several_spellings(
    session: aiohttp.ClientSession, devserver: Server
) -> None:
    base, _ = devserver
    texts = []
    for prompt in ("7 8 9", ["7 8 9"], [7, 8, 9], [[7, 8, 9]]):
        status, body = await post_json(
            session, base + COMPLETIONS, {"prompt": prompt, "seed": 3, "request_id": "r1"}
        )
        assert status == 200
        assert (body["id"], body["object"]) == ("cmpl-r1", "text_completion")
        assert body["usage"]["prompt_tokens"] == 4
        assert "completion_tokens_details" not in body["usage"]
        texts.append(body["choices"][0]["text"])
    assert len(set(texts)) == 1


@pytest.mark.parametrize(
    ("path", "body", "message", "param"),
    [
        (CHAT, chat_body(n=2), "Only n=1 is supported", "n"),
        (COMPLETIONS, {"prompt": "x", "n": 5}, "Only n=1 is supported", "n"),
        (CHAT, chat_body(n="3"), "n must be a positive integer", "n"),
        (CHAT, chat_body(n=True), "n must be a positive integer", "n"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "only one prompt per request", "prompt"),
        (CHAT, [1, 2], "The request body must be a valid JSON object", None),
        (CHAT, chat_body(seed=1.5), "seed must be an integer", "seed"),
    ],
)
async def test_invalid_requests_get_an_openai_error_body(
    session: aiohttp.ClientSession,
    devserver: Server,
    path: str,
    body: object,
    message: str,
    param: str | None,
) -> None:
    base, state = devserver
    status, error = await post_json(session, base + path, body)
    assert status == 400
    assert error == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }
    assert (state.active, state.finished, len(state.seen)) == ({}, [], 1)


async def test_invalid_json_is_rejected(session: aiohttp.ClientSession, devserver: Server) -> None:
    base, _ = devserver
    async with session.post(base + CHAT, data=b"{nope") as response:
        assert response.status == 400
        body = orjson.loads(await response.read())
    assert body["error"]["type"] == "invalid_request_error"


async def test_chat_stream_has_role_token_finish_usage_and_done_chunks(
    session: aiohttp.ClientSession, devserver: Server
) -> None:
    base, _ = devserver
    options = {"include_usage": True}
    events, _ = await post_stream(
        session, base + CHAT, chat_body(max_tokens=3, stream_options=options)
    )
    assert len(events) == 1 + 3 + 1 + 1 + 1
    role, *tokens, finish, usage, done = events
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None, None, None]
    streamed = "".join(t["choices"][0]["delta"]["content"] for t in tokens)
    _, whole = await post_json(session, base + CHAT, chat_body(max_tokens=3))
    assert streamed == whole["choices"][0]["message"]["content"]
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 3
    assert done == "[DONE]"
    assert len({e["id"] for e in events[:-1]}) == 1
    assert all("usage" not in e for e in events[:-2])


async def test_stream_without_include_usage_has_no_usage_chunk(
    session: aiohttp.ClientSession, devserver: Server
) -> None:
    base, _ = devserver
    events, _ = await post_stream(session, base + COMPLETIONS, {"prompt": "x", "max_tokens": 2})
    assert [e["choices"][0]["text"] != "" for e in events[:-1]] == [True, True, False]
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events[:-1])
    assert events[-1] == "[DONE]"


async def test_continuous_usage_stats_put_cumulative_usage_on_every_chunk(
    session: aiohttp.ClientSession, devserver: Server
) -> None:
    base, _ = devserver
    options = {"include_usage": True, "continuous_usage_stats": True}
    events, _ = await post_stream(
        session, base + CHAT, chat_body(max_tokens=2, stream_options=options)
    )
    completed = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert completed == [0, 1, 2, 2, 2]
    assert [e["usage"]["total_tokens"] for e in events[:-1]] == [4, 5, 6, 6, 6]


async def test_logprobs_are_vllm_shaped_and_deterministic(
    session: aiohttp.ClientSession, devserver: Server
) -> None:
    base, _ = devserver
    _, chat = await post_json(
        session, base + CHAT, chat_body(max_tokens=2, logprobs=True, top_logprobs=3)
    )
    entries = chat["choices"][0]["logprobs"]["content"]
    assert len(entries) == 2
    assert [len(e["top_logprobs"]) for e in entries] == [3, 3]
    assert entries[0]["top_logprobs"][0]["token"] == entries[0]["token"]
    assert entries[0]["bytes"] == list(entries[0]["token"].encode())
    body = {"prompt": "x", "seed": 2, "max_tokens": 3, "logprobs": 2}
    _, first = await post_json(session, base + COMPLETIONS, body)
    _, again = await post_json(session, base + COMPLETIONS, body)
    logprobs = first["choices"][0]["logprobs"]
    assert logprobs == again["choices"][0]["logprobs"]
    assert [len(top) for top in logprobs["top_logprobs"]] == [2, 2, 2]
    assert all(lp < 0 for lp in logprobs["token_logprobs"])
    tokens = logprobs["tokens"]
    assert logprobs["text_offset"] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]


async def test_client_going_away_mid_stream_is_tracked_as_aborted(
    session: aiohttp.ClientSession, start: StartServer
) -> None:
    base, state = await start(DevConfig(token_delay=0.05))
    body = chat_body(stream=True, max_tokens=1000)
    response = await session.post(base + CHAT, json=body, headers={"X-Request-Id": "gone"})
    await response.content.readline()
    assert "gone" in state.active
    response.close()
    await state.wait_for(lambda s: "gone" in s.aborted)
    assert (state.active, state.finished) == ({}, [])


async def test_long_answers_stop_early_unless_ignore_eos(
    session: aiohttp.ClientSession, devserver: Server
) -> None:
    base, _ = devserver
    _, stopped = await post_json(session, base + CHAT, chat_body(max_tokens=64))
    _, forced = await post_json(session, base + CHAT, chat_body(max_tokens=64, ignore_eos=True))
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < 64
    assert forced["choices"][0]["finish_reason"] == "length"
    assert forced["usage"]["completion_tokens"] == 64
    stopped_text = stopped["choices"][0]["message"]["content"]
    assert forced["choices"][0]["message"]["content"].startswith(stopped_text)


async def test_native_n_equals_the_n1_answers_with_seed_plus_i(
    session: aiohttp.ClientSession, start: StartServer
) -> None:
    base, _ = await start(DevConfig(native_n=True))
    _, native = await post_json(session, base + CHAT, chat_body(10, n=3))
    singles = [await chat_text(session, base, seed) for seed in (10, 11, 12)]
    assert [c["message"]["content"] for c in native["choices"]] == singles
    assert [c["index"] for c in native["choices"]] == [0, 1, 2]
    assert native["usage"]["prompt_tokens"] == 4
    assert native["usage"]["completion_tokens"] == 48
    assert native["usage"]["completion_tokens_details"] == {"reasoning_tokens": 12}
    events, _ = await post_stream(session, base + CHAT, chat_body(10, n=3))
    streamed = ["", "", ""]
    for event in events[:-1]:
        choice = event["choices"][0]
        streamed[choice["index"]] += choice["delta"].get("content", "")
    assert streamed == singles
    assert [e["choices"][0]["index"] for e in events[3:6]] == [0, 1, 2]


async def test_side_routes_for_pass_through(
    session: aiohttp.ClientSession, devserver: Server
) -> None:
    base, _ = devserver
    async with session.get(base + "/health") as response:
        assert (response.status, await response.text()) == (200, "ok")
    async with session.get(base + "/v1/models") as response:
        assert (await response.json())["data"][0]["id"] == "demo-model"
    async with session.get(base + "/metrics") as response:
        assert "devserver_requests_total 0" in await response.text()
    status, embedded = await post_json(session, base + "/v1/embeddings", {"input": ["a", "b"]})
    assert status == 200
    assert [len(d["embedding"]) for d in embedded["data"]] == [8, 8]
    async with session.put(
        base + "/echo/some/path?status=201&x=1", data=b"payload", headers={"X-Custom": "v"}
    ) as response:
        assert response.status == 201
        echo = await response.json()
    assert (echo["method"], echo["path"], echo["query_string"], echo["body"]) == (
        "PUT",
        "/echo/some/path",
        "status=201&x=1",
        "payload",
    )
    assert echo["headers"]["x-custom"] == "v"
    async with session.get(base + "/debug/state") as response:
        assert await response.json() == {"active": [], "finished": [], "aborted": [], "faulted": []}


def test_main_rejects_unknown_arguments() -> None:
    with pytest.raises(SystemExit):
        main(["--bogus"])


def test_python_dash_m_runs_the_devserver_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "proxy.devserver", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.stdout.startswith("usage: n-proxy-devserver")


# --- vLLM's token-in/token-out generate route


GENERATE = "/inference/v1/generate"


def generate_body(seed: object, **params: Any) -> dict[str, Any]:
    return {"model": "m", "token_ids": [3, 1, 4], "sampling_params": {"seed": seed, **params}}


async def test_generate_is_deterministic_per_seed_and_streams_what_it_answers_whole(
    session: aiohttp.ClientSession, devserver: Server
) -> None:
    base, _ = devserver
    url = base + GENERATE
    answers = [
        (await post_json(session, url, generate_body(s, max_tokens=5)))[1] for s in (1, 1, 2)
    ]
    assert answers[0]["choices"] == answers[1]["choices"]
    assert answers[0]["choices"] != answers[2]["choices"]
    whole = answers[0]
    assert whole["output_mode"] == "tokens"
    assert whole["usage"]["prompt_tokens"] == 3
    assert whole["usage"]["completion_tokens"] == 5
    body = {**generate_body(1, max_tokens=5), "stream_options": {"include_usage": True}}
    events, _ = await post_stream(session, url, body)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == (
        whole["choices"][0]["token_ids"]
    )
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert (usage["choices"], usage["usage"]) == ([], whole["usage"])


async def test_generate_names_its_answer_after_the_request_id(
    session: aiohttp.ClientSession, devserver: Server
) -> None:
    base, _ = devserver
    url = base + GENERATE
    _, by_header = await post_json(session, url, generate_body(1), {"X-Request-Id": "h"})
    _, by_body = await post_json(session, url, {**generate_body(1), "request_id": "b"})
    assert (by_header["request_id"], by_body["request_id"]) == (
        "generate-tokens-h",
        "generate-tokens-b",
    )


async def test_generate_with_native_n_answers_every_choice_with_seed_plus_i(
    session: aiohttp.ClientSession, start: StartServer
) -> None:
    base, _ = await start(DevConfig(native_n=True))
    url = base + GENERATE
    _, both = await post_json(session, url, generate_body(7, n=2, max_tokens=4))
    for i in range(2):
        _, alone = await post_json(session, url, generate_body(7 + i, max_tokens=4))
        assert both["choices"][i] == {**alone["choices"][0], "index": i}
