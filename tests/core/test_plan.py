"""Tests for proxy.core.plan: literal request bodies in, literal children out
(docs/behaviour.md#validation, #children, #best-of, #generate)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.errors import InvalidRequest
from proxy.core.plan import Endpoint, Plan, endpoint_of, parse_body, plan_request

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def chat(body: dict[str, Any], parent: str = "abc", max_n: int = 10) -> Plan | None:
    return plan_request(body, parent, max_n, endpoint="chat")


def completions(body: dict[str, Any], parent: str = "abc", max_n: int = 10) -> Plan | None:
    return plan_request(body, parent, max_n, endpoint="completions")


def planned(plan: Plan | None) -> Plan:
    assert plan is not None, "expected a fan-out, got a pass-through"
    return plan


def child_bodies(plan: Plan | None) -> list[dict[str, Any]]:
    """Each child's decoded body, with ``n`` checked to be gone (or 1) and then dropped."""
    bodies = []
    for child in planned(plan).children:
        body = orjson.loads(child.body)
        assert isinstance(body, dict)
        assert body.pop("n", 1) == 1
        bodies.append(body)
    return bodies


def rejected(body: dict[str, Any], *, is_completions: bool = False, max_n: int = 10) -> str | None:
    """The ``param`` of the 400 that planning ``body`` raises."""
    with pytest.raises(InvalidRequest) as info:
        plan_request(body, "abc", max_n, endpoint="completions" if is_completions else "chat")
    assert info.value.status == 400
    assert orjson.loads(info.value.body())["error"]["type"] == "invalid_request_error"
    return info.value.param


# --- parse_body (docs/behaviour.md#validation) ---


def test_parse_body_returns_the_json_object() -> None:
    assert parse_body(b'{"n": 2, "model": "m", "x": [1, null]}') == {
        "n": 2,
        "model": "m",
        "x": [1, None],
    }


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"{", id="truncated"),
        pytest.param(b"{'n': 2}", id="single-quotes"),
        pytest.param(b"n=2", id="form-encoded"),
        pytest.param(b"\xff\xfe", id="not-utf8"),
        pytest.param(b"[1, 2]", id="array"),
        pytest.param(b'"text"', id="string"),
        pytest.param(b"3", id="number"),
        pytest.param(b"null", id="null"),
        pytest.param(b"true", id="boolean"),
    ],
)
def test_parse_body_rejects_invalid_json_and_non_objects_with_400(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_body(raw)
    assert info.value.status == 400
    error = orjson.loads(info.value.body())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] is None


BIG = b"123456789012345678901234567890"


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e999"])
@pytest.mark.parametrize("beside", [b"1", BIG], ids=["small-int", "big-int"])
def test_parse_body_rejects_non_finite_numbers_whatever_else_the_body_holds(
    value: bytes, beside: bytes
) -> None:
    with pytest.raises(InvalidRequest):
        parse_body(b'{"other": %s, "temperature": %s}' % (beside, value))


@pytest.mark.parametrize("beside", [b"1", BIG], ids=["small-int", "big-int"])
@pytest.mark.parametrize(
    "raw",
    [b'\xef\xbb\xbf{"a": %s}', b'{"a": %s, "s": "\\ud800"}', b'{"a": %s, "s": "\xff"}'],
    ids=["bom", "lone-surrogate", "invalid-utf8"],
)
def test_parse_body_one_policy_for_bom_surrogates_and_utf8(raw: bytes, beside: bytes) -> None:
    with pytest.raises(InvalidRequest):
        parse_body(raw % beside)


def test_parse_body_keeps_integers_past_64_bits_exact() -> None:
    body = parse_body(b'{"a": %s, "b": -%s, "c": [1.5, 18446744073709551616]}' % (BIG, BIG))
    assert body == {"a": int(BIG), "b": -int(BIG), "c": [1.5, 2**64]}


# --- max_children (docs/behaviour.md#validation) ---


@pytest.mark.parametrize(
    ("body", "completions", "param"),
    [
        ({"prompt": ["p"] * 1025, "n": 2}, True, "prompt"),
        ({"prompt": ["p"] * 410, "best_of": 5}, True, "prompt"),
        ({"prompt": ["p"] * 410, "n": 2, "best_of": 5}, True, "prompt"),
        ({"messages": [], "n": 5}, False, "n"),
    ],
)
def test_more_children_than_max_children_is_400(
    body: dict[str, Any], completions: bool, param: str
) -> None:
    limit = 4 if param == "n" else 2048
    with pytest.raises(InvalidRequest) as info:
        plan_request(
            body, "abc", 10, endpoint="completions" if completions else "chat", max_children=limit
        )
    assert info.value.param == param


def test_exactly_max_children_is_planned() -> None:
    body = {"prompt": ["p"] * 1024, "n": 2}
    plan = plan_request(body, "abc", 10, endpoint="completions", max_children=2048)
    assert plan is not None
    assert len(plan.children) == 2048


# --- pass-through and n validation (docs/behaviour.md#fan-out, #validation) ---


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"model": "m", "messages": []}, id="n-missing"),
        pytest.param({"model": "m", "n": None}, id="n-null"),
        pytest.param({"model": "m", "n": 1}, id="n-one"),
        pytest.param({"model": "m", "n": 1, "seed": INT64_MAX}, id="n-one-seed-at-bound"),
    ],
)
@pytest.mark.parametrize("is_completions", [False, True])
def test_n_missing_null_or_one_passes_through(body: dict[str, Any], is_completions: bool) -> None:
    assert (
        plan_request(body, "abc", 10, endpoint="completions" if is_completions else "chat") is None
    )


@pytest.mark.parametrize(
    ("n", "max_n"),
    [
        pytest.param(True, 10, id="json-true"),
        pytest.param(False, 10, id="json-false"),
        pytest.param(2.5, 10, id="float"),
        pytest.param("3", 10, id="string"),
        pytest.param([2], 10, id="list"),
        pytest.param(0, 10, id="zero"),
        pytest.param(-2, 10, id="negative"),
        pytest.param(11, 10, id="default-max-plus-one"),
        pytest.param(129, 128, id="openai-bound-plus-one"),
        pytest.param(5, 4, id="configured-max-plus-one"),
    ],
)
@pytest.mark.parametrize("is_completions", [False, True])
def test_bad_n_is_rejected_with_param_n(n: object, max_n: int, is_completions: bool) -> None:
    body = {"model": "m", "prompt": "p", "n": n}
    assert rejected(body, is_completions=is_completions, max_n=max_n) == "n"


@pytest.mark.parametrize(("n", "max_n"), [(10, 10), (128, 128), (2, 2)])
def test_n_equal_to_max_n_is_accepted(n: int, max_n: int) -> None:
    assert len(planned(chat({"n": n}, max_n=max_n)).children) == n


# --- seed (docs/behaviour.md#validation, #children) ---


@pytest.mark.parametrize(
    ("seed", "n"),
    [
        pytest.param(INT64_MAX, 2, id="max-plus-one"),
        pytest.param(INT64_MAX - 2, 4, id="last-child-overflows"),
        pytest.param(INT64_MIN - 1, 2, id="below-min"),
        pytest.param(2**64, 2, id="far-above"),
    ],
)
def test_seed_out_of_int64_range_is_rejected_with_param_seed(seed: int, n: int) -> None:
    assert rejected({"n": n, "seed": seed}) == "seed"


@pytest.mark.parametrize(
    ("seed", "n", "last"),
    [
        pytest.param(INT64_MAX - 1, 2, INT64_MAX, id="last-child-at-max"),
        pytest.param(INT64_MAX - 3, 4, INT64_MAX, id="four-children-at-max"),
        pytest.param(INT64_MIN, 2, INT64_MIN + 1, id="at-min"),
    ],
)
def test_seed_at_int64_bounds_is_accepted(seed: int, n: int, last: int) -> None:
    assert child_bodies(chat({"n": n, "seed": seed}))[-1]["seed"] == last


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"n": 2, "seed": -9223372036854775809}', id="below-min"),
        pytest.param(b'{"n": 2, "seed": 9223372036854775808}', id="max-plus-one"),
        pytest.param(b'{"n": 2, "seed": 18446744073709551616}', id="above-uint64"),
    ],
)
def test_out_of_range_json_seed_from_the_wire_is_rejected_with_param_seed(raw: bytes) -> None:
    # The whole path a client's bytes take: a JSON integer is an integer, however big.
    with pytest.raises(InvalidRequest) as info:
        plan_request(parse_body(raw), "abc", 10, endpoint="chat")
    assert info.value.status == 400
    assert info.value.param == "seed"


def test_each_child_gets_seed_plus_its_index() -> None:
    bodies = child_bodies(chat({"model": "m", "n": 4, "seed": 42}))
    assert [b["seed"] for b in bodies] == [42, 43, 44, 45]


def test_negative_seed_other_than_minus_one_is_incremented() -> None:
    bodies = child_bodies(chat({"n": 3, "seed": -5}))
    assert [b["seed"] for b in bodies] == [-5, -4, -3]


def test_no_seed_stays_no_seed() -> None:
    bodies = child_bodies(chat({"model": "m", "n": 3}))
    assert all("seed" not in b for b in bodies)


def test_null_seed_stays_null() -> None:
    assert [b["seed"] for b in child_bodies(chat({"n": 2, "seed": None}))] == [None, None]


def test_random_seed_minus_one_is_sent_unchanged_to_every_child() -> None:
    assert [b["seed"] for b in child_bodies(chat({"n": 3, "seed": -1}))] == [-1, -1, -1]


# --- children (docs/behaviour.md#children) ---


def test_chat_children_are_the_body_without_n_and_with_their_own_seed() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "seed": 7,
        "temperature": 0.7,
    }
    plan = planned(chat(body))
    assert [orjson.loads(c.body) for c in plan.children] == [
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "seed": 7,
            "temperature": 0.7,
        },
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "seed": 8,
            "temperature": 0.7,
        },
    ]
    assert [(c.index, c.prompt) for c in plan.children] == [(0, 0), (1, 0)]
    assert plan.parent_id == "abc"
    assert plan.n == 2
    assert plan.best_of is None


def test_planning_does_not_mutate_the_client_body() -> None:
    body = {"n": 2, "seed": 1, "request_id": "r", "kv_transfer_params": [{"a": 1}, {"a": 2}]}
    snapshot = orjson.loads(orjson.dumps(body))
    chat(body)
    assert body == snapshot


def test_child_request_ids_are_index_underscore_parent() -> None:
    plan = planned(chat({"n": 3}, parent="req-9"))
    assert [c.request_id for c in plan.children] == ["0_req-9", "1_req-9", "2_req-9"]


def test_body_request_id_becomes_index_underscore_request_id() -> None:
    bodies = child_bodies(chat({"n": 2, "request_id": "rid"}))
    assert [b["request_id"] for b in bodies] == ["0_rid", "1_rid"]


def test_kv_transfer_params_list_of_length_n_is_split_across_children() -> None:
    kv = [{"remote_block_ids": [1]}, {"remote_block_ids": [2]}, {"remote_block_ids": [3]}]
    bodies = child_bodies(chat({"n": 3, "kv_transfer_params": kv}))
    assert [b["kv_transfer_params"] for b in bodies] == kv


@pytest.mark.parametrize(
    "kv",
    [
        pytest.param([{"a": 1}, {"a": 2}], id="list-shorter-than-n"),
        pytest.param([{"a": 1}, {"a": 2}, {"a": 3}, {"a": 4}], id="list-longer-than-n"),
        pytest.param({"do_remote_prefill": True}, id="mapping"),
        pytest.param(None, id="null"),
    ],
)
def test_kv_transfer_params_of_other_shapes_go_unchanged_to_every_child(kv: object) -> None:
    bodies = child_bodies(chat({"n": 3, "kv_transfer_params": kv}))
    assert [b["kv_transfer_params"] for b in bodies] == [kv, kv, kv]


def test_fields_the_proxy_does_not_own_go_unchanged_to_every_child() -> None:
    untouched = {
        "model": "m",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "auto",
        "stop": ["\n\n", "END"],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}},
        "logprobs": True,
        "top_logprobs": 3,
        "max_tokens": 16,
        "temperature": 1.3,
        "chat_template_kwargs": {"enable_thinking": False},
        "x_vendor": {"nested": [1, "two", None]},
    }
    bodies = child_bodies(chat({**untouched, "n": 2}))
    assert bodies == [untouched, untouched]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param({"n": 2}, (False, False, False), id="not-streaming"),
        pytest.param({"n": 2, "stream": False}, (False, False, False), id="stream-false"),
        pytest.param({"n": 2, "stream": True}, (True, False, False), id="stream"),
        pytest.param(
            {"n": 2, "stream": True, "stream_options": {"include_usage": True}},
            (True, True, False),
            id="include-usage",
        ),
        pytest.param(
            {
                "n": 2,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            (True, True, True),
            id="continuous-usage",
        ),
        pytest.param(
            {"n": 2, "stream": True, "stream_options": {"include_usage": False}},
            (True, False, False),
            id="include-usage-false",
        ),
        pytest.param(
            {"n": 2, "stream": False, "stream_options": {"include_usage": True}},
            (False, False, False),
            id="usage-options-without-stream",
        ),
        pytest.param(
            {"n": 2, "stream": True, "stream_options": None},
            (True, False, False),
            id="null-stream-options",
        ),
    ],
)
def test_stream_and_usage_flags(body: dict[str, Any], expected: tuple[bool, bool, bool]) -> None:
    plan = planned(chat(body))
    assert (plan.stream, plan.include_usage, plan.continuous_usage) == expected


def test_stream_options_go_unchanged_to_every_child() -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    bodies = child_bodies(chat({"n": 2, "stream": True, "stream_options": options}))
    assert [(b["stream"], b["stream_options"]) for b in bodies] == [(True, options)] * 2


# --- completions with a list of prompts (docs/behaviour.md#children) ---


@pytest.mark.parametrize(
    "prompts",
    [
        pytest.param(["a", "b"], id="strings"),
        pytest.param([[1, 2, 3], [4, 5]], id="token-id-lists"),
    ],
)
def test_list_of_prompts_gets_one_child_per_prompt_and_choice(prompts: list[Any]) -> None:
    plan = planned(completions({"model": "m", "prompt": prompts, "n": 3, "seed": 10}))
    assert [(c.index, c.prompt, c.request_id) for c in plan.children] == [
        (0, 0, "0_abc-0"),
        (1, 0, "1_abc-0"),
        (2, 0, "2_abc-0"),
        (3, 1, "0_abc-1"),
        (4, 1, "1_abc-1"),
        (5, 1, "2_abc-1"),
    ]
    assert plan.n == 3
    assert plan.prompts == 2
    assert child_bodies(plan) == [
        {"model": "m", "prompt": prompts[0], "seed": 10},
        {"model": "m", "prompt": prompts[0], "seed": 11},
        {"model": "m", "prompt": prompts[0], "seed": 12},
        {"model": "m", "prompt": prompts[1], "seed": 10},
        {"model": "m", "prompt": prompts[1], "seed": 11},
        {"model": "m", "prompt": prompts[1], "seed": 12},
    ]


def test_flat_list_of_token_ids_is_one_prompt() -> None:
    plan = planned(completions({"prompt": [1, 2, 3], "n": 2}))
    assert [(c.index, c.prompt, c.request_id) for c in plan.children] == [
        (0, 0, "0_abc"),
        (1, 0, "1_abc"),
    ]
    assert [b["prompt"] for b in child_bodies(plan)] == [[1, 2, 3], [1, 2, 3]]


def test_single_string_prompt_is_one_prompt() -> None:
    plan = planned(completions({"prompt": "once", "n": 2}))
    assert [c.request_id for c in plan.children] == ["0_abc", "1_abc"]
    assert [b["prompt"] for b in child_bodies(plan)] == ["once", "once"]


def test_chat_bodies_are_never_split_even_with_a_list_prompt_field() -> None:
    plan = planned(chat({"messages": [], "prompt": ["a", "b"], "n": 2}))
    assert [c.request_id for c in plan.children] == ["0_abc", "1_abc"]
    assert [b["prompt"] for b in child_bodies(plan)] == [["a", "b"], ["a", "b"]]


def test_list_prompts_split_request_id_and_kv_transfer_params_per_choice() -> None:
    body = {"prompt": ["a", "b"], "n": 2, "request_id": "r", "kv_transfer_params": [1, 2]}
    bodies = child_bodies(completions(body))
    assert [(b["request_id"], b["kv_transfer_params"]) for b in bodies] == [
        ("0_r-0", 1),
        ("1_r-0", 2),
        ("0_r-1", 1),
        ("1_r-1", 2),
    ]


# --- best_of (docs/behaviour.md#best-of) ---


def test_best_of_above_n_sends_best_of_children_asking_for_logprobs() -> None:
    plan = planned(completions({"model": "m", "prompt": "p", "n": 2, "best_of": 4, "seed": 3}))
    assert plan.n == 2
    assert plan.best_of == 4
    assert plan.keep_logprobs is False
    assert [(c.index, c.request_id) for c in plan.children] == [
        (0, "0_abc"),
        (1, "1_abc"),
        (2, "2_abc"),
        (3, "3_abc"),
    ]
    assert child_bodies(plan) == [
        {"model": "m", "prompt": "p", "seed": s, "logprobs": 1} for s in (3, 4, 5, 6)
    ]


@pytest.mark.parametrize(
    ("logprobs", "sent", "keep"),
    [
        pytest.param(None, 1, False, id="null"),
        pytest.param(0, 1, True, id="zero-raised-to-one"),
        pytest.param(1, 1, True, id="one"),
        pytest.param(5, 5, True, id="five-kept"),
    ],
)
def test_best_of_children_ask_for_at_least_one_logprob(
    logprobs: int | None, sent: int, keep: bool
) -> None:
    plan = planned(completions({"prompt": "p", "n": 1, "best_of": 3, "logprobs": logprobs}))
    assert [b["logprobs"] for b in child_bodies(plan)] == [sent, sent, sent]
    assert all("best_of" not in b for b in child_bodies(plan))
    assert plan.keep_logprobs is keep


def test_best_of_with_n_missing_ranks_for_one_choice() -> None:
    plan = planned(completions({"prompt": "p", "best_of": 3}))
    assert (plan.n, plan.best_of, len(plan.children)) == (1, 3, 3)


def test_best_of_with_a_list_of_prompts_sends_best_of_children_per_prompt() -> None:
    plan = planned(completions({"prompt": ["a", "b"], "n": 1, "best_of": 2}))
    assert [(c.index, c.prompt, c.request_id) for c in plan.children] == [
        (0, 0, "0_abc-0"),
        (1, 0, "1_abc-0"),
        (2, 1, "0_abc-1"),
        (3, 1, "1_abc-1"),
    ]
    assert plan.prompts == 2


@pytest.mark.parametrize(
    ("body", "max_n"),
    [
        pytest.param({"n": 3, "best_of": 2}, 10, id="below-n"),
        pytest.param({"n": 2, "best_of": 3, "stream": True}, 10, id="with-stream"),
        pytest.param({"n": 2, "best_of": 11}, 10, id="above-default-max-n"),
        pytest.param({"n": 2, "best_of": 5}, 4, id="above-configured-max-n"),
        pytest.param({"n": 2, "best_of": 3.5}, 10, id="float"),
        pytest.param({"n": 2, "best_of": "3"}, 10, id="string"),
        pytest.param({"n": 2, "best_of": True}, 10, id="json-true"),
    ],
)
def test_bad_best_of_is_rejected_with_param_best_of(body: dict[str, Any], max_n: int) -> None:
    assert rejected({"prompt": "p", **body}, is_completions=True, max_n=max_n) == "best_of"


def test_best_of_seed_bound_counts_every_ranked_child() -> None:
    assert rejected({"n": 2, "best_of": 4, "seed": INT64_MAX - 2}, is_completions=True) == "seed"


def test_best_of_equal_to_n_is_plain_n_with_best_of_removed() -> None:
    plan = planned(completions({"prompt": "p", "n": 3, "best_of": 3, "seed": 1}))
    assert plan.best_of is None
    assert child_bodies(plan) == [{"prompt": "p", "seed": s} for s in (1, 2, 3)]


def test_best_of_equal_to_n_keeps_the_clients_logprobs_untouched() -> None:
    bodies = child_bodies(completions({"prompt": "p", "n": 2, "best_of": 2, "logprobs": 0}))
    assert bodies == [{"prompt": "p", "logprobs": 0}, {"prompt": "p", "logprobs": 0}]


@pytest.mark.parametrize(
    ("path", "endpoint"),
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/completions", "completions"),
        ("/openai/v1/chat/completions", "chat"),
        ("/openai/v1/completions", "completions"),
        ("/inference/v1/generate", "generate"),
        ("/vllm/inference/v1/generate", "generate"),
        ("/v1/responses", None),
        ("/v1/embeddings", None),
        ("/v1/chat/completions/x", None),
    ],
)
def test_endpoint_is_decided_once_from_the_path(path: str, endpoint: str | None) -> None:
    assert endpoint_of(path) == endpoint


@pytest.mark.parametrize("endpoint", ["chat", "completions", "generate"])
def test_plan_carries_its_endpoint(endpoint: Endpoint) -> None:
    body = {"prompt": "p", "n": 2, "sampling_params": {"n": 2}}
    planned = plan_request(body, "abc", 10, endpoint=endpoint)
    assert planned is not None
    assert planned.endpoint == endpoint


# --- generate: vLLM's token-in/token-out endpoint (docs/behaviour.md#generate) ---


def generate(body: dict[str, Any], parent: str = "abc", max_n: int = 10) -> Plan | None:
    return plan_request(body, parent, max_n, endpoint="generate")


def generate_body(**params: Any) -> dict[str, Any]:
    return {"model": "m", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, **params}}


def test_generate_children_take_n_and_seed_from_sampling_params_and_keep_the_rest() -> None:
    features = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 0}]}}
    body = {
        **generate_body(n=3, seed=5, temperature=0.8, logprobs=1),
        "request_id": "rollout-7",
        "features": features,
        "priority": -2,
        "kv_transfer_params": {"do_remote_prefill": True},
        "stream": False,
        "x_vendor": [1, {"deep": None}],
        "n": 9,  # not generate's own n: a field like any other
    }
    original = orjson.loads(orjson.dumps(body))
    p = planned(generate(body))
    assert (p.endpoint, p.n, p.stream, p.prompts) == ("generate", 3, False, 1)
    assert [c.index for c in p.children] == [0, 1, 2]
    assert [c.request_id for c in p.children] == ["0_abc", "1_abc", "2_abc"]
    rest = {k: v for k, v in body.items() if k not in ("sampling_params", "request_id")}
    assert [orjson.loads(c.body) for c in p.children] == [
        {
            **rest,
            "request_id": f"{i}_rollout-7",
            "sampling_params": {"max_tokens": 3, "seed": 5 + i, "temperature": 0.8, "logprobs": 1},
        }
        for i in range(3)
    ]
    assert body == original  # the parent's body and its sampling_params are left as they were


@pytest.mark.parametrize(
    ("params", "seeds"),
    [
        pytest.param({}, [None, None], id="no-seed"),
        pytest.param({"seed": -1}, [-1, -1], id="random-sentinel"),
        pytest.param({"seed": 0}, [0, 1], id="zero"),
        pytest.param({"seed": INT64_MAX - 1}, [INT64_MAX - 1, INT64_MAX], id="top-of-range"),
    ],
)
def test_generate_child_seeds_follow_vllms_seed_plus_i(
    params: dict[str, Any], seeds: list[int | None]
) -> None:
    p = planned(generate(generate_body(n=2, **params)))
    sent = [orjson.loads(c.body)["sampling_params"] for c in p.children]
    assert [s.get("seed") for s in sent] == seeds
    assert all("n" not in s for s in sent)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(generate_body(), id="no-n"),
        pytest.param(generate_body(n=None), id="null-n"),
        pytest.param(generate_body(n=1), id="n-1"),
        pytest.param({"token_ids": [1], "n": 4}, id="no-sampling-params"),
        pytest.param({"token_ids": [1], "sampling_params": [{"n": 4}]}, id="not-an-object"),
    ],
)
def test_generate_without_an_n_above_one_in_sampling_params_passes_through(
    body: dict[str, Any],
) -> None:
    assert generate(body) is None


@pytest.mark.parametrize(
    ("params", "param"),
    [
        pytest.param({"n": True}, "n", id="true"),
        pytest.param({"n": 2.5}, "n", id="float"),
        pytest.param({"n": "3"}, "n", id="string"),
        pytest.param({"n": 0}, "n", id="zero"),
        pytest.param({"n": 11}, "n", id="over-max-n"),
        pytest.param({"n": 2, "seed": INT64_MAX}, "seed", id="seed-plus-n-overflows"),
        pytest.param({"n": 2, "seed": INT64_MIN - 1}, "seed", id="seed-below-int64"),
        pytest.param({"n": 2, "seed": 1e19}, "seed", id="seed-past-64-bits-as-float"),
    ],
)
def test_generate_validates_sampling_params_n_and_seed_as_the_other_kinds(
    params: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        generate(generate_body(**params))
    assert info.value.status == 400
    error = orjson.loads(info.value.body())["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    # The same refusal as on a chat path, word for word.
    chat_body = {"messages": [], **params}
    with pytest.raises(InvalidRequest) as on_chat:
        chat(chat_body)
    assert on_chat.value.body() == info.value.body()


def test_generate_keeps_a_kv_transfer_params_list_whole_for_every_child() -> None:
    """vLLM's generate takes one kv_transfer_params object: nothing of it is the proxy's."""
    kv = [{"a": 1}, {"b": 2}]
    p = planned(generate({**generate_body(n=2), "kv_transfer_params": kv}))
    assert [orjson.loads(c.body)["kv_transfer_params"] for c in p.children] == [kv, kv]


def test_generate_stream_options_are_read_at_the_top_level() -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    p = planned(generate({**generate_body(n=2), "stream": True, "stream_options": options}))
    assert (p.stream, p.include_usage, p.continuous_usage) == (True, True, True)


def test_generate_children_are_capped_by_max_n_of_the_config() -> None:
    assert planned(generate(generate_body(n=16), max_n=16)).n == 16
    with pytest.raises(InvalidRequest):
        generate(generate_body(n=17), max_n=16)
