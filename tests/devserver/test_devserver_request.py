"""Tests of the demo backend's request parsing: literal bodies in, jobs or errors out."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.devserver.config import DevConfig
from proxy.devserver.faults import Knobs
from proxy.devserver.request import RequestError, parse_generate_job, parse_job

MESSAGES = [{"role": "user", "content": "one two"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, **fields}


def test_native_n_seeds_each_choice_with_seed_plus_i_and_keeps_the_random_sentinel() -> None:
    native = DevConfig(native_n=True)
    assert parse_job(chat(n=3, seed=10), True, "r", native).seeds == (10, 11, 12)
    assert parse_job(chat(n=2, seed=-1), True, "r", native).seeds == (-1, -1)
    assert parse_job(chat(n=2), True, "r", native).seeds == (None, None)


def test_defaults_come_from_the_config_and_the_body_overrides_them() -> None:
    config = DevConfig(token_delay=0.5, model="m")
    job = parse_job(chat(), True, "r", config)
    assert (job.model, job.max_tokens, job.token_delay, job.knobs) == ("m", 16, 0.5, Knobs())
    demo = {"fault": "gzip", "token_delay": 0}
    job = parse_job(chat(model="x", max_completion_tokens=3, x_demo=demo), True, "r", config)
    assert (job.model, job.max_tokens, job.token_delay) == ("x", 3, 0.0)
    assert job.knobs == Knobs("gzip", 1, 0.0)


def test_completion_prompts_in_several_spellings() -> None:
    for prompt, text in [("a b", "a b"), (["a b"], "a b"), ([1, 2], "1 2"), ([[1, 2]], "1 2")]:
        assert parse_job({"prompt": prompt}, False, "r", DevConfig()).prompt == text


def test_only_seed_drops_the_fault_for_other_seeds() -> None:
    demo = {"fault": "status_429", "only_seed": 7}
    assert parse_job(chat(seed=7, x_demo=demo), True, "r", DevConfig()).knobs.fault == "status_429"
    assert parse_job(chat(seed=8, x_demo=demo), True, "r", DevConfig()).knobs == Knobs()


@pytest.mark.parametrize(
    ("body", "chat_route", "param"),
    [
        (chat(n=2), True, "n"),
        (chat(seed="1"), True, "seed"),
        (chat(max_tokens=-1), True, "max_tokens"),
        (chat(top_logprobs=21), True, "top_logprobs"),
        (chat(x_demo={"fault": "nope"}), True, "x_demo"),
        ({"messages": []}, True, "messages"),
        ({"prompt": ["a", "b"]}, False, "prompt"),
        ([], True, None),
    ],
)
def test_invalid_bodies_name_the_offending_field(
    body: object, chat_route: bool, param: str | None
) -> None:
    with pytest.raises(RequestError) as caught:
        parse_job(body, chat_route, "r", DevConfig())
    assert caught.value.param == param


def test_headers_delay_holds_only_the_chosen_seeds_status_line() -> None:
    demo = {"headers_delay": 0.25, "only_seed": 7}
    assert parse_job(chat(seed=7, x_demo=demo), True, "r", DevConfig()).knobs.headers_delay == 0.25
    assert parse_job(chat(seed=8, x_demo=demo), True, "r", DevConfig()).knobs.headers_delay == 0.0


# --- vLLM's generate route: n, seed, max_tokens and logprobs in sampling_params


def generate(**params: Any) -> dict[str, Any]:
    return {"token_ids": [5, 6, 7], "sampling_params": params}


def test_generate_reads_sampling_params_and_counts_the_token_ids_as_the_prompt() -> None:
    body = {**generate(seed=3, max_tokens=4, logprobs=2), "stream": True,
            "stream_options": {"include_usage": True}, "x_demo": {"fault": "gzip"}}  # fmt: skip
    job = parse_generate_job(body, "r", DevConfig())
    assert (job.kind, job.prompt, job.prompt_tokens) == ("generate", "5 6 7", 3)
    assert (job.seeds, job.max_tokens, job.top_logprobs) == ((3,), 4, 2)
    assert (job.stream, job.include_usage, job.knobs.fault) == (True, True, "gzip")
    native = DevConfig(native_n=True)
    assert parse_generate_job(generate(n=3, seed=-1), "r", native).seeds == (-1, -1, -1)


def test_generate_only_seed_looks_at_the_seed_in_sampling_params() -> None:
    demo = {"fault": "status_429", "only_seed": 7}
    hit = parse_generate_job({**generate(seed=7), "x_demo": demo}, "r", DevConfig())
    missed = parse_generate_job({**generate(seed=8), "x_demo": demo}, "r", DevConfig())
    assert (hit.knobs.fault, missed.knobs) == ("status_429", Knobs())


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (generate(n=2), "n", "Only n=1 is supported."),  # vLLM's Rust frontend, word for word
        (generate(seed=1.5), "seed", None),
        (generate(logprobs=21), "logprobs", None),
        ({"token_ids": [], "sampling_params": {}}, "token_ids", None),
        ({"token_ids": [1, -2], "sampling_params": {}}, "token_ids", None),
        ({"token_ids": [1]}, "sampling_params", None),
        ([], None, None),
    ],
)
def test_generate_invalid_bodies_name_the_offending_field(
    body: object, param: str | None, message: str | None
) -> None:
    with pytest.raises(RequestError) as caught:
        parse_generate_job(body, "r", DevConfig())
    assert caught.value.param == param
    if message is not None:
        assert caught.value.message == message
