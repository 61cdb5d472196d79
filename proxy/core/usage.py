"""The children's usage merged into the one a native-n server reports (docs/behaviour.md#usage):
the prompt counted once per prompt, completion tokens summed over every child; and the tokens a
usage reports, as the metrics count them. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard, final

from proxy.core.plan import is_number


def merge_usage(
    usages: Sequence[Mapping[str, Any] | None], prompt_heads: Sequence[int]
) -> dict[str, Any] | None:
    """Merge per-child usage; ``prompt_heads`` are the positions of each prompt's choice 0.

    The prompt is counted once per prompt (it was processed once by a native-n server), cached
    tokens are child 0's, completion tokens and their details are summed over every child.
    """
    present = [u for u in usages if _mapping(u)]
    if not present:
        return None
    merged = dict(present[0])
    prompt_tokens = 0
    for head in prompt_heads:
        usage = usages[head] if head < len(usages) else None
        if _mapping(usage):
            prompt_tokens += _int(usage.get("prompt_tokens"))
    completion_tokens = sum(_int(u.get("completion_tokens")) for u in present)
    merged["prompt_tokens"] = prompt_tokens
    merged["completion_tokens"] = completion_tokens
    merged["total_tokens"] = prompt_tokens + completion_tokens
    details = [u.get("completion_tokens_details") for u in present]
    if any(_mapping(d) for d in details):
        merged["completion_tokens_details"] = _sum_details(details)
    return merged


def _sum_details(details: Sequence[object]) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for detail in details:
        if not _mapping(detail):
            continue
        for key, value in detail.items():
            if is_number(value):
                previous = total.get(key)
                total[key] = (previous if is_number(previous) else 0) + value
            else:
                total.setdefault(key, value)
    return total


def _mapping(value: object) -> TypeGuard[Mapping[str, Any]]:
    """Whether ``value`` is a mapping: a dict (what JSON gives) or None (most details) found
    without the costlier test against the ABC, 1,500 instructions each (a fan-out's usage takes
    a dozen)."""
    return isinstance(value, dict) or (value is not None and isinstance(value, Mapping))


def _int(value: object) -> int:
    """A JSON integer, else 0: ``type`` rules out ``bool`` (and JSON has no other int) in one test,
    on every answer's counts."""
    return value if type(value) is int else 0


@final
class Tokens:
    """A compiled value, as ``proxy.core.answer.AnswerFacts``: one is made for each answer."""

    __slots__ = ("cached", "completion", "prompt", "reasoning")

    def __init__(self, prompt: int, completion: int, cached: int, reasoning: int) -> None:
        self.prompt = prompt
        self.completion = completion
        self.cached = cached  # prompt tokens served from the prefix cache
        self.reasoning = reasoning  # completion tokens spent reasoning

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tokens):
            return NotImplemented
        mine = (self.prompt, self.completion, self.cached, self.reasoning)
        return mine == (other.prompt, other.completion, other.cached, other.reasoning)

    def __repr__(self) -> str:
        return (
            f"Tokens(prompt={self.prompt}, completion={self.completion}, cached={self.cached},"
            f" reasoning={self.reasoning})"
        )


def token_counts(usage: Mapping[str, Any]) -> Tokens:
    """The tokens ``usage`` reports, 0 for what it does not (OpenAI's fields: ``prompt_tokens``,
    ``completion_tokens``, ``prompt_tokens_details.cached_tokens``,
    ``completion_tokens_details.reasoning_tokens``)."""
    # A dict's get is a C call when compiled; a Mapping's is a method looked up at each call.
    fields: dict[str, Any] = usage if isinstance(usage, dict) else dict(usage)
    prompt_details = fields.get("prompt_tokens_details")
    completion_details = fields.get("completion_tokens_details")
    cached = reasoning = 0
    if _mapping(prompt_details):
        cached = _int(prompt_details.get("cached_tokens"))
    if _mapping(completion_details):
        reasoning = _int(completion_details.get("reasoning_tokens"))
    prompt, completion = fields.get("prompt_tokens"), fields.get("completion_tokens")
    return Tokens(
        prompt if type(prompt) is int else 0,
        completion if type(completion) is int else 0,
        cached,
        reasoning,
    )
