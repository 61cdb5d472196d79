"""The official ``openai`` client consuming n=3 answers from n-proxy before the demo backend."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.servers import Backend

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "write a haiku"}]


@pytest.fixture
async def direct(backend: Backend) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=backend.url + "/v1", api_key="sk-test", max_retries=0
    ) as client:
        yield client


async def test_chat_n3_non_streaming(
    openai_client: openai.AsyncOpenAI, direct: openai.AsyncOpenAI
) -> None:
    response = await openai_client.chat.completions.create(
        model="demo", messages=MESSAGES, n=3, seed=100, max_tokens=7,
        extra_headers={"X-Request-Id": "oa1"},
    )  # fmt: skip
    assert response.id == "chatcmpl-oa1"
    assert [c.index for c in response.choices] == [0, 1, 2]
    for i, choice in enumerate(response.choices):
        alone = await direct.chat.completions.create(
            model="demo",
            messages=MESSAGES,
            seed=100 + i,
            max_tokens=7,
        )
        assert choice.message.content == alone.choices[0].message.content
    assert response.usage is not None
    assert response.usage.completion_tokens == 21
    assert response.usage.total_tokens == response.usage.prompt_tokens + 21


async def test_chat_n3_streaming_with_usage(
    openai_client: openai.AsyncOpenAI, direct: openai.AsyncOpenAI
) -> None:
    stream = await openai_client.chat.completions.create(
        model="demo", messages=MESSAGES, n=3, seed=7, max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts = ["", "", ""]
    usage_chunks = []
    ids = set()
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage_chunks.append(chunk)
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert len(ids) == 1
    (last,) = usage_chunks
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 15
    for i in range(3):
        alone = await direct.chat.completions.create(
            model="demo",
            messages=MESSAGES,
            seed=7 + i,
            max_tokens=5,
        )
        assert texts[i] == alone.choices[0].message.content


async def test_completions_n2_with_list_prompts(openai_client: openai.AsyncOpenAI) -> None:
    response = await openai_client.completions.create(
        model="demo", prompt=["alpha beta", "gamma"], n=2, seed=3, max_tokens=4
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text != response.choices[1].text
    assert response.usage is not None
    assert response.usage.completion_tokens == 16


async def test_bad_n_surfaces_as_openai_bad_request(openai_client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await openai_client.chat.completions.create(model="demo", messages=MESSAGES, n=11)
    assert raised.value.status_code == 400
    assert raised.value.param == "n"
