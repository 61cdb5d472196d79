"""Tests of the demo backend's response shapes: literal generations in, vLLM-shaped JSON out."""

from __future__ import annotations

from proxy.devserver.config import DevConfig
from proxy.devserver.model import Generation, Token
from proxy.devserver.reply import Answer
from proxy.devserver.request import parse_job

GEN = Generation((Token(" a", -0.5), Token(" b", -1.0)), "length", key=1)


def test_completion_body_and_usage() -> None:
    job = parse_job({"prompt": "x y", "model": "m"}, False, "r1", DevConfig())
    body = Answer(job, created=5).body([GEN])
    assert body == {
        "id": "cmpl-r1",
        "object": "text_completion",
        "created": 5,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": " a b",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 1},
        },
    }


def test_chat_stream_chunks_open_with_the_role_and_end_with_finish_and_usage() -> None:
    body = {
        "messages": [{"content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reply = Answer(parse_job(body, True, "r", DevConfig()), created=0)
    chunks = [
        *reply.opening_chunks([GEN]),
        *reply.step_chunks([GEN], 0),
        *reply.step_chunks([GEN], 1),
    ]
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]
    assert deltas == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": " a"}, None),
        ({"content": " b"}, None),
        ({}, "length"),
    ]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    usage = reply.usage_chunk([GEN])
    assert (usage["choices"], usage["usage"]["completion_tokens"]) == ([], 2)
    assert usage["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
