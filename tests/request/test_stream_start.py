"""The stream starts at the first child's answer (docs/behaviour.md#stream-start), over real
loopback servers.

The demo backend sits behind ``tests.support.gate``, which holds chosen children's status lines
until the test opens them, so "one child is slow to start" is an event, not a sleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest

from proxy.config.models import Config, single_upstream_config
from proxy.server.app import GENERATIONS
from tests.request.test_fanout import CHAT, MESSAGES, direct_choice
from tests.support.client import sse_payloads
from tests.support.gate import Gate, gate_in_front
from tests.support.servers import Backend, Proxy, proxy_config, with_upstream

MakeProxy = Callable[[Config], Awaitable[Proxy]]
ROLE = {"role": "assistant", "content": ""}


@pytest.fixture
async def gate(backend: Backend) -> AsyncIterator[Gate]:
    async with gate_in_front(backend.url) as front:
        yield front


def stream_body(n: int, seed: int, **fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": MESSAGES,
        "n": n,
        "seed": seed,
        "max_tokens": 6,
        "stream": True,
        **fields,
    }


def assert_native_opening(chunks: list[Any], n: int) -> None:
    """Every choice announced, in index order, before any other chunk
    (docs/behaviour.md#opening)."""
    for index, chunk in enumerate(chunks[:n]):
        assert chunk["choices"] == [
            {"index": index, "delta": ROLE, "logprobs": None, "finish_reason": None}
        ]
    rest = [c for c in chunks[n:] if c != "[DONE]" and c["choices"]]
    assert all("role" not in c["choices"][0]["delta"] for c in rest)


async def expected_texts(http: aiohttp.ClientSession, backend: Backend, n: int, seed: int) -> Any:
    return {
        i: await direct_choice(
            http,
            backend,
            CHAT,
            {"model": "m", "messages": MESSAGES, "seed": seed + i, "max_tokens": 6},
        )
        for i in range(n)
    }


def texts_of(chunks: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        if chunk == "[DONE]" or "error" in chunk:
            continue
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (
                choice["delta"].get("content") or ""
            )
    return texts


async def test_first_data_chunk_does_not_wait_for_a_child_whose_headers_are_late(
    http: aiohttp.ClientSession, make_proxy: MakeProxy, backend: Backend, gate: Gate
) -> None:
    proxy = await make_proxy(_front(gate))
    gate.held = {1}
    async with http.post(proxy.url + CHAT, json=stream_body(3, 30)) as response:
        assert response.status == 200
        first = await response.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")
        assert not gate.answered[1].is_set()  # the late child has not answered yet
        gate.opened[1].set()
        raw = first + await response.read()
    chunks = sse_payloads(raw)
    assert_native_opening(chunks, 3)
    assert chunks[-1] == "[DONE]"
    assert chunks.count("[DONE]") == 1
    assert texts_of(chunks) == await expected_texts(http, backend, 3, 30)
    finishes = [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2]  # every choice exactly once


async def test_child_500_after_a_siblings_200_is_one_error_event_and_closes_the_siblings(
    http: aiohttp.ClientSession, make_proxy: MakeProxy, make_backend: Any
) -> None:
    slow: Backend = await make_backend(token_delay=0.01)  # siblings still generating at the end
    async with gate_in_front(slow.url) as gate:
        await _late_500(http, await make_proxy(_front(gate)), slow, gate)


async def _late_500(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend, gate: Gate
) -> None:
    gate.held = {2}
    body = stream_body(
        3, 10, max_tokens=10_000, ignore_eos=True,
        stream_options={"include_usage": True},
        x_demo={"only_seed": 12, "fault": "status_500"},
    )  # fmt: skip
    async with http.post(proxy.url + CHAT, json=body, headers={"X-Request-Id": "late"}) as r:
        assert r.status == 200
        first = await r.content.readuntil(b"\n\n")
        gate.opened[2].set()
        raw = first + await r.read()
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    errors = [p for p in payloads[:-1] if "error" in p]
    assert len(errors) == 1
    assert payloads[-2] is errors[0]
    assert errors[0]["error"]["type"] == "server_error"
    assert "choice 2" in errors[0]["error"]["message"]
    assert "500" in errors[0]["error"]["message"]
    assert not [p for p in payloads[:-1] if "error" not in p and not p["choices"]]  # no usage
    await gate.wait_for(lambda g: {0, 1} <= g.closed, timeout=10)  # the proxy closed them
    await backend.state.wait_for(lambda s: {"0_late", "1_late"} <= set(s.aborted), timeout=10)


async def test_first_answer_being_a_500_is_that_status_and_aborts_the_others(
    http: aiohttp.ClientSession, make_proxy: MakeProxy, backend: Backend, gate: Gate
) -> None:
    proxy = await make_proxy(_front(gate))
    gate.held = {1, 2}
    body = stream_body(3, 10, x_demo={"only_seed": 10, "fault": "status_500"})
    async with http.post(proxy.url + CHAT, json=body) as response:
        assert response.status == 500
        assert (await response.json())["error"]["message"] == "Injected fault status_500"
    await gate.wait_for(lambda g: {1, 2} <= g.closed)
    assert not gate.answered[1].is_set()
    assert not gate.answered[2].is_set()


async def test_n6_above_max_concurrency_2_streams_every_choice_two_children_at_a_time(
    http: aiohttp.ClientSession, make_proxy: MakeProxy, backend: Backend, gate: Gate
) -> None:
    proxy = await make_proxy(with_upstream(_front(gate), max_concurrency=2, max_queue=0))
    body = stream_body(6, 50, x_demo={"token_delay": 0.002})
    async with http.post(proxy.url + CHAT, json=body) as response:
        assert response.status == 200
        raw = await response.read()
    chunks = sse_payloads(raw)
    assert_native_opening(chunks, 6)
    assert texts_of(chunks) == await expected_texts(http, backend, 6, 50)
    assert gate.peak == 2
    slots = proxy.app[GENERATIONS].upstreams.state(proxy.config.upstreams[0]).slots
    assert (slots.in_use, slots.queued) == (0, 0)


async def test_two_large_streams_against_a_small_limit_both_complete(
    http: aiohttp.ClientSession, make_proxy: MakeProxy, backend: Backend, gate: Gate
) -> None:
    """No deadlock, no starvation: each holds slots only while its children generate."""
    proxy = await make_proxy(with_upstream(_front(gate), max_concurrency=3, max_queue=100))

    async def stream(seed: int) -> bytes:
        body = stream_body(8, seed, x_demo={"token_delay": 0.002})
        async with http.post(proxy.url + CHAT, json=body) as response:
            assert response.status == 200
            return await response.read()

    async with asyncio.timeout(20):
        a, b = await asyncio.gather(stream(100), stream(200))
    assert texts_of(sse_payloads(a)) == await expected_texts(http, backend, 8, 100)
    assert texts_of(sse_payloads(b)) == await expected_texts(http, backend, 8, 200)
    assert gate.peak <= 3


async def test_keepalive_comments_fill_a_gap_and_the_openai_client_parses_the_same_stream(
    http: aiohttp.ClientSession, make_proxy: MakeProxy, backend: Backend
) -> None:
    quiet = await make_proxy(proxy_config(backend, sse_keepalive_seconds=0))
    chatty = await make_proxy(proxy_config(backend, sse_keepalive_seconds=1))
    # One token after a 2.6 s gap: two keep-alives fit in it.
    body = stream_body(2, 3, max_tokens=1, x_demo={"token_delay": 2.6})

    async def raw_read(url: str) -> bytes:
        async with http.post(url + CHAT, json=body, headers={"X-Request-Id": "ka"}) as r:
            return await r.read()

    async def parsed(url: str) -> list[dict[str, Any]]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            stream = await c.chat.completions.create(
                **{k: v for k, v in body.items() if k != "x_demo"},
                extra_body={"x_demo": body["x_demo"]},
                extra_headers={"X-Request-Id": "ka"},
            )
            return [{**chunk.model_dump(), "created": 0} async for chunk in stream]

    with_comments, without, from_chatty, from_quiet = await asyncio.gather(
        raw_read(chatty.url), raw_read(quiet.url), parsed(chatty.url), parsed(quiet.url)
    )
    assert with_comments.count(b": keep-alive\n\n") >= 1
    assert b": keep-alive" not in without
    assert len(sse_payloads(with_comments)) == len(sse_payloads(without))
    assert texts_of(sse_payloads(with_comments)) == texts_of(sse_payloads(without))
    assert from_chatty == from_quiet
    assert len(from_chatty) >= 4


async def test_stream_start_all_waits_for_every_status_line(
    http: aiohttp.ClientSession, make_proxy: MakeProxy, backend: Backend, gate: Gate
) -> None:
    proxy = await make_proxy(_front(gate).model_copy(update={"stream_start": "all"}))
    gate.held = {1}
    request = asyncio.create_task(
        http.post(proxy.url + CHAT, json=stream_body(3, 60), headers={"X-Request-Id": "all"})
    )
    await backend.state.wait_for(lambda s: {"0_all", "2_all"} <= set(s.finished))
    await asyncio.sleep(0.05)  # a margin for a wrong 200 to show up; its absence is the check
    assert not request.done()
    gate.opened[1].set()
    response = await request
    assert response.status == 200
    chunks = sse_payloads(await response.read())
    assert_native_opening(chunks, 3)
    assert texts_of(chunks) == await expected_texts(http, backend, 3, 60)


def _front(gate: Gate) -> Config:
    """n-proxy's config with the gate in front of the demo backend as its upstream."""
    return single_upstream_config(gate.url)
