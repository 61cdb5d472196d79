"""End to end: n for vLLM's token-in/token-out endpoint, ``/inference/v1/generate``
(docs/behaviour.md#generate), n-proxy in front of the real demo backend on loopback.

The demo backend serves the endpoint for ``n = 1`` only and refuses more as vLLM's Rust frontend
does; every choice the proxy stitches must equal the backend's own ``n = 1`` answer for
``seed + i``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.config.models import Config, Eject, Placement, Upstream, single_upstream_config
from tests.support.client import WAIT, post, sse_payloads
from tests.support.rawhttp import parse_raw
from tests.support.rawupstream import RawUpstream
from tests.support.servers import Backend, Proxy, Servers, proxy_config, with_upstream

GENERATE = "/inference/v1/generate"
CHAT = "/v1/chat/completions"
PROMPT = [101, 7, 2024, 9]
USAGE = {"include_usage": True}
PACK = Placement(choose="round_robin", pack="all")  # the "pack" preset: one replica per request


def generate_body(n: int | None = 3, seed: int | None = 40, **fields: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": 6, **fields.pop("params", {})}
    if n is not None:
        params["n"] = n
    if seed is not None:
        params["seed"] = seed
    return {"model": "m", "token_ids": PROMPT, "sampling_params": params, **fields}


async def own_answer(
    http: aiohttp.ClientSession, backend: Backend, body: dict[str, Any], seed: int | None
) -> dict[str, Any]:
    """The backend's own n = 1 answer to ``body`` with ``seed``: no proxy in between."""
    params = {k: v for k, v in body["sampling_params"].items() if k != "n"}
    if seed is not None:
        params["seed"] = seed
    alone = {**body, "sampling_params": params, "stream": False}
    status, raw, _ = await post(http, backend.url + GENERATE, alone)
    assert status == 200, raw
    answer = orjson.loads(raw)
    assert isinstance(answer, dict)
    return answer


def children(backend: Backend) -> dict[str, tuple[dict[str, Any], dict[str, str]]]:
    return {rid: (body, headers) for rid, body, headers in backend.state.seen}


async def test_generate_n3_choices_equal_the_backends_own_answers_for_seed_plus_i(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = generate_body(params={"logprobs": 2})
    status, raw, headers = await post(http, proxy.url + GENERATE, body, "abc")
    assert status == 200, raw
    assert headers["X-Request-Id"] == "abc"
    assert headers["Content-Type"].startswith("application/json")
    merged = orjson.loads(raw)
    alone = [await own_answer(http, backend, body, 40 + i) for i in range(3)]
    # The Python frontend's native-n shape: child 0's envelope, the parent's request_id.
    assert merged["request_id"] == "generate-tokens-abc"
    assert "id" not in merged
    assert (merged["model"], merged["output_mode"]) == ("m", "tokens")
    assert list(merged) == list(alone[0])
    assert [c["index"] for c in merged["choices"]] == [0, 1, 2]
    for i, choice in enumerate(merged["choices"]):
        (expected,) = alone[i]["choices"]
        assert choice == {**expected, "index": i}  # token ids, logprobs, finish reason
        assert len(choice["token_ids"]) == 6
        assert choice["logprobs"]["content"][0]["token_id"] == choice["token_ids"][0]
    assert len({tuple(c["token_ids"]) for c in merged["choices"]}) == 3
    assert merged["usage"] == {
        "prompt_tokens": len(PROMPT),  # the prompt once
        "completion_tokens": 3 * 6,  # every choice's tokens
        "total_tokens": len(PROMPT) + 3 * 6,
        "prompt_tokens_details": alone[0]["usage"]["prompt_tokens_details"],
    }


async def test_generate_children_get_seed_plus_i_their_ids_and_every_other_field_unchanged(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    features = {"mm_hashes": {"image": ["h0"]}, "mm_placeholders": {"image": [{"offset": 0}]}}
    extra = {
        "request_id": "rollout-3",
        "features": features,
        "priority": 5,
        "kv_transfer_params": {"do_remote_decode": True},
        "cache_salt": "salt",
        "x_vendor": [1, {"k": None}],
    }
    body = generate_body(n=4, seed=11, params={"temperature": 0.7, "top_k": 5}, **extra)
    sent = {"Authorization": "Bearer secret"}
    status, raw, _ = await post(http, proxy.url + GENERATE, body, "grp", headers=sent)
    assert status == 200, raw
    seen = children(backend)
    assert sorted(seen) == ["0_grp", "1_grp", "2_grp", "3_grp"]
    for i in range(4):
        child, headers = seen[f"{i}_grp"]
        assert child == {
            **body,
            **extra,
            "request_id": f"{i}_rollout-3",
            "sampling_params": {"max_tokens": 6, "temperature": 0.7, "top_k": 5, "seed": 11 + i},
        }
        assert headers["authorization"] == "Bearer secret"
    assert orjson.loads(raw)["request_id"] == "generate-tokens-grp"


@pytest.mark.parametrize(("seed", "sent"), [(None, [None] * 3), (-1, [-1] * 3)])
async def test_generate_without_a_seed_or_with_minus_one_sends_every_child_the_same(
    http: aiohttp.ClientSession,
    proxy: Proxy,
    backend: Backend,
    seed: int | None,
    sent: list[int | None],
) -> None:
    status, raw, _ = await post(http, proxy.url + GENERATE, generate_body(seed=seed), "s")
    assert status == 200, raw
    seen = children(backend)
    assert [seen[f"{i}_s"][0]["sampling_params"].get("seed") for i in range(3)] == sent


@pytest.mark.parametrize("params", [{}, {"n": 1}, {"n": None}], ids=["no-n", "n-1", "null"])
async def test_generate_without_n_above_one_passes_through_byte_for_byte(
    http: aiohttp.ClientSession, servers: Servers, params: dict[str, Any]
) -> None:
    answer = b'{"request_id":"generate-tokens-one",  "choices":[]}'

    async def reply(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    upstream = await servers.upstream(reply)
    proxy = await servers.proxy(single_upstream_config(upstream.url))
    sent = orjson.dumps(generate_body(n=None, seed=3, params=params)).replace(b",", b", ")
    status, raw, _ = await post(http, proxy.url + GENERATE, sent, "one")
    assert (status, raw) == (200, answer)
    (seen,) = upstream.seen
    assert (seen.body, seen.request_id) == (sent, "one")


async def test_the_backend_refuses_generate_n_above_one_as_vllms_rust_frontend(
    http: aiohttp.ClientSession, backend: Backend, make_proxy: Any
) -> None:
    status, raw, _ = await post(http, backend.url + GENERATE, generate_body(n=2))
    assert status == 400
    error = orjson.loads(raw)["error"]
    assert (error["message"], error["type"], error["param"]) == (
        "Only n=1 is supported.",
        "invalid_request_error",
        "n",
    )
    # A native_n upstream gets n unsplit: here, the backend's own refusal comes back.
    proxy = await make_proxy(with_upstream(proxy_config(backend), native_n=True))
    status, relayed, _ = await post(http, proxy.url + GENERATE, generate_body(n=2))
    assert (status, relayed) == (400, raw)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        pytest.param({"n": 11}, "n", id="past-max-n"),
        pytest.param({"n": "3"}, "n", id="string"),
        pytest.param({"n": True}, "n", id="true"),
        pytest.param({"n": 2, "seed": 2**63 - 1}, "seed", id="seed-overflows"),
    ],
)
async def test_generate_invalid_n_or_seed_is_400_and_nothing_reaches_the_backend(
    http: aiohttp.ClientSession,
    proxy: Proxy,
    backend: Backend,
    params: dict[str, Any],
    param: str,
) -> None:
    body = {"token_ids": PROMPT, "sampling_params": params}
    status, raw, _ = await post(http, proxy.url + GENERATE, body, "bad")
    assert status == 400
    error = orjson.loads(raw)["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    on_chat = await post(http, proxy.url + CHAT, {"messages": [], **params}, "bad")
    assert (on_chat.status, on_chat.body) == (400, raw)  # the same refusal, word for word
    assert not backend.state.seen


async def test_generate_stream_interleaves_choices_and_ends_with_merged_usage_and_one_done(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = generate_body(stream=True, stream_options=USAGE)
    status, raw, headers = await post(http, proxy.url + GENERATE, body, "st")
    assert status == 200, raw
    assert headers["Content-Type"] == "text/event-stream"
    assert headers["X-Request-Id"] == "st"
    payloads = sse_payloads(raw)
    assert payloads.count("[DONE]") == 1
    assert payloads[-1] == "[DONE]"
    *chunks, tail = payloads[:-1]
    for chunk in chunks:
        assert chunk["request_id"] == "generate-tokens-st"
        assert not {"id", "created", "model"} & set(chunk)  # vLLM's generate chunks have none
        (choice,) = chunk["choices"]
        assert len(choice["token_ids"]) == 1  # no opening: every chunk carries a token
    tokens: dict[int, list[int]] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        tokens.setdefault(choice["index"], []).extend(choice["token_ids"])
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert sorted(tokens) == [0, 1, 2]
    for i in range(3):
        (expected,) = (await own_answer(http, backend, body, 40 + i))["choices"]
        assert tokens[i] == expected["token_ids"]
        assert finishes[i] == expected["finish_reason"]
    assert tail == {
        "request_id": "generate-tokens-st",
        "usage": {
            "prompt_tokens": len(PROMPT),
            "completion_tokens": 18,
            "total_tokens": len(PROMPT) + 18,
            "prompt_tokens_details": {"cached_tokens": len(PROMPT) // 2},
        },
        "output_mode": "tokens",
        "choices": [],
    }


async def test_generate_stream_without_include_usage_ends_with_done_alone(
    http: aiohttp.ClientSession, proxy: Proxy
) -> None:
    status, raw, _ = await post(http, proxy.url + GENERATE, generate_body(n=2, stream=True))
    assert status == 200, raw
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    assert all(p["choices"] for p in payloads[:-1])
    assert len(payloads) == 2 * 6 + 1


async def test_generate_child_failing_before_the_answer_fails_the_request_with_its_status(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    demo = {"fault": "status_500", "only_seed": 41}  # choice 1 only
    status, raw, _ = await post(http, proxy.url + GENERATE, generate_body(x_demo=demo), "fail")
    assert status == 500
    assert orjson.loads(raw)["error"]["message"] == "Injected fault status_500"
    await backend.state.wait_for(lambda s: not s.active)


async def test_generate_stream_whose_first_answer_fails_gets_that_status_and_no_200(
    http: aiohttp.ClientSession, proxy: Proxy
) -> None:
    body = generate_body(stream=True, x_demo={"fault": "status_429"})
    status, raw, _ = await post(http, proxy.url + GENERATE, body, "busy")
    assert status == 429
    assert orjson.loads(raw)["error"]["type"] == "rate_limit_error"


async def test_generate_stream_error_after_the_200_is_one_error_event_then_done(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    demo = {"fault": "error_event", "after_tokens": 2, "only_seed": 40}  # choice 0
    body = generate_body(stream=True, stream_options=USAGE, x_demo=demo)
    status, raw, _ = await post(http, proxy.url + GENERATE, body, "mid")
    assert status == 200
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    errors = [p for p in payloads[:-1] if "error" in p]
    assert errors == [payloads[-2]]  # the last event, and no usage chunk before [DONE]
    assert errors[0]["error"]["type"] == "server_error"
    assert errors[0]["error"]["message"].startswith("choice 0 failed")
    assert not [p for p in payloads[:-2] if not p["choices"]]
    await backend.state.wait_for(lambda s: not s.active)


async def test_generate_stream_client_disconnect_aborts_every_child(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = generate_body(
        stream=True,
        params={"max_tokens": 10_000, "ignore_eos": True},
        x_demo={"token_delay": 0.01},
    )
    async with http.post(proxy.url + GENERATE, json=body, headers={"X-Request-Id": "gone"}) as r:
        assert r.status == 200
        await r.content.readline()
        await backend.state.wait_for(lambda s: len(s.active) == 3)
        r.close()
    gone = {"0_gone", "1_gone", "2_gone"}
    await backend.state.wait_for(lambda s: gone <= set(s.aborted), timeout=WAIT)
    assert not backend.state.active


async def test_generate_json_client_disconnect_aborts_every_child(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    body = generate_body(
        n=2, params={"max_tokens": 10_000, "ignore_eos": True}, x_demo={"token_delay": 0.01}
    )
    task = asyncio.create_task(post(http, proxy.url + GENERATE, body, "left"))
    await backend.state.wait_for(lambda s: len(s.active) == 2)
    task.cancel()
    await backend.state.wait_for(lambda s: {"0_left", "1_left"} <= set(s.aborted), timeout=WAIT)


async def exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        async with asyncio.timeout(WAIT):
            return await reader.read()  # Connection: close: the proxy ends the exchange
    finally:
        writer.close()
        await writer.wait_closed()


def raw_post(path: str, body: dict[str, Any], rid: str) -> bytes:
    data = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nX-Request-Id: {rid}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + data


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_generate_through_a_raw_http_client(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend, stream: bool
) -> None:
    body = generate_body(n=2, stream=stream, stream_options=USAGE if stream else None)
    reply = await exchange(proxy.port, raw_post(GENERATE, body, "raw"))
    status_line, headers, payload = parse_raw(reply)
    assert status_line == "HTTP/1.1 200 OK"
    assert headers["X-Request-Id"] == "raw"
    alone = [(await own_answer(http, backend, body, 40 + i))["choices"][0] for i in range(2)]
    if not stream:
        assert headers["Content-Length"] == str(len(payload))
        merged = orjson.loads(payload)
        assert [c["token_ids"] for c in merged["choices"]] == [a["token_ids"] for a in alone]
        return
    assert headers["Transfer-Encoding"] == "chunked"
    assert payload.endswith(b"data: [DONE]\n\n")
    payloads = sse_payloads(payload)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for chunk in payloads[:-2]:
        (choice,) = chunk["choices"]
        tokens[choice["index"]] += choice["token_ids"]
    assert [tokens[0], tokens[1]] == [a["token_ids"] for a in alone]
    assert payloads[-2]["usage"]["completion_tokens"] == 12


async def test_generate_with_pack_placement_keeps_a_group_on_one_replica(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    """A GRPO group shares its prompt: on one replica its prefix is computed once."""
    replicas = [await servers.backend() for _ in range(2)]
    upstream = Upstream(name="u", urls=tuple(b.url for b in replicas), placement=PACK)
    proxy = await servers.proxy(Config(upstreams=(upstream,)))
    for group in range(4):
        status, raw, _ = await post(http, proxy.url + GENERATE, generate_body(n=8), f"g{group}")
        assert status == 200, raw
        assert len(orjson.loads(raw)["choices"]) == 8
    for group in range(4):
        counts = [sum(rid.endswith(f"_g{group}") for rid, _, _ in b.state.seen) for b in replicas]
        assert sorted(counts) == [0, 8]
    assert all(b.state.seen for b in replicas)  # the groups themselves were spread


async def test_generate_children_cut_off_by_a_replica_are_retried_on_another_and_counted(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    live = await servers.backend()
    slammer = await servers.start(RawUpstream(closes={GENERATE}))  # closes before a status line
    upstream = Upstream(
        name="u",
        urls=(live.url, slammer.url),
        retry_on=("connect", "reset"),
        eject=Eject(failures=0),
    )
    proxy = await servers.proxy(Config(upstreams=(upstream,)))  # children spread over both
    status, raw, _ = await post(http, proxy.url + GENERATE, generate_body(n=4), "retry")
    assert status == 200, raw
    assert sorted(rid for rid, _, _ in live.state.seen) == [f"{i}_retry" for i in range(4)]
    tries = len(slammer.requests(GENERATE))
    assert tries >= 2  # round robin put half the group there first
    assert proxy.metric("n_proxy_retries_total", upstream="u", reason="reset") == tries
    fanned = {"route": GENERATE, "status": "200", "fanned_out": "true"}
    assert proxy.metric("n_proxy_requests_total", **fanned) == 1
    assert proxy.metric("n_proxy_request_n_sum") == 4
