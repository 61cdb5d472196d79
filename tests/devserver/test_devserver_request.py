"""Tests of the demo backend's request parsing: literal bodies in, jobs or errors out."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.devserver.config import DevConfig
from proxy.devserver.faults import Knobs
from proxy.devserver.request import RequestError, parse_job

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
