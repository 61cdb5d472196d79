"""Tests for the usage merge (proxy.core.usage): per-child usage dicts in, the native-n usage
out (docs/behaviour.md#usage, #best-of)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest

from proxy.core.usage import Tokens, merge_usage, token_counts


def usage(prompt: int, completion: int, **extra: Any) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        **extra,
    }


def test_prompt_counted_once_and_completions_summed() -> None:
    merged = merge_usage([usage(10, 5), usage(10, 7), usage(10, 1)], [0])
    assert merged == {"prompt_tokens": 10, "completion_tokens": 13, "total_tokens": 23}


def test_prompt_tokens_are_child_zeros_even_when_children_disagree() -> None:
    merged = merge_usage([usage(10, 5), usage(12, 7)], [0])
    assert merged == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}


def test_list_of_prompts_sums_each_prompts_choice_zero() -> None:
    # Two prompts, two choices each: positions 0 and 2 are each prompt's choice 0.
    merged = merge_usage([usage(3, 1), usage(3, 2), usage(8, 4), usage(8, 8)], [0, 2])
    assert merged == {"prompt_tokens": 11, "completion_tokens": 15, "total_tokens": 26}


def test_total_tokens_is_recomputed_not_summed_or_copied() -> None:
    wrong_totals = [
        {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 999},
        {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 0},
    ]
    merged = merge_usage(wrong_totals, [0])
    assert merged == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}


def test_cached_tokens_are_child_zeros_never_a_sum() -> None:
    merged = merge_usage(
        [
            usage(100, 1, prompt_tokens_details={"cached_tokens": 64}),
            usage(100, 2, prompt_tokens_details={"cached_tokens": 96}),
            usage(100, 3, prompt_tokens_details={"cached_tokens": 96}),
        ],
        [0],
    )
    assert merged == {
        "prompt_tokens": 100,
        "completion_tokens": 6,
        "total_tokens": 106,
        "prompt_tokens_details": {"cached_tokens": 64},
    }


def test_cached_tokens_stay_child_zeros_for_a_list_of_prompts() -> None:
    merged = merge_usage(
        [
            usage(5, 1, prompt_tokens_details={"cached_tokens": 0}),
            usage(7, 1, prompt_tokens_details={"cached_tokens": 4}),
        ],
        [0, 1],
    )
    assert merged is not None
    assert merged["prompt_tokens"] == 12
    assert merged["prompt_tokens_details"] == {"cached_tokens": 0}


def test_every_numeric_completion_tokens_details_field_is_summed() -> None:
    merged = merge_usage(
        [
            usage(
                9,
                10,
                completion_tokens_details={
                    "reasoning_tokens": 4,
                    "accepted_prediction_tokens": 1,
                    "rejected_prediction_tokens": 0,
                    "audio_tokens": 0,
                },
            ),
            usage(
                9,
                20,
                completion_tokens_details={
                    "reasoning_tokens": 6,
                    "accepted_prediction_tokens": 2,
                    "rejected_prediction_tokens": 3,
                    "audio_tokens": 0,
                },
            ),
        ],
        [0],
    )
    assert merged == {
        "prompt_tokens": 9,
        "completion_tokens": 30,
        "total_tokens": 39,
        "completion_tokens_details": {
            "reasoning_tokens": 10,
            "accepted_prediction_tokens": 3,
            "rejected_prediction_tokens": 3,
            "audio_tokens": 0,
        },
    }


def test_completion_details_field_missing_in_one_child_sums_the_others() -> None:
    merged = merge_usage(
        [
            usage(1, 1, completion_tokens_details={"reasoning_tokens": 2}),
            usage(1, 1, completion_tokens_details={"reasoning_tokens": 3, "x_draft": 5}),
            usage(1, 1),
        ],
        [0],
    )
    assert merged is not None
    assert merged["completion_tokens_details"] == {"reasoning_tokens": 5, "x_draft": 5}


def test_vendor_fields_come_from_child_zero() -> None:
    merged = merge_usage(
        [
            usage(2, 1, x_vendor={"queue_ms": 3}, prompt_tokens_details=None),
            usage(2, 1, x_vendor={"queue_ms": 9}, prompt_tokens_details=None),
        ],
        [0],
    )
    assert merged == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
        "x_vendor": {"queue_ms": 3},
        "prompt_tokens_details": None,
    }


def test_children_without_usage_are_ignored() -> None:
    merged = merge_usage([usage(6, 2), None, usage(6, 3), None], [0])
    assert merged == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}


@pytest.mark.parametrize(
    ("usages", "heads"),
    [
        pytest.param([None, None], [0], id="all-none"),
        pytest.param([None], [0], id="single-none"),
        pytest.param([], [], id="no-children"),
    ],
)
def test_no_usage_at_all_merges_to_none(
    usages: list[dict[str, Any] | None], heads: list[int]
) -> None:
    assert merge_usage(usages, heads) is None


def test_best_of_usage_counts_every_ranked_completion() -> None:
    # Usage covers all best_of completions, as OpenAI bills them (docs/behaviour.md#best-of).
    merged = merge_usage([usage(4, 3), usage(4, 5), usage(4, 2), usage(4, 6)], [0])
    assert merged == {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20}


def test_children_usage_is_not_mutated() -> None:
    first = usage(1, 1, completion_tokens_details={"reasoning_tokens": 1})
    second = usage(1, 2, completion_tokens_details={"reasoning_tokens": 1})
    merge_usage([first, second], [0])
    assert first == usage(1, 1, completion_tokens_details={"reasoning_tokens": 1})
    assert second == usage(1, 2, completion_tokens_details={"reasoning_tokens": 1})


def test_a_usage_given_as_any_mapping_merges_as_the_same_dict_does() -> None:
    """JSON gives dicts, tested first; any other mapping is still a usage (and details)."""
    usages: list[dict[str, Any] | None] = [
        {"prompt_tokens": 5, "completion_tokens": 2, "completion_tokens_details": {"a": 1}},
        None,
        {"prompt_tokens": 5, "completion_tokens": 3, "completion_tokens_details": {"a": 2}},
    ]
    as_proxies = [
        None
        if u is None
        else MappingProxyType(
            {k: MappingProxyType(v) if isinstance(v, dict) else v for k, v in u.items()}
        )
        for u in usages
    ]
    merged = merge_usage(usages, [0])
    assert merged is not None
    assert merged["completion_tokens_details"] == {"a": 3}
    assert merge_usage(as_proxies, [0]) == merged
    assert (
        token_counts(
            MappingProxyType(
                {
                    "prompt_tokens_details": MappingProxyType({"cached_tokens": 4}),
                    "completion_tokens": 7,
                }
            )
        )
        == token_counts({"prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens": 7})
        == Tokens(0, 7, 4, 0)
    )
