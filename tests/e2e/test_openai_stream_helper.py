"""The openai SDK's ``.stream()`` helper (sync and async) over n-proxy, whatever child starts first.

The helper finds a choice by its list position, so it crashed (IndexError) whenever child 0 was
not the first to answer; the stitched stream opens with every choice in index order
(docs/behaviour.md#opening).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from proxy.config.models import Config, single_upstream_config
from tests.support.gate import Gate, gate_in_front
from tests.support.servers import Backend, Proxy

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "three haiku"}]
SEED = 70
N = 3
MAX_TOKENS = 200  # every choice ends with "stop": the helper refuses to parse a "length" end


@pytest.fixture
async def gate(backend: Backend) -> AsyncIterator[Gate]:
    async with gate_in_front(backend.url) as front:
        yield front


@pytest.fixture
async def expected(backend: Backend) -> list[str | None]:
    async with openai.AsyncOpenAI(
        base_url=backend.url + "/v1", api_key="x", max_retries=0
    ) as direct:
        answers = [
            await direct.chat.completions.create(
                model="m", messages=MESSAGES, seed=SEED + i, max_tokens=MAX_TOKENS
            )
            for i in range(N)
        ]
    return [a.choices[0].message.content for a in answers]


def check(final: ChatCompletion, expected: list[str | None]) -> None:
    assert [c.index for c in final.choices] == list(range(N))
    assert [c.message.content for c in final.choices] == expected
    assert {c.message.role for c in final.choices} == {"assistant"}
    assert all(c.finish_reason is not None for c in final.choices)


@pytest.mark.parametrize("order", list(itertools.permutations(range(N))), ids=str)
async def test_async_stream_helper_for_every_start_order(
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    gate: Gate,
    expected: list[str | None],
    order: tuple[int, ...],
) -> None:
    gate.order = list(order)  # child order[k] starts after order[k-1] has sent a chunk
    proxy = await make_proxy(single_upstream_config(gate.url))
    async with (
        openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0) as c,
        c.chat.completions.stream(
            model="m", messages=MESSAGES, n=N, seed=SEED, max_tokens=MAX_TOKENS
        ) as stream,
    ):
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    check(final, expected)


@pytest.mark.parametrize("order", list(itertools.permutations(range(N))), ids=str)
async def test_sync_stream_helper_for_every_start_order(
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    gate: Gate,
    expected: list[str | None],
    order: tuple[int, ...],
) -> None:
    gate.order = list(order)
    proxy = await make_proxy(single_upstream_config(gate.url))

    def consume() -> ChatCompletion:
        with (
            openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0) as c,
            c.chat.completions.stream(
                model="m", messages=MESSAGES, n=N, seed=SEED, max_tokens=MAX_TOKENS
            ) as stream,
        ):
            for _ in stream:
                pass
            return stream.get_final_completion()

    check(await asyncio.to_thread(consume), expected)
