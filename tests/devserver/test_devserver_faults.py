"""Tests of the demo backend's x_demo faults, as a client on loopback sees them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from proxy.devserver.faults import HUGE_WORD
from tests.devserver.test_devserver import CHAT, COMPLETIONS, chat_body, post_json, post_stream
from tests.support.servers import Backend


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def test_status_500_fault_answers_an_error_before_the_stream(
    session: aiohttp.ClientSession, backend: Backend
) -> None:
    base, state = backend.url, backend.state
    body = chat_body(stream=True, x_demo={"fault": "status_500"})
    status, error = await post_json(session, base + CHAT, body, {"X-Request-Id": "f"})
    assert status == 500
    assert error["error"]["type"] == "server_error"
    assert (state.faulted, state.active) == (["f"], {})


async def test_reset_mid_stream_is_a_payload_error_for_the_client(
    session: aiohttp.ClientSession, backend: Backend
) -> None:
    base, state = backend.url, backend.state
    body = chat_body(stream=True, x_demo={"fault": "reset_mid_stream", "after_tokens": 2})
    async with session.post(base + CHAT, json=body, headers={"X-Request-Id": "r"}) as response:
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    assert state.faulted == ["r"]


async def test_fault_with_only_seed_hits_only_that_seed(
    session: aiohttp.ClientSession, backend: Backend
) -> None:
    base = backend.url
    demo = {"only_seed": 7, "fault": "status_429"}
    statuses = [
        (await post_json(session, base + CHAT, chat_body(seed, x_demo=demo)))[0]
        for seed in (6, 7, 8)
    ]
    assert statuses == [200, 429, 200]


async def test_error_event_ends_the_stream_without_done(
    session: aiohttp.ClientSession, backend: Backend
) -> None:
    base = backend.url
    body = {"prompt": "x", "x_demo": {"fault": "error_event", "after_tokens": 1}}
    events, _ = await post_stream(session, base + COMPLETIONS, body)
    assert len(events) == 2
    assert events[1]["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    ("fault", "tail"),
    [
        ("crlf", b"\r\n\r\ndata: [DONE]\r\n\r\n"),
        ("cr", b"\r\rdata: [DONE]\r\r"),
        ("ping", b"\n\n: ping\ndata: [DONE]\n\n"),
    ],
)
async def test_framing_faults_change_the_line_ends_of_the_stream(
    session: aiohttp.ClientSession, backend: Backend, fault: str, tail: bytes
) -> None:
    base = backend.url
    body = {"prompt": "x", "max_tokens": 2, "stream": True, "x_demo": {"fault": fault}}
    async with session.post(base + COMPLETIONS, json=body) as response:
        raw = await response.read()
    assert raw.endswith(tail)
    assert raw.count(b"data: ") == 4


async def test_gzip_and_huge_line_faults(session: aiohttp.ClientSession, backend: Backend) -> None:
    base = backend.url
    async with session.post(
        base + COMPLETIONS, json={"prompt": "x", "x_demo": {"fault": "gzip"}}
    ) as response:
        assert response.headers["Content-Encoding"] == "gzip"
        assert (await response.json())["usage"]["completion_tokens"] == 16
    body = {"prompt": "x", "max_tokens": 3, "x_demo": {"fault": "huge_line"}}
    events, _ = await post_stream(session, base + COMPLETIONS, body)
    assert [e["choices"][0]["text"] == HUGE_WORD for e in events[:3]] == [False, True, False]


async def test_abort_fault_finishes_with_abort(
    session: aiohttp.ClientSession, backend: Backend
) -> None:
    base = backend.url
    demo = {"fault": "abort", "after_tokens": 2}
    _, body = await post_json(session, base + CHAT, chat_body(x_demo=demo))
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["usage"]["completion_tokens"] == 2


async def test_no_headers_fault_is_aborted_when_the_client_gives_up(
    session: aiohttp.ClientSession, backend: Backend
) -> None:
    base, state = backend.url, backend.state
    body = chat_body(x_demo={"fault": "no_headers"})
    request = asyncio.ensure_future(
        session.post(base + CHAT, json=body, headers={"X-Request-Id": "stuck"})
    )
    await state.wait_for(lambda s: "stuck" in s.active)
    request.cancel()
    await state.wait_for(lambda s: "stuck" in s.aborted)


async def test_idle_forever_stream_is_aborted_when_the_client_gives_up(
    session: aiohttp.ClientSession, backend: Backend
) -> None:
    base, state = backend.url, backend.state
    body = chat_body(stream=True, x_demo={"fault": "idle_forever", "after_tokens": 1})
    response = await session.post(base + CHAT, json=body, headers={"X-Request-Id": "idle"})
    lines = [await response.content.readline() for _ in range(4)]
    assert [line.startswith(b"data: {") for line in lines] == [True, False, True, False]
    response.close()
    await state.wait_for(lambda s: "idle" in s.aborted)


# --- the same faults on vLLM's generate route

GENERATE = "/inference/v1/generate"


def generate_body(**fields: object) -> dict[str, object]:
    return {"token_ids": [1, 2], "sampling_params": {"seed": 1, "max_tokens": 3}, **fields}


@pytest.mark.parametrize(
    ("fault", "status"), [("status_400", 400), ("status_429", 429), ("status_500", 500)]
)
async def test_generate_status_faults_answer_before_any_token(
    session: aiohttp.ClientSession, backend: Backend, fault: str, status: int
) -> None:
    body = generate_body(x_demo={"fault": fault})
    got, error = await post_json(session, backend.url + GENERATE, body, {"X-Request-Id": "g"})
    assert got == status
    assert error["error"]["message"] == f"Injected fault {fault}"


async def test_generate_mid_stream_faults(session: aiohttp.ClientSession, backend: Backend) -> None:
    url = backend.url + GENERATE
    demo = {"fault": "error_event", "after_tokens": 2}
    events, _ = await post_stream(session, url, generate_body(x_demo=demo))
    assert [len(e["choices"][0]["token_ids"]) for e in events[:2]] == [1, 1]
    assert events[2]["error"]["type"] == "server_error"
    assert len(events) == 3  # no [DONE] after an error event
    async with session.post(
        url, json=generate_body(stream=True, x_demo={"fault": "reset_mid_stream"})
    ) as response:
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()


async def test_generate_abort_gzip_and_huge_line_faults(
    session: aiohttp.ClientSession, backend: Backend
) -> None:
    url = backend.url + GENERATE
    _, body = await post_json(session, url, generate_body(x_demo={"fault": "abort"}))
    assert (body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) == ("abort", 1)
    async with session.post(url, json=generate_body(x_demo={"fault": "gzip"})) as response:
        assert response.headers["Content-Encoding"] == "gzip"
        assert len((await response.json())["choices"][0]["token_ids"]) == 3
    events, raw = await post_stream(session, url, generate_body(x_demo={"fault": "huge_line"}))
    assert [e["choices"][0]["routed_experts"] == HUGE_WORD for e in events[:3]] == [
        False,
        True,
        False,
    ]
    assert len(raw) > len(HUGE_WORD)
