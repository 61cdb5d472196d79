"""End to end: n-proxy in front of the real demo backend on loopback, driven by aiohttp."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.config.models import parse_config, single_upstream_config
from proxy.request import fanout
from tests.support.client import WAIT, post, sse_payloads
from tests.support.servers import Backend, Proxy, Servers, proxy_config, with_upstream

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "tell me a story"}]


async def direct_choice(
    http: aiohttp.ClientSession, backend: Backend, path: str, body: dict[str, Any]
) -> Any:
    status, raw, _ = await post(http, backend.url + path, body)
    assert status == 200, raw
    choice = orjson.loads(raw)["choices"][0]
    return choice["message"]["content"] if path == CHAT else choice["text"]


async def test_chat_n3_choices_equal_n1_answers_with_seed_plus_i(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = {"model": "m", "messages": MESSAGES, "n": 3, "seed": 40, "max_tokens": 8}
    status, raw, headers = await post(http, proxy.url + CHAT, body, "abc")
    assert status == 200, raw
    merged = orjson.loads(raw)
    assert merged["id"] == "chatcmpl-abc"
    assert headers["X-Request-Id"] == "abc"
    assert [c["index"] for c in merged["choices"]] == [0, 1, 2]
    for i, choice in enumerate(merged["choices"]):
        expected = await direct_choice(
            http,
            backend,
            CHAT,
            {"model": "m", "messages": MESSAGES, "seed": 40 + i, "max_tokens": 8},
        )
        assert choice["message"]["content"] == expected
    usage = merged["usage"]
    assert usage["completion_tokens"] == 24
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 3 * (8 // 4)
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] // 2
    seen = {rid for rid, _, _ in backend.state.seen}
    assert {"0_abc", "1_abc", "2_abc"} <= seen


async def test_children_carry_seed_request_id_and_no_n(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = {
        "model": "m",
        "messages": MESSAGES,
        "n": 2,
        "seed": 7,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "vendor_x": {"k": 1},
    }
    status, raw, _ = await post(
        http, proxy.url + CHAT, body, "r1", headers={"Authorization": "Bearer secret"}
    )
    assert status == 200, raw
    children = {rid: (b, h) for rid, b, h in backend.state.seen}
    for i in range(2):
        child_body, child_headers = children[f"{i}_r1"]
        assert "n" not in child_body
        assert child_body["seed"] == 7 + i
        assert child_body["tools"] == body["tools"]
        assert child_body["vendor_x"] == {"k": 1}
        assert child_headers["authorization"] == "Bearer secret"


@pytest.mark.parametrize("stream", [False, True])
async def test_body_request_id_names_the_answer_as_native_n_does(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend, stream: bool
) -> None:
    # vLLM names a request by X-Request-Id, else by the body's request_id: chatcmpl-<it>.
    body = {"model": "m", "messages": MESSAGES, "n": 2, "request_id": "mine", "stream": stream}
    status, raw, headers = await post(http, proxy.url + CHAT, body)
    assert status == 200, raw
    ids = {p["id"] for p in sse_payloads(raw)[:-1]} if stream else {orjson.loads(raw)["id"]}
    assert ids == {"chatcmpl-mine"}
    assert headers["X-Request-Id"] == "mine"
    children = {rid: b for rid, b, _ in backend.state.seen}
    assert [children[f"{i}_mine"]["request_id"] for i in range(2)] == ["0_mine", "1_mine"]


async def test_header_request_id_wins_over_the_body_one(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = {"model": "m", "messages": MESSAGES, "n": 2, "request_id": "body"}
    status, raw, _ = await post(http, proxy.url + CHAT, body, "head")
    assert status == 200, raw
    assert orjson.loads(raw)["id"] == "chatcmpl-head"


async def test_request_id_with_inner_spaces_is_kept_as_vllm_echoes_it(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = {"model": "m", "messages": MESSAGES, "n": 2}
    status, raw, headers = await post(http, proxy.url + CHAT, body, "a b")
    assert status == 200, raw
    assert orjson.loads(raw)["id"] == "chatcmpl-a b"
    assert headers["X-Request-Id"] == "a b"
    assert {"0_a b", "1_a b"} <= {rid for rid, _, _ in backend.state.seen}


async def test_completions_list_prompts_index_p_times_n_plus_i(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body: dict[str, Any] = {
        "model": "m",
        "prompt": ["one two", "three four five"],
        "n": 2,
        "seed": 1,
        "max_tokens": 4,
    }
    status, raw, _ = await post(http, proxy.url + COMPLETIONS, body, "lp")
    assert status == 200, raw
    merged = orjson.loads(raw)
    assert [c["index"] for c in merged["choices"]] == [0, 1, 2, 3]
    for p, prompt in enumerate(body["prompt"]):
        for i in range(2):
            expected = await direct_choice(
                http,
                backend,
                COMPLETIONS,
                {"model": "m", "prompt": prompt, "seed": 1 + i, "max_tokens": 4},
            )
            assert merged["choices"][p * 2 + i]["text"] == expected
    seen = {rid for rid, _, _ in backend.state.seen}
    assert {"0_lp-0", "1_lp-0", "0_lp-1", "1_lp-1"} <= seen
    # prompt tokens counted once per prompt: "one two" -> 3, "three four five" -> 4 (words + 1)
    assert merged["usage"]["prompt_tokens"] == 3 + 4
    assert merged["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("include_usage", [True, False])
async def test_stream_n3_interleaves_rewrites_and_ends_with_one_done(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend, include_usage: bool
) -> None:
    body = {
        "model": "m",
        "messages": MESSAGES,
        "n": 3,
        "seed": 5,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": include_usage},
    }
    status, raw, headers = await post(http, proxy.url + CHAT, body, "s1")
    assert status == 200, raw
    assert headers["Content-Type"].startswith("text/event-stream")
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    chunks = payloads[:-1]
    choice_chunks = [c for c in chunks if c["choices"]]
    usage_chunks = [c for c in chunks if not c["choices"]]
    assert {c["id"] for c in chunks} == {"chatcmpl-s1"}
    assert len({c["created"] for c in chunks}) == 1
    assert {c["model"] for c in chunks} == {"m"}
    texts = {0: "", 1: "", 2: ""}
    for chunk in choice_chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
    for i in range(3):
        expected = await direct_choice(
            http,
            backend,
            CHAT,
            {"model": "m", "messages": MESSAGES, "seed": 5 + i, "max_tokens": 6},
        )
        assert texts[i] == expected
    finishes = [
        c["choices"][0]["index"] for c in choice_chunks if c["choices"][0].get("finish_reason")
    ]
    assert sorted(finishes) == [0, 1, 2]
    if include_usage:
        (usage_chunk,) = usage_chunks
        assert usage_chunk is chunks[-1]
        assert usage_chunk["usage"]["completion_tokens"] == 18
        assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 18
    else:
        assert usage_chunks == []


async def test_stream_continuous_usage_keeps_each_childs_own_usage(
    http: aiohttp.ClientSession, proxy: Proxy
) -> None:
    body = {
        "model": "m",
        "prompt": "a b c",
        "n": 2,
        "seed": 3,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    status, raw, _ = await post(http, proxy.url + COMPLETIONS, body)
    assert status == 200
    chunks = [p for p in sse_payloads(raw) if p != "[DONE]"]
    per_choice = [c for c in chunks if c["choices"]]
    assert all(c["usage"]["completion_tokens"] <= 4 for c in per_choice)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 8


async def test_completions_stream_is_exactly_each_childs_chunks_without_an_opening(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    """No empty ``text`` per choice opens a completions stream (neither vLLM frontend sends
    one); with continuous usage every chunk keeps its own prompt's count
    (docs/behaviour.md#opening)."""
    prompts = ["one two", "three four five six"]
    body: dict[str, Any] = {
        "model": "m", "prompt": prompts, "n": 2, "seed": 3, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    status, raw, _ = await post(http, proxy.url + COMPLETIONS, body, "c1")
    assert status == 200, raw
    per_choice: dict[int, list[Any]] = {}
    for chunk in sse_payloads(raw)[:-1]:
        for choice in chunk["choices"]:
            per_choice.setdefault(choice["index"], []).append((choice, chunk["usage"]))
    for p, prompt in enumerate(prompts):
        for i in range(2):
            child = {**body, "prompt": prompt, "seed": 3 + i}
            del child["n"]
            direct_status, direct, _ = await post(http, backend.url + COMPLETIONS, child)
            assert direct_status == 200, direct
            expected = [
                ({**choice, "index": p * 2 + i}, chunk["usage"])
                for chunk in sse_payloads(direct)[:-1]
                for choice in chunk["choices"]
            ]
            assert per_choice[p * 2 + i] == expected
            prompt_tokens = len(prompt.split()) + 1  # the demo backend's count
            assert {u["prompt_tokens"] for _, u in per_choice[p * 2 + i]} == {prompt_tokens}


def completion_chunk(rid: str, text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    chunk = {"id": f"cmpl-{rid}", "object": "text_completion", "created": 1, "model": "m",
             "choices": [choice]}  # fmt: skip
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def test_childrens_keepalive_comments_reach_a_quiet_stream_one_at_a_time(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    """A queued fan-out shows the server's pulse (vLLM's --sse-keep-alive-interval): a child's
    comment passes when nothing was written since that child's previous one, so two children
    pulsing together give one, and one after chunks is dropped (docs/behaviour.md#keep-alive;
    the rule itself: tests/request/test_mailbox.py)."""
    go = asyncio.Event()

    async def answer(request: web.Request) -> web.StreamResponse:
        rid = request.headers["X-Request-Id"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": pulse\n\n")  # both at once: one reaches the client
        await go.wait()
        # Chunks go out with it (or just before it): this comment is not needed, and dropped.
        await response.write(completion_chunk(rid, "a") + b": pulse\n\n")
        await response.write(completion_chunk(rid, "", "stop") + b"data: [DONE]\n\n")
        return response

    upstream = await servers.upstream(answer)
    # n-proxy's own keep-alive off: every comment the client sees is a child's.
    config = single_upstream_config(upstream.url).model_copy(update={"sse_keepalive_seconds": 0})
    proxy = await servers.proxy(config)
    body = {"model": "m", "prompt": "p", "n": 2, "stream": True}
    async with (
        asyncio.timeout(WAIT),
        http.post(proxy.url + COMPLETIONS, json=body, headers={"X-Request-Id": "k"}) as response,
    ):
        assert response.status == 200

        async def frame() -> bytes:
            async with asyncio.timeout(30):
                return await response.content.readuntil(b"\n\n")

        assert await frame() == b": pulse\n\n"
        go.set()
        rest = await response.read()
    assert not rest.startswith(b":")  # no other comment came
    assert b"\n:" not in rest
    payloads = sse_payloads(rest)
    assert payloads[-1] == "[DONE]"
    assert sorted(c["choices"][0]["index"] for c in payloads[:-1]) == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 11}, "n"),
        ({"n": "3"}, "n"),
        ({"n": True}, "n"),
        ({"n": 2.5}, "n"),
        ({"n": 3, "seed": 2**63 - 2}, "seed"),
        ({"n": 2, "seed": -(2**63) - 1}, "seed"),
    ],
)
async def test_invalid_n_or_seed_is_400_and_nothing_reaches_upstream(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend, body: dict[str, Any], param: str
) -> None:
    status, raw, _ = await post(
        http, proxy.url + CHAT, {"model": "m", "messages": MESSAGES, **body}
    )
    assert status == 400
    error = orjson.loads(raw)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert backend.state.seen == []


@pytest.mark.parametrize("raw_body", [b"{not json", b"[1, 2]", b'"n"'])
async def test_fanout_path_with_bad_json_is_400(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend, raw_body: bytes
) -> None:
    async with http.post(
        proxy.url + CHAT, data=raw_body, headers={"Content-Type": "application/json"}
    ) as response:
        assert response.status == 400
        assert (await response.json())["error"]["type"] == "invalid_request_error"
    assert backend.state.seen == []


async def test_child_500_before_headers_returns_that_status_and_aborts_siblings_when_all(
    http: aiohttp.ClientSession, make_proxy: Any, backend: Backend
) -> None:
    proxy = await make_proxy(proxy_config(backend, stream_start="all"))
    body = {
        "model": "m",
        "messages": MESSAGES,
        "n": 3,
        "seed": 10,
        "stream": True,
        "max_tokens": 50,
        "x_demo": {"only_seed": 11, "fault": "status_500"},
    }
    status, raw, _ = await post(http, proxy.url + CHAT, body, "f1")
    assert status == 500
    assert "error" in orjson.loads(raw)
    await backend.state.wait_for(lambda s: not s.active)


async def test_child_400_non_streaming_relays_status_and_body(
    http: aiohttp.ClientSession, proxy: Proxy
) -> None:
    body = {
        "model": "m",
        "messages": MESSAGES,
        "n": 2,
        "seed": 0,
        "x_demo": {"only_seed": 1, "fault": "status_400"},
    }
    status, raw, _ = await post(http, proxy.url + CHAT, body)
    assert status == 400
    assert orjson.loads(raw)["error"]["type"] == "invalid_request_error"


ERRORS: dict[str, tuple[dict[str, Any], int]] = {
    "child-400": ({"n": 2, "seed": 0, "x_demo": {"only_seed": 1, "fault": "status_400"}}, 400),
    "child-500-stream": (
        {"n": 2, "seed": 0, "stream": True, "x_demo": {"fault": "status_500"}},
        500,
    ),
    "invalid-n": ({"n": 0}, 400),
    "invalid-seed": ({"n": 3, "seed": 2**63 - 2}, 400),
}


@pytest.mark.parametrize("name", list(ERRORS))
@pytest.mark.parametrize("named_by", ["header", "body"])
async def test_a_fanout_ending_in_an_error_carries_the_parents_request_id(
    http: aiohttp.ClientSession, proxy: Proxy, name: str, named_by: str
) -> None:
    fields, expected = ERRORS[name]
    body = {"model": "m", "messages": MESSAGES, **fields}
    if named_by == "body":
        body["request_id"] = "e-body"
    status, raw, headers = await post(
        http, proxy.url + CHAT, body, "e-head" if named_by == "header" else None
    )
    assert status == expected, raw
    assert "error" in orjson.loads(raw)
    assert headers["X-Request-Id"] == ("e-head" if named_by == "header" else "e-body")


async def test_a_fanout_error_without_a_client_id_carries_a_fresh_one(
    http: aiohttp.ClientSession, make_proxy: Any
) -> None:
    proxy = await make_proxy(single_upstream_config("http://127.0.0.1:9"))
    for body in ({"model": "m", "messages": MESSAGES, "n": 2}, b"{not json"):
        status, _, headers = await post(http, proxy.url + CHAT, body)
        assert status in (400, 502)
        assert len(headers["X-Request-Id"]) == 32
    status, _, headers = await post(http, proxy.url + CHAT, {"model": "m", "messages": MESSAGES})
    assert status == 502
    assert "X-Request-Id" not in headers  # a pass-through's error names nothing it was not sent


async def test_child_reset_mid_stream_sends_one_error_event_then_done(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = {
        "model": "m",
        "messages": MESSAGES,
        "n": 3,
        "seed": 20,
        "stream": True,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "x_demo": {
            "only_seed": 22,
            "fault": "reset_mid_stream",
            "after_tokens": 2,
            "token_delay": 0.001,
        },
    }
    status, raw, _ = await post(http, proxy.url + CHAT, body)
    assert status == 200
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    errors = [p for p in payloads[:-1] if "error" in p]
    assert len(errors) == 1
    assert errors[0]["error"]["type"] == "server_error"
    assert "choice 2" in errors[0]["error"]["message"]
    assert payloads[-2] is errors[0]
    assert not [p for p in payloads[:-1] if "error" not in p and not p["choices"]]  # no usage chunk
    await backend.state.wait_for(lambda s: not s.active)


async def test_error_event_mid_stream_is_relayed_as_one_error(
    http: aiohttp.ClientSession, proxy: Proxy
) -> None:
    body = {
        "model": "m",
        "prompt": "x",
        "n": 2,
        "seed": 0,
        "stream": True,
        "max_tokens": 8,
        "x_demo": {"only_seed": 0, "fault": "error_event", "after_tokens": 1},
    }
    status, raw, _ = await post(http, proxy.url + COMPLETIONS, body)
    assert status == 200
    payloads = sse_payloads(raw)
    error = next(p for p in payloads if p != "[DONE]" and "error" in p)["error"]
    assert error["message"].startswith("choice 0")
    assert payloads[-1] == "[DONE]"


async def test_client_disconnect_aborts_every_child(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = {
        "model": "m",
        "messages": MESSAGES,
        "n": 3,
        "seed": 1,
        "stream": True,
        "max_tokens": 10_000,
        "ignore_eos": True,
        "x_demo": {"token_delay": 0.01},
    }
    async with http.post(proxy.url + CHAT, json=body, headers={"X-Request-Id": "gone"}) as response:
        assert response.status == 200
        await response.content.readline()
        await backend.state.wait_for(lambda s: len(s.active) == 3)
        response.close()
    children = {"0_gone", "1_gone", "2_gone"}
    await backend.state.wait_for(lambda s: children <= set(s.aborted), timeout=10)
    assert not backend.state.active


async def test_client_disconnect_non_streaming_aborts_every_child(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = {
        "model": "m",
        "messages": MESSAGES,
        "n": 2,
        "seed": 1,
        "max_tokens": 10_000,
        "ignore_eos": True,
        "x_demo": {"token_delay": 0.01},
    }
    task = asyncio.create_task(post(http, proxy.url + CHAT, body, "gone2"))
    await backend.state.wait_for(lambda s: len(s.active) == 2)
    task.cancel()
    await backend.state.wait_for(lambda s: {"0_gone2", "1_gone2"} <= set(s.aborted), timeout=10)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_fanout_its_client_left_leaves_nothing_for_the_next_one_to_raise(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend, stream: bool
) -> None:
    # Compiled by mypyc, a fan-out whose ``finally`` awaited left the cancellation it handled in
    # the thread's sys.exc_info(), and every later fan-out re-raised it: this test's thread is
    # the proxy's (docs/architecture.md#working-on-a-compiled-module).
    body = {
        "model": "m",
        "messages": MESSAGES,
        "n": 2,
        "seed": 1,
        "stream": stream,
        "max_tokens": 10_000,
        "ignore_eos": True,
        "x_demo": {"token_delay": 0.01},
    }
    task = asyncio.create_task(post(http, proxy.url + CHAT, body, "left"))
    await backend.state.wait_for(lambda s: len(s.active) == 2)
    task.cancel()
    await backend.state.wait_for(lambda s: {"0_left", "1_left"} <= set(s.aborted), timeout=3)
    assert sys.exc_info() == (None, None, None)
    status, raw, _ = await post(
        http, proxy.url + CHAT, {"model": "m", "messages": MESSAGES, "n": 2, "stream": stream}
    )
    assert status == 200
    if stream:
        assert sse_payloads(raw)[-1] == "[DONE]"
    else:
        assert len(orjson.loads(raw)["choices"]) == 2


async def test_upstream_unreachable_is_502(http: aiohttp.ClientSession, make_proxy: Any) -> None:
    proxy = await make_proxy(single_upstream_config("http://127.0.0.1:9"))
    for body in (
        {"model": "m", "messages": MESSAGES, "n": 2},
        {"model": "m", "messages": MESSAGES},
    ):
        status, raw, _ = await post(http, proxy.url + CHAT, body)
        assert status == 502
        assert orjson.loads(raw)["error"]["type"] == "server_error"


async def test_finish_reason_abort_is_a_normal_choice(
    http: aiohttp.ClientSession, proxy: Proxy
) -> None:
    body = {
        "model": "m",
        "messages": MESSAGES,
        "n": 2,
        "seed": 0,
        "max_tokens": 8,
        "x_demo": {"only_seed": 1, "fault": "abort", "after_tokens": 2},
    }
    status, raw, _ = await post(http, proxy.url + CHAT, body)
    assert status == 200
    reasons = [c["finish_reason"] for c in orjson.loads(raw)["choices"]]
    assert reasons[1] == "abort"


async def test_configured_prefix_path_fans_out(
    http: aiohttp.ClientSession, make_proxy: Any, backend: Backend
) -> None:
    # The backend serves /v1/...; a prefix is configured where the backend mounts the same API.
    proxy = await make_proxy(proxy_config(backend, fanout_paths=("/v1/chat/completions",)))
    status, raw, _ = await post(
        http, proxy.url + CHAT, {"model": "m", "messages": MESSAGES, "n": 2}
    )
    assert status == 200
    assert len(orjson.loads(raw)["choices"]) == 2
    status, raw, _ = await post(
        http, proxy.url + COMPLETIONS, {"model": "m", "prompt": "x", "n": 2}
    )
    assert status == 400  # not a fan-out path here: passed through, and the backend rejects n=2
    assert orjson.loads(raw)["error"]["message"] == "Only n=1 is supported"


async def test_native_n_upstream_passes_n_through(
    http: aiohttp.ClientSession, make_proxy: Any, make_backend: Any
) -> None:
    native = await make_backend(native_n=True)
    proxy = await make_proxy(with_upstream(proxy_config(native), native_n=True))
    status, raw, _ = await post(
        http,
        proxy.url + CHAT,
        {"model": "m", "messages": MESSAGES, "n": 3},
        "nat",
    )
    assert status == 200
    assert len(orjson.loads(raw)["choices"]) == 3
    assert [rid for rid, _, _ in native.state.seen] == ["nat"]


@pytest.mark.parametrize("mode", ["uuid", "omit"])
async def test_child_request_id_mode_for_servers_that_reject_prefixed_ids(
    http: aiohttp.ClientSession, make_proxy: Any, backend: Backend, mode: str
) -> None:
    import uuid

    proxy = await make_proxy(with_upstream(proxy_config(backend), child_request_id=mode))
    body = {"model": "m", "messages": MESSAGES, "n": 2}
    status, _, headers = await post(http, proxy.url + CHAT, body, "mine")
    assert status == 200
    assert headers["X-Request-Id"] == "mine"
    sent = [h.get("x-request-id") for _, _, h in backend.state.seen]
    if mode == "uuid":
        assert len({str(uuid.UUID(rid)) for rid in sent if rid}) == 2
    else:
        assert sent == [None, None]


async def test_child_error_with_empty_body_becomes_an_openai_error(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=400)  # llama-cpp-python's answer to a request id it dislikes

    upstream = await servers.upstream(refuse)
    proxy = await servers.proxy(single_upstream_config(upstream.url))
    status, raw, _ = await post(
        http, proxy.url + CHAT, {"model": "m", "messages": MESSAGES, "n": 2}
    )
    assert status == 400
    error = orjson.loads(raw)["error"]
    assert error["message"] == "upstream answered 400 with an empty body"
    assert error["type"] == "invalid_request_error"


async def test_stream_needing_more_children_than_max_concurrency_is_400_when_all(
    http: aiohttp.ClientSession, make_proxy: Any, backend: Backend
) -> None:
    config = parse_config(
        f'stream_start: all\nupstreams: [{{name: u, url: "{backend.url}", max_concurrency: 4}}]',
        env={},
    )
    proxy = await make_proxy(config)
    body = {"model": "m", "prompt": ["a", "b", "c"], "n": 2, "stream": True}
    status, raw, _ = await post(http, proxy.url + COMPLETIONS, body)
    assert status == 400
    assert orjson.loads(raw)["error"]["param"] == "prompt"
    assert backend.state.seen == []
    # without streaming the same batch is answered: its children take turns in 4 slots
    status, raw, _ = await post(http, proxy.url + COMPLETIONS, {**body, "stream": False})
    assert status == 200
    assert [c["index"] for c in orjson.loads(raw)["choices"]] == [0, 1, 2, 3, 4, 5]


MAX_EVENT_BYTES = 300  # a child's SSE line or event the proxy holds at most, here


def _chunk_line(rid: str, length: int, **choice: Any) -> bytes:
    """One ``data:`` line of ``length`` bytes (its end not counted), padded in its content."""

    def line(content: str) -> bytes:
        delta = {"index": 0, "delta": {"content": content}, **choice}
        chunk = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 1}
        return b"data: " + orjson.dumps({**chunk, "model": "m", "choices": [delta]})

    padded = line("x" * (length - len(line(""))))
    assert len(padded) == length
    return padded


@pytest.mark.parametrize(
    ("over", "held"),
    [
        pytest.param(0, False, id="at-the-bound"),
        pytest.param(1, True, id="past-it-mid-body"),
        pytest.param(1, False, id="past-it-in-the-bodys-last-read"),
    ],
)
async def test_a_child_line_past_the_decoders_bound_is_the_streams_one_error_event(
    http: aiohttp.ClientSession, servers: Servers, over: int, held: bool
) -> None:
    """Child 1 sends one line of exactly the bound, or one byte more: the fan-out maps the
    decoder's SSEError to the stream's one error event, for that choice, then ``[DONE]``.
    ``held``: child 1 sends nothing after that line until the proxy hangs up."""

    async def children(request: web.Request) -> web.StreamResponse:
        rid = request.headers["X-Request-Id"]
        length = MAX_EVENT_BYTES + over if rid.startswith("1_") else 200
        first = _chunk_line(rid, length, finish_reason=None) + b"\n\n"
        rest = _chunk_line(rid, 200, finish_reason="stop") + b"\n\ndata: [DONE]\n\n"
        if not (held and rid.startswith("1_")):  # the whole body in one write, one read
            return web.Response(body=first + rest, content_type="text/event-stream")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(first)
        async with asyncio.timeout(WAIT):  # cancelled once the proxy drops the connection
            await asyncio.Event().wait()
        await response.write(rest)
        return response

    upstream = await servers.upstream(children)
    config = single_upstream_config(upstream.url, max_response_bytes=MAX_EVENT_BYTES)
    proxy = await servers.proxy(config)
    body = {"model": "m", "messages": MESSAGES, "n": 2, "stream": True}
    status, raw, _ = await post(http, proxy.url + CHAT, body, "t")
    assert status == 200
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    errors = [p for p in payloads[:-1] if "error" in p]
    if over:
        (error,) = errors
        assert payloads[-2] is error
        assert error["error"]["type"] == "server_error"
        assert error["error"]["message"] == (
            "choice 1 failed: upstream stream is malformed: "
            f"SSE line or event exceeds max_event_bytes={MAX_EVENT_BYTES}"
        )
    else:
        assert errors == []
        finished = [c["index"] for p in payloads[:-1] for c in p["choices"] if c["finish_reason"]]
        assert sorted(finished) == [0, 1]


async def test_a_line_past_the_bound_in_the_last_read_of_a_relayed_child_is_its_error_event(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    """Child 1's first chunk reaches the client (its body is being relayed), then the rest of
    its body comes in one read that also ends it: a line past the bound in that read is still
    that choice's error event, not "stream ended before finishing"."""
    relayed = asyncio.Event()

    async def children(request: web.Request) -> web.StreamResponse:
        rid = request.headers["X-Request-Id"]
        if not rid.startswith("1_"):
            body = _chunk_line(rid, 200, finish_reason="stop") + b"\n\ndata: [DONE]\n\n"
            return web.Response(body=body, content_type="text/event-stream")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(_chunk_line(rid, 200, finish_reason=None) + b"\n\n")
        async with asyncio.timeout(WAIT):
            await relayed.wait()
        # One write and the end of the chunked body together: one read on loopback.
        await response.write_eof(_chunk_line(rid, MAX_EVENT_BYTES + 1, finish_reason="stop"))
        return response

    upstream = await servers.upstream(children)
    config = single_upstream_config(upstream.url, max_response_bytes=MAX_EVENT_BYTES)
    proxy = await servers.proxy(config)
    body = {"model": "m", "messages": MESSAGES, "n": 2, "stream": True}
    raw = b""
    async with http.post(proxy.url + CHAT, json=body, headers={"X-Request-Id": "t"}) as r:
        assert r.status == 200
        async with asyncio.timeout(WAIT):
            async for piece in r.content.iter_any():
                raw += piece
                if not relayed.is_set() and any(
                    c["index"] == 1 and c["delta"].get("content")
                    for p in sse_payloads(raw.rpartition(b"\n\n")[0] + b"\n\n")
                    if p != "[DONE]"
                    for c in p["choices"]
                ):
                    relayed.set()  # child 1's first chunk is here: its body is being relayed
    payloads = sse_payloads(raw)
    assert payloads.count("[DONE]") == 1
    (error,) = [p for p in payloads[:-1] if "error" in p]
    assert error["error"]["message"] == (
        "choice 1 failed: upstream stream is malformed: "
        f"SSE line or event exceeds max_event_bytes={MAX_EVENT_BYTES}"
    )


# --- all children, or the first failure as it happens -------------------------------------------


async def _child(seconds: float, result: Any = None, error: BaseException | None = None) -> Any:
    await asyncio.sleep(seconds)
    if error is not None:
        raise error
    return result


async def test_every_childs_result_comes_back_in_the_childrens_order() -> None:
    tasks = [asyncio.ensure_future(_child(s, s)) for s in (0.03, 0, 0.01)]
    assert await fanout._all_or_first_failure(tasks) == [0.03, 0, 0.01]


async def test_the_first_failure_is_raised_as_it_happens_not_when_all_have_ended() -> None:
    slow = asyncio.ensure_future(_child(60, "late"))
    failing = asyncio.ensure_future(_child(0, error=ValueError("child 1")))
    with pytest.raises(ValueError, match="child 1"):
        async with asyncio.timeout(30):
            await fanout._all_or_first_failure([slow, failing])
    assert not slow.done()  # the caller cancels what is left
    slow.cancel()


async def test_children_already_ended_are_waited_for_as_well() -> None:
    done = [asyncio.ensure_future(_child(0, i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert all(task.done() for task in done)
    assert await fanout._all_or_first_failure(done) == [0, 1, 2]
    failed = asyncio.ensure_future(_child(0, error=KeyError("k")))
    await asyncio.sleep(0.01)
    with pytest.raises(KeyError):
        await fanout._all_or_first_failure([*done, failed])


async def test_a_caller_cancelled_while_it_waits_leaves_no_callback_on_the_children() -> None:
    tasks = [asyncio.ensure_future(_child(60)) for _ in range(2)]
    waiting = asyncio.ensure_future(fanout._all_or_first_failure(tasks))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    for task in tasks:
        assert not getattr(task, "_callbacks", None)  # asyncio's list of them: none of the wait's
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
