"""Tests for proxy.core.stitch: children's literal bodies and chunks in, one native-n answer out.

docs/behaviour.md#json, #streaming, #usage, #errors (mid-stream), #best-of and #generate.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from proxy.core.plan import Plan, plan_request
from proxy.core.stitch import (
    StreamError,
    StreamStitcher,
    error_event,
    mean_logprob,
    parent_response_id,
    stitch_json,
)

DONE = b"data: [DONE]\n\n"


def plan(body: dict[str, Any], *, completions: bool = False, parent: str = "abc") -> Plan:
    planned = plan_request(body, parent, 10, endpoint="completions" if completions else "chat")
    assert planned is not None
    return planned


def sse(raw: bytes) -> list[Any]:
    """Decode the stitcher's own output: one ``data:`` line per event, then a blank line."""
    assert raw.endswith(b"\n\n")
    events: list[Any] = []
    for block in raw[:-2].split(b"\n\n"):
        assert block.startswith(b"data: ")
        data = block.removeprefix(b"data: ")
        events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return events


def one_event(raw: bytes | None) -> dict[str, Any]:
    assert raw is not None
    [event] = sse(raw)
    assert isinstance(event, dict)
    return event


def after_opening(raw: bytes | None, count: int) -> dict[str, Any]:
    """The first chunk's own event, after the ``count`` choices it opened with
    (docs/behaviour.md#opening)."""
    assert raw is not None
    *opening, event = sse(raw)
    assert len(opening) == count
    for index, announced in enumerate(opening):
        (choice,) = announced["choices"]
        assert choice["index"] == index
        assert choice.get("delta", {"role": "assistant", "content": ""}) == {
            "role": "assistant",
            "content": "",
        }
        assert (announced["id"], announced["created"]) == (event["id"], event["created"])
    assert isinstance(event, dict)
    return event


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


# --- parent_response_id (docs/behaviour.md#json) ---


@pytest.mark.parametrize(
    ("body", "child_id", "expected"),
    [
        pytest.param({"n": 2}, "chatcmpl-0_abc", "chatcmpl-abc", id="vllm-echo"),
        pytest.param({"n": 2}, "chatcmpl-7f3a", "chatcmpl-7f3a", id="no-echo"),
        pytest.param({"n": 2}, None, None, id="no-id"),
        pytest.param({"n": 2}, 17, 17, id="not-a-string"),
    ],
)
def test_parent_response_id_removes_the_child_marker(
    body: dict[str, Any], child_id: object, expected: object
) -> None:
    p = plan(body)
    assert parent_response_id(child_id, p.children[0], "abc") == expected


def test_parent_response_id_for_a_list_of_prompts() -> None:
    p = plan({"prompt": ["a", "b"], "n": 2}, completions=True)
    assert parent_response_id("cmpl-0_abc-0", p.children[0], "abc") == "cmpl-abc"


# --- stitch_json (docs/behaviour.md#json) ---


def chat_body(i: int, content: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{i}_abc",
        "object": "chat.completion",
        "created": 1700000000 + i,
        "model": f"model-{i}",
        "system_fingerprint": f"fp-{i}",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": usage(10, 2 + i),
        **extra,
    }


def test_stitch_json_gives_native_n_body() -> None:
    bodies = [
        chat_body(
            i,
            f"answer {i}",
            prompt_logprobs=None,
            kv_transfer_params={"child": i},
            x_vendor={"child": i},
        )
        for i in range(3)
    ]
    assert stitch_json(plan({"n": 3}), bodies) == {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "model-0",
        "system_fingerprint": "fp-0",
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": f"answer {i}"},
                "logprobs": None,
                "finish_reason": "stop",
            }
            for i in range(3)
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 9, "total_tokens": 19},
        "prompt_logprobs": None,
        "kv_transfer_params": {"child": 0},
        "x_vendor": {"child": 0},
    }


def test_stitch_json_has_null_metrics_instead_of_child_zeros() -> None:
    # vLLM --enable-per-request-metrics answers "metrics": null for n > 1.
    bodies = [chat_body(i, "x", metrics={"ttft_s": 0.01 * (i + 1)}) for i in range(2)]
    merged = stitch_json(plan({"n": 2}), bodies)
    assert "metrics" in merged
    assert merged["metrics"] is None
    assert [b["metrics"] for b in bodies] == [{"ttft_s": 0.01}, {"ttft_s": 0.02}]


def test_stitch_json_keeps_child_zeros_id_when_backend_did_not_echo_it() -> None:
    bodies = [chat_body(i, "x") for i in range(2)]
    bodies[0]["id"] = "chatcmpl-llamacpp-r4nd0m"
    bodies[1]["id"] = "chatcmpl-llamacpp-other"
    assert stitch_json(plan({"n": 2}), bodies)["id"] == "chatcmpl-llamacpp-r4nd0m"


def test_stitch_json_treats_finish_reason_abort_as_a_normal_choice() -> None:
    bodies = [chat_body(0, "done"), chat_body(1, "cut")]
    bodies[1]["choices"][0]["finish_reason"] = "abort"
    choices = stitch_json(plan({"n": 2}), bodies)["choices"]
    assert [(c["index"], c["finish_reason"]) for c in choices] == [(0, "stop"), (1, "abort")]


def test_stitch_json_without_child_usage_has_no_usage() -> None:
    bodies = [chat_body(i, "x") for i in range(2)]
    for body in bodies:
        del body["usage"]
    assert "usage" not in stitch_json(plan({"n": 2}), bodies)


def test_stitch_json_list_of_prompts_orders_choices_p_times_n_plus_i() -> None:
    p = plan({"prompt": ["a", "b"], "n": 2}, completions=True)
    bodies = [
        {
            "id": f"cmpl-{child.request_id}",
            "object": "text_completion",
            "created": 5,
            "model": "m",
            "choices": [{"index": 0, "text": f"p{child.prompt}-c{child.index}", "logprobs": None}],
            "usage": usage(3 + 4 * child.prompt, 1 + child.index),
        }
        for child in p.children
    ]
    stitched = stitch_json(p, bodies)
    assert stitched["id"] == "cmpl-abc"
    assert stitched["choices"] == [
        {"index": 0, "text": "p0-c0", "logprobs": None},
        {"index": 1, "text": "p0-c1", "logprobs": None},
        {"index": 2, "text": "p1-c2", "logprobs": None},
        {"index": 3, "text": "p1-c3", "logprobs": None},
    ]
    # Each prompt counted once (3 + 7), every completion counted (1 + 2 + 3 + 4).
    assert stitched["usage"] == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}


def test_stitch_json_does_not_mutate_the_children() -> None:
    bodies = [chat_body(i, "x") for i in range(2)]
    snapshot = orjson.loads(orjson.dumps(bodies))
    stitch_json(plan({"n": 2}), bodies)
    assert bodies == snapshot


# --- best_of (docs/behaviour.md#best-of) ---


def completion_body(
    text: str, token_logprobs: list[float | None], prompt: int = 4
) -> dict[str, Any]:
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 9,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": {
                    "tokens": list(text),
                    "token_logprobs": token_logprobs,
                    "top_logprobs": [{t: lp} for t, lp in zip(text, token_logprobs, strict=True)],
                    "text_offset": list(range(len(text))),
                },
                "finish_reason": "length",
            }
        ],
        "usage": usage(prompt, len(text)),
    }


RANKED = [
    completion_body("aa", [-1.0, -1.0]),  # mean -1.0
    completion_body("bb", [-0.1, -0.3]),  # mean -0.2: best
    completion_body("c", [-3.0]),  # mean -3.0
    completion_body("ddd", [-0.5, -0.5, -0.5]),  # mean -0.5: second
]


def test_best_of_keeps_the_top_n_by_mean_logprob_and_strips_unasked_logprobs() -> None:
    p = plan({"prompt": "p", "n": 2, "best_of": 4}, completions=True)
    stitched = stitch_json(p, RANKED)
    assert stitched["choices"] == [
        {"index": 0, "text": "bb", "logprobs": None, "finish_reason": "length"},
        {"index": 1, "text": "ddd", "logprobs": None, "finish_reason": "length"},
    ]
    # Usage counts all four completions (2 + 2 + 1 + 3), the prompt once.
    assert stitched["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}


def test_best_of_keeps_logprobs_when_the_client_asked_for_them() -> None:
    p = plan({"prompt": "p", "n": 1, "best_of": 4, "logprobs": 1}, completions=True)
    [choice] = stitch_json(p, RANKED)["choices"]
    assert choice == {**RANKED[1]["choices"][0], "index": 0}


def test_best_of_ranks_each_prompt_of_a_list_separately() -> None:
    p = plan({"prompt": ["x", "y"], "n": 1, "best_of": 2}, completions=True)
    bodies = [
        completion_body("x1", [-2.0, -2.0]),
        completion_body("x2", [-0.5, -0.5]),
        completion_body("y1", [-0.1, -0.1], prompt=6),
        completion_body("y2", [-0.9, -0.9], prompt=6),
    ]
    choices = stitch_json(p, bodies)["choices"]
    assert [(c["index"], c["text"]) for c in choices] == [(0, "x2"), (1, "y1")]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        pytest.param({"logprobs": {"token_logprobs": [-1.0, -3.0]}}, -2.0, id="completions"),
        pytest.param(
            {"logprobs": {"token_logprobs": [None, -0.5, -1.5]}}, -1.0, id="completions-echo-null"
        ),
        pytest.param(
            {"logprobs": {"content": [{"token": "a", "logprob": -0.2}, {"logprob": -0.4}]}},
            -0.3,
            id="chat",
        ),
        pytest.param({"logprobs": None}, -math.inf, id="null"),
        pytest.param({}, -math.inf, id="absent"),
        pytest.param({"logprobs": {"token_logprobs": []}}, -math.inf, id="empty"),
    ],
)
def test_mean_logprob(choice: dict[str, Any], expected: float) -> None:
    assert mean_logprob(choice) == pytest.approx(expected)


# --- StreamStitcher (docs/behaviour.md#streaming, #usage) ---


def chunk(
    cid: str,
    created: int,
    content: str | None = None,
    finish: str | None = None,
    *,
    model: str = "m",
    **extra: Any,
) -> bytes:
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return orjson.dumps(
        {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
            **extra,
        }
    )


def usage_chunk(cid: str, prompt: int, completion: int) -> bytes:
    return orjson.dumps(
        {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": usage(prompt, completion),
        }
    )


STREAM_WITH_USAGE = {"n": 2, "stream": True, "stream_options": {"include_usage": True}}


def test_stream_rewrites_index_and_gives_every_chunk_the_first_chunks_id_created_model() -> None:
    s = StreamStitcher(plan({"n": 3, "stream": True}))
    first = after_opening(s.chunk(2, chunk("chatcmpl-2_abc", 100, "", model="m-2")), 3)
    assert first == {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 100,
        "model": "m-2",
        "choices": [
            {"index": 2, "delta": {"content": ""}, "logprobs": None, "finish_reason": None}
        ],
    }
    later = one_event(s.chunk(0, chunk("chatcmpl-0_abc", 101, "Hi", model="m-0")))
    assert later == {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 100,
        "model": "m-2",
        "choices": [
            {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}
        ],
    }
    third = one_event(s.chunk(1, chunk("chatcmpl-1_abc", 102, "Yo", "stop")))
    assert (third["id"], third["created"], third["model"]) == ("chatcmpl-abc", 100, "m-2")
    assert [c["index"] for c in third["choices"]] == [1]


def test_stream_shares_first_id_when_backend_does_not_echo_request_id() -> None:
    s = StreamStitcher(plan({"n": 2, "stream": True}))
    a = after_opening(s.chunk(1, chunk("chatcmpl-r1", 7, "a")), 2)
    b = one_event(s.chunk(0, chunk("chatcmpl-r0", 8, "b")))
    assert [a["id"], b["id"]] == ["chatcmpl-r1", "chatcmpl-r1"]
    assert [a["created"], b["created"]] == [7, 7]


def test_stream_list_of_prompts_uses_choice_index_p_times_n_plus_i() -> None:
    p = plan({"prompt": ["a", "b"], "n": 2, "stream": True}, completions=True)
    s = StreamStitcher(p)
    text = b'{"id":"cmpl-%s","object":"text_completion","created":3,"model":"m",' + (
        b'"choices":[{"index":0,"text":"t","logprobs":null,"finish_reason":null}]}'
    )
    indices = [
        one_event(s.chunk(pos, text % p.children[pos].request_id.encode())) for pos in (3, 0, 2, 1)
    ]
    assert [e["choices"][0]["index"] for e in indices] == [3, 0, 2, 1]
    assert {e["id"] for e in indices} == {"cmpl-abc"}


def test_stream_holds_back_usage_only_chunks_and_done_then_sends_one_merged_tail() -> None:
    s = StreamStitcher(plan(STREAM_WITH_USAGE))
    assert s.chunk(0, chunk("chatcmpl-0_abc", 50, "A")) is not None
    assert s.chunk(1, chunk("chatcmpl-1_abc", 51, "B")) is not None
    assert s.chunk(0, chunk("chatcmpl-0_abc", 50, None, "stop")) is not None
    assert s.chunk(0, usage_chunk("chatcmpl-0_abc", 12, 3)) is None
    assert s.chunk(0, b"[DONE]") is None
    assert s.chunk(1, chunk("chatcmpl-1_abc", 51, None, "length")) is not None
    assert s.chunk(1, usage_chunk("chatcmpl-1_abc", 12, 5)) is None
    assert s.chunk(1, b"[DONE]") is None
    tail = s.tail()
    assert tail.endswith(DONE)
    assert tail.count(b"[DONE]") == 1
    assert sse(tail) == [
        {
            "id": "chatcmpl-abc",
            "object": "chat.completion.chunk",
            "created": 50,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20},
        },
        "[DONE]",
    ]


def test_the_merged_usage_after_the_tail_is_the_tail_s_merged_once() -> None:
    s = StreamStitcher(plan(STREAM_WITH_USAGE))
    s.chunk(0, usage_chunk("chatcmpl-0_abc", 12, 3))
    before = s.usage()  # mid-stream (a stream that failed): merged from what came so far
    assert before == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    assert s.usage() is not before
    s.chunk(1, usage_chunk("chatcmpl-1_abc", 12, 5))
    tail = s.tail()
    usage = s.usage()
    assert usage == sse(tail)[0]["usage"]
    assert s.usage() is usage  # the request's record takes the tail's, not a second merge


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"n": 2, "stream": True}, id="no-stream-options"),
        pytest.param(
            {"n": 2, "stream": True, "stream_options": {"include_usage": False}},
            id="include-usage-false",
        ),
    ],
)
def test_stream_tail_is_exactly_one_done_without_include_usage(body: dict[str, Any]) -> None:
    s = StreamStitcher(plan(body))
    s.chunk(0, chunk("chatcmpl-0_abc", 1, "a", "stop", usage=usage(4, 1)))
    s.chunk(1, chunk("chatcmpl-1_abc", 1, "b", "stop", usage=usage(4, 1)))
    s.chunk(0, b"[DONE]")
    s.chunk(1, b"[DONE]")
    assert s.tail() == DONE


def test_stream_tail_with_include_usage_but_no_usage_from_any_child_is_one_done() -> None:
    s = StreamStitcher(plan(STREAM_WITH_USAGE))
    s.chunk(0, chunk("chatcmpl-0_abc", 1, "a", "stop"))
    s.chunk(1, chunk("chatcmpl-1_abc", 1, "b", "stop"))
    assert s.tail() == DONE


def test_stream_nulls_usage_on_a_choice_chunk_and_still_counts_it() -> None:
    # llama.cpp puts the child's usage on its final choice chunk; it must not pass for the total.
    s = StreamStitcher(plan(STREAM_WITH_USAGE))
    a = after_opening(s.chunk(0, chunk("chatcmpl-x", 1, "a", "stop", usage=usage(6, 2))), 2)
    b = one_event(s.chunk(1, chunk("chatcmpl-y", 1, "b", "stop", usage=usage(6, 4))))
    assert [a.get("usage"), b.get("usage")] == [None, None]
    assert [a["choices"][0]["finish_reason"], b["choices"][0]["finish_reason"]] == ["stop", "stop"]
    assert sse(s.tail()) == [
        {
            "id": "chatcmpl-x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12},
        },
        "[DONE]",
    ]


def test_stream_continuous_usage_keeps_each_chunks_own_usage_and_merges_the_final() -> None:
    body = {
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    s = StreamStitcher(plan(body))
    a = after_opening(s.chunk(0, chunk("chatcmpl-0_abc", 1, "a", usage=usage(5, 1))), 2)
    b = one_event(s.chunk(1, chunk("chatcmpl-1_abc", 1, "b", usage=usage(5, 1))))
    c = one_event(s.chunk(1, chunk("chatcmpl-1_abc", 1, "c", "stop", usage=usage(5, 2))))
    assert [a["usage"], b["usage"], c["usage"]] == [usage(5, 1), usage(5, 1), usage(5, 2)]
    assert s.chunk(0, chunk("chatcmpl-0_abc", 1, None, "stop", usage=usage(5, 1))) is not None
    assert s.chunk(0, usage_chunk("chatcmpl-0_abc", 5, 1)) is None
    assert s.chunk(1, usage_chunk("chatcmpl-1_abc", 5, 2)) is None
    [final, done] = sse(s.tail())
    assert final["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert final["choices"] == []
    assert final["id"] == "chatcmpl-abc"
    assert done == "[DONE]"


def test_stream_usage_for_a_list_of_prompts_counts_each_prompt_once() -> None:
    p = plan(
        {"prompt": ["a", "b"], "n": 2, "stream": True, "stream_options": {"include_usage": True}},
        completions=True,
    )
    s = StreamStitcher(p)
    for pos, prompt_tokens in [(0, 3), (1, 3), (2, 8), (3, 8)]:
        assert (
            s.chunk(pos, usage_chunk(f"cmpl-{p.children[pos].request_id}", prompt_tokens, 1))
            is None
        )
    [final, _] = sse(s.tail())
    assert final["usage"] == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}


# A vLLM child under --enable-force-include-usage, asked for no usage: usage rides on every
# chunk, the role chunk included, and a usage chunk ends the stream (should_include_usage).
FORCED_ROLE = (
    b'{"id":"chatcmpl-%d_abc","object":"chat.completion.chunk","created":9,"model":"tiny",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    b'"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null,'
    b'"usage":{"prompt_tokens":6,"total_tokens":6,"completion_tokens":0}}'
)
FORCED_TOKEN = (
    b'{"id":"chatcmpl-%d_abc","object":"chat.completion.chunk","created":9,"model":"tiny",'
    b'"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":"length",'
    b'"stop_reason":null}],"usage":{"prompt_tokens":6,"total_tokens":7,"completion_tokens":1}}'
)
FORCED_USAGE = (
    b'{"id":"chatcmpl-%d_abc","object":"chat.completion.chunk","created":9,"model":"tiny",'
    b'"choices":[],"usage":{"prompt_tokens":6,"total_tokens":7,"completion_tokens":1},'
    b'"system_fingerprint":"fp"}'
)


def test_stream_usage_the_server_sends_unasked_is_streamed_as_the_server_does() -> None:
    s = StreamStitcher(plan({"n": 2, "stream": True}))
    opening = sse(s.chunk(0, FORCED_ROLE % 0) or b"")
    assert [e["usage"] for e in opening] == [usage(6, 0), usage(6, 0)]
    assert s.chunk(1, FORCED_ROLE % 1) is None
    tokens = [one_event(s.chunk(pos, FORCED_TOKEN % pos)) for pos in (1, 0)]
    assert [t["usage"] for t in tokens] == [usage(6, 1), usage(6, 1)]  # each child's own
    assert [s.chunk(pos, FORCED_USAGE % pos) for pos in (0, 1)] == [None, None]
    assert sse(s.tail()) == [
        {
            "id": "chatcmpl-abc",
            "object": "chat.completion.chunk",
            "created": 9,
            "model": "tiny",
            "choices": [],
            "usage": usage(6, 2),
            "system_fingerprint": "fp",
        },
        "[DONE]",
    ]


def test_stream_usage_chunk_sent_unasked_gives_one_merged_usage_chunk() -> None:
    s = StreamStitcher(plan({"n": 2, "stream": True}))
    s.chunk(0, chunk("chatcmpl-0_abc", 1, "a", "stop"))
    s.chunk(1, chunk("chatcmpl-1_abc", 1, "b", "stop"))
    assert s.chunk(0, usage_chunk("chatcmpl-0_abc", 4, 1)) is None
    assert s.chunk(1, usage_chunk("chatcmpl-1_abc", 4, 3)) is None
    [final, done] = sse(s.tail())
    assert (final["choices"], final["usage"], done) == ([], usage(4, 4), "[DONE]")


def test_stream_tail_drops_one_childs_per_request_metrics() -> None:
    # vLLM --enable-per-request-metrics: n > 1 has no metrics (they describe one sequence).
    s = StreamStitcher(plan(STREAM_WITH_USAGE))
    s.chunk(0, chunk("chatcmpl-0_abc", 1, "a", "stop"))
    s.chunk(1, chunk("chatcmpl-1_abc", 1, "b", "stop"))
    timed = {"ttft_s": 0.01, "decode_s": 0.2}
    for pos in (0, 1):
        data = orjson.loads(usage_chunk(f"chatcmpl-{pos}_abc", 4, 1))
        assert s.chunk(pos, orjson.dumps({**data, "metrics": timed})) is None
    [final, _] = sse(s.tail())
    assert "metrics" not in final
    assert final["usage"] == usage(4, 2)


@pytest.mark.parametrize(
    "events",
    [
        pytest.param([], id="nothing-yet"),
        pytest.param([chunk("c", 1, "partial")], id="mid-choice"),
        pytest.param([chunk("c", 1, "a"), usage_chunk("c", 1, 1)], id="usage-before-finish"),
    ],
)
def test_stream_child_is_not_finished_before_finish_reason_or_done(events: list[bytes]) -> None:
    s = StreamStitcher(plan({"n": 2, "stream": True}))
    for data in events:
        s.chunk(1, data)
    assert s.finished(1) is False


@pytest.mark.parametrize(
    "events",
    [
        pytest.param([chunk("c", 1, "a", "stop")], id="finish-reason-stop"),
        pytest.param([chunk("c", 1, "a", "abort")], id="finish-reason-abort"),
        pytest.param([chunk("c", 1, "a"), b"[DONE]"], id="done"),
        pytest.param([b"[DONE]"], id="done-alone"),
    ],
)
def test_stream_child_is_finished_after_finish_reason_or_done(events: list[bytes]) -> None:
    s = StreamStitcher(plan({"n": 2, "stream": True}))
    for data in events:
        s.chunk(1, data)
    assert s.finished(1) is True
    assert s.finished(0) is False


@pytest.mark.parametrize(
    ("data", "event"),
    [
        pytest.param(
            b'{"error": {"message": "boom", "type": "server_error", "param": null, "code": 500}}',
            "message",
            id="error-payload",
        ),
        pytest.param(b'{"error": "overloaded"}', "message", id="error-string"),
        pytest.param(b'{"message": "boom"}', "error", id="error-event"),
        pytest.param(b"not json", "message", id="non-json"),
        pytest.param(b'{"id": "x", "choi', "message", id="truncated-json"),
        pytest.param(b"[1, 2]", "message", id="json-array"),
    ],
)
def test_stream_error_raises_stream_error_naming_the_choice(data: bytes, event: str) -> None:
    p = plan({"prompt": ["a", "b"], "n": 2, "stream": True}, completions=True)
    s = StreamStitcher(p)
    with pytest.raises(StreamError) as info:
        s.chunk(3, data, event)
    assert info.value.choice == 3


def test_error_event_is_one_server_error_event_then_done() -> None:
    raw = error_event(StreamError(2, "upstream closed the connection"))
    assert raw.endswith(b"\n\n" + DONE)
    assert raw.count(b"data: ") == 2
    [event, done] = sse(raw)
    assert done == "[DONE]"
    assert set(event) == {"error"}
    assert event["error"]["type"] == "server_error"
    assert set(event["error"]) >= {"message", "type", "param", "code"}
    assert "2" in event["error"]["message"]
    assert "upstream closed the connection" in event["error"]["message"]


# --- the opening: every choice announced in index order (docs/behaviour.md#opening) ---


def role_chunk(cid: str, content: str | None = "", **extra: Any) -> bytes:
    """A child's own first chunk: vLLM sends content "", llama.cpp content null."""
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": content},
        "logprobs": None,
        "finish_reason": None,
    }
    return orjson.dumps(
        {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": 9,
            "model": "m",
            "choices": [choice],
            **extra,
        }
    )


@pytest.mark.parametrize("first", [0, 1, 2])
def test_stream_opens_with_one_role_chunk_per_choice_in_index_order(first: int) -> None:
    s = StreamStitcher(plan({"n": 3, "stream": True}))
    raw = s.chunk(first, role_chunk(f"chatcmpl-{first}_abc", system_fingerprint="fp"))
    assert raw is not None
    assert sse(raw) == [
        {
            "id": "chatcmpl-abc",
            "object": "chat.completion.chunk",
            "created": 9,
            "model": "m",
            "system_fingerprint": "fp",
            "choices": [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        for i in range(3)
    ]
    assert s.chunks == 3


@pytest.mark.parametrize("content", ["", None])
def test_stream_drops_each_later_childs_own_role_announcement(content: str | None) -> None:
    s = StreamStitcher(plan({"n": 3, "stream": True}))
    assert s.chunk(1, role_chunk("chatcmpl-1_abc", content)) is not None
    assert s.chunk(0, role_chunk("chatcmpl-0_abc", content)) is None
    assert s.chunk(2, role_chunk("chatcmpl-2_abc", content)) is None
    later = one_event(s.chunk(2, chunk("chatcmpl-2_abc", 9, "x")))
    assert later["choices"][0]["delta"] == {"content": "x"}


def test_stream_role_announcement_with_content_keeps_the_content_without_the_role() -> None:
    s = StreamStitcher(plan({"n": 2, "stream": True}))
    first = after_opening(s.chunk(1, role_chunk("chatcmpl-1_abc", "Hel")), 2)
    assert first["choices"] == [
        {"index": 1, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}
    ]
    second = one_event(s.chunk(0, role_chunk("chatcmpl-0_abc", "Yo")))
    assert second["choices"][0]["delta"] == {"content": "Yo"}


def test_stream_role_chunk_carrying_vendor_fields_is_kept_without_its_role() -> None:
    s = StreamStitcher(plan({"n": 2, "stream": True}))
    s.chunk(0, role_chunk("chatcmpl-0_abc"))
    kept = one_event(s.chunk(1, role_chunk("chatcmpl-1_abc", x_vendor={"child": 1})))
    assert kept["x_vendor"] == {"child": 1}
    assert kept["choices"][0]["delta"] == {"content": ""}


# vLLM's own role chunk, as its server sends it (return_token_ids / return_prompt_text unset).
VLLM_ROLE_CHUNK = (
    b'{"id":"chatcmpl-%d_abc","object":"chat.completion.chunk","created":9,"model":"tiny",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    b'"finish_reason":null}],"prompt_token_ids":%s,"prompt_text":null}'
)


def vllm_opening(prompt_token_ids: list[int] | None, n: int) -> list[dict[str, Any]]:
    """vLLM's native-n opening: one role chunk per choice, each with the prompt fields."""
    return [
        {
            "id": "chatcmpl-abc",
            "object": "chat.completion.chunk",
            "created": 9,
            "model": "tiny",
            "choices": [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_token_ids": prompt_token_ids,
            "prompt_text": None,
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("prompt_token_ids", [None, [1, 5, 7]], ids=["null", "asked-for"])
def test_stream_vllm_role_chunks_with_prompt_fields_give_exactly_vllms_opening(
    prompt_token_ids: list[int] | None,
) -> None:
    s = StreamStitcher(plan({"n": 2, "stream": True}))
    ids = orjson.dumps(prompt_token_ids)
    out = [s.chunk(1, VLLM_ROLE_CHUNK % (1, ids)), s.chunk(0, VLLM_ROLE_CHUNK % (0, ids))]
    assert out[1] is None  # child 0's own announcement adds nothing to the opening
    assert sse(out[0] or b"") == vllm_opening(prompt_token_ids, 2)
    assert s.chunks == 2


def test_stream_completions_have_no_opening_only_the_childrens_chunks() -> None:
    """Neither vLLM frontend opens a completions stream with empty choices
    (docs/behaviour.md#opening); with continuous usage each chunk keeps its own prompt's."""
    p = plan(
        {"prompt": ["a", "b c d"], "n": 2, "stream": True,
         "stream_options": {"continuous_usage_stats": True}},
        completions=True,
    )  # fmt: skip
    s = StreamStitcher(p)
    text = b'{"id":"cmpl-1","object":"text_completion","created":3,"model":"m",' + (
        b'"choices":[{"index":0,"text":"t","logprobs":null,"finish_reason":null}],'
        b'"usage":{"prompt_tokens":%d,"completion_tokens":1,"total_tokens":%d}}'
    )
    own = one_event(s.chunk(2, text % (4, 5)))
    assert own["choices"][0] == {"index": 2, "text": "t", "logprobs": None, "finish_reason": None}
    assert own["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    assert one_event(s.chunk(0, text % (2, 3)))["usage"]["prompt_tokens"] == 2
    assert s.chunks == 2


def test_stream_usage_only_chunk_first_does_not_open_the_stream() -> None:
    s = StreamStitcher(plan(STREAM_WITH_USAGE))
    assert s.chunk(0, usage_chunk("chatcmpl-0_abc", 3, 1)) is None
    after_opening(s.chunk(1, chunk("chatcmpl-1_abc", 5, "b")), 2)


# --- generate: vLLM's token-in/token-out endpoint (docs/behaviour.md#generate) ---


def generate_plan(n: int = 2, **fields: Any) -> Plan:
    body = {"token_ids": [1, 2], "sampling_params": {"n": n, "seed": 1}, **fields}
    planned = plan_request(body, "abc", 10, endpoint="generate")
    assert planned is not None
    return planned


def generate_choice(tokens: list[int], finish: str | None = "length") -> dict[str, Any]:
    return {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": tokens,
            "routed_experts": None, "logprobs": None}  # fmt: skip


def generate_body(i: int, tokens: list[int], **extra: Any) -> dict[str, Any]:
    """Child ``i``'s answer as vLLM's Python frontend sends it for n = 1."""
    return {
        "request_id": f"generate-tokens-{i}_abc",
        "model": f"model-{i}",
        "created": 1700000000 + i,
        "usage": {**usage(2, len(tokens)), "prompt_tokens_details": {"cached_tokens": i}},
        "prompt_logprobs": None,
        "kv_transfer_params": None,
        "metrics": None,
        "output_mode": "tokens",
        "choices": [generate_choice(tokens)],
        **extra,
    }


def test_stitch_json_gives_generate_the_python_frontends_native_n_body() -> None:
    bodies = [generate_body(0, [5, 6, 7]), generate_body(1, [8, 9])]
    stitched = stitch_json(generate_plan(), bodies)
    assert stitched == {
        "request_id": "generate-tokens-abc",
        "model": "model-0",
        "created": 1700000000,
        "usage": {
            "prompt_tokens": 2,
            "completion_tokens": 5,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
        "metrics": None,
        "output_mode": "tokens",
        "choices": [
            {**generate_choice([5, 6, 7]), "index": 0},
            {**generate_choice([8, 9]), "index": 1},
        ],
    }
    assert list(stitched) == list(bodies[0])  # child 0's fields, in its order: no id added


def test_stitch_json_of_rust_frontend_generate_answers_adds_nothing_they_lack() -> None:
    """vLLM's Rust frontend sends no usage, model or created: none appears."""
    bodies = [
        {"request_id": f"{i}_abc", "choices": [generate_choice([i])], "prompt_logprobs": None}
        for i in range(3)
    ]
    stitched = stitch_json(generate_plan(3), bodies)
    assert stitched == {
        "request_id": "abc",
        "choices": [{**generate_choice([i]), "index": i} for i in range(3)],
        "prompt_logprobs": None,
    }


def generate_chunk(i: int, tokens: list[int], finish: str | None = None, **extra: Any) -> bytes:
    choice = {**generate_choice(tokens, finish), "logprobs": None}
    return orjson.dumps({"request_id": f"generate-tokens-{i}_abc", "usage": None,
                         "output_mode": "tokens", "choices": [choice], **extra})  # fmt: skip


def generate_usage_chunk(i: int, completion: int) -> bytes:
    return orjson.dumps({"request_id": f"generate-tokens-{i}_abc", "usage": usage(2, completion),
                         "output_mode": "tokens", "choices": []})  # fmt: skip


def test_generate_stream_interleaves_chunks_with_index_and_request_id_rewritten() -> None:
    s = StreamStitcher(generate_plan(3, stream=True))
    sent = [
        s.chunk(2, generate_chunk(2, [20])),  # no opening: vLLM's native n sends none
        s.chunk(0, generate_chunk(0, [10])),
        s.chunk(2, generate_chunk(2, [21], "length")),
        s.chunk(1, generate_chunk(1, [30], "stop")),
        s.chunk(0, generate_chunk(0, [11], "length")),
    ]
    events = [one_event(raw) for raw in sent]
    assert [e["choices"][0]["index"] for e in events] == [2, 0, 2, 1, 0]
    assert [e["choices"][0]["token_ids"] for e in events] == [[20], [10], [21], [30], [11]]
    for event in events:
        assert event["request_id"] == "generate-tokens-abc"
        assert list(event) == ["request_id", "usage", "output_mode", "choices"]
    assert all(s.finished(pos) for pos in range(3))
    assert s.tail() == DONE  # usage was not asked for


def test_generate_stream_holds_usage_back_and_ends_with_vllms_merged_usage_chunk() -> None:
    s = StreamStitcher(generate_plan(stream=True, stream_options={"include_usage": True}))
    for pos, tokens in ((0, [5, 6]), (1, [7])):
        for token in tokens[:-1]:
            assert s.chunk(pos, generate_chunk(pos, [token])) is not None
        assert s.chunk(pos, generate_chunk(pos, tokens[-1:], "length")) is not None
        assert s.chunk(pos, generate_usage_chunk(pos, len(tokens))) is None
        assert s.chunk(pos, b"[DONE]") is None
    assert sse(s.tail()) == [
        {
            "request_id": "generate-tokens-abc",
            "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
            "output_mode": "tokens",
            "choices": [],
        },
        "[DONE]",
    ]


def test_generate_stream_keeps_each_chunks_continuous_usage() -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    s = StreamStitcher(generate_plan(stream=True, stream_options=options))
    first = one_event(s.chunk(1, generate_chunk(1, [4], usage=usage(2, 1))))
    assert first["usage"] == usage(2, 1)
    s.chunk(1, generate_chunk(1, [5], "length", usage=usage(2, 2)))
    s.chunk(0, generate_chunk(0, [6], "length", usage=usage(2, 1)))
    assert sse(s.tail())[0]["usage"] == usage(2, 3)


def test_generate_stream_error_event_names_the_choice() -> None:
    s = StreamStitcher(generate_plan(stream=True))
    s.chunk(0, generate_chunk(0, [1]))
    with pytest.raises(StreamError) as info:
        s.chunk(1, orjson.dumps({"error": {"message": "boom", "type": "server_error"}}))
    assert info.value.choice == 1


def test_generate_stream_sends_the_prompts_token_ids_on_its_first_chunk_only() -> None:
    """As vLLM's native n does with return_token_ids: each child sends them on its first."""
    s = StreamStitcher(generate_plan(stream=True, return_token_ids=True))
    prompt: dict[str, Any] = {"prompt_token_ids": [1, 2], "mm_placeholders": None}
    first = one_event(s.chunk(1, generate_chunk(1, [4], **prompt)))
    later = one_event(s.chunk(0, generate_chunk(0, [5], **prompt)))
    assert (first["prompt_token_ids"], first["mm_placeholders"]) == ([1, 2], None)
    assert "prompt_token_ids" not in later
    assert "mm_placeholders" not in later
    assert later["choices"][0]["token_ids"] == [5]
