"""Tests of the demo backend's generation model: a pure function of prompt and seed."""

from __future__ import annotations

from proxy.devserver.model import WORD_TOKENS, Generation, generate


def test_generation_is_a_pure_function_of_prompt_and_seed() -> None:
    first = generate("one two", 5, 40, may_stop=False)
    assert first == generate("one two", 5, 40, may_stop=False)
    assert first != generate("one two", 6, 40, may_stop=False)
    assert first != generate("one three", 5, 40, may_stop=False)
    assert generate("one two", 5, 10, may_stop=False).tokens == first.tokens[:10]
    assert all(t.text in WORD_TOKENS and t.logprob < 0 for t in first.tokens)


def test_generation_stops_early_only_when_allowed() -> None:
    stopped = [generate("p", seed, 64, may_stop=True) for seed in range(20)]
    assert {g.finish_reason for g in stopped} == {"stop"}
    assert all(1 <= len(g.tokens) < 64 for g in stopped)
    assert len({len(g.tokens) for g in stopped}) > 1
    forced: list[Generation] = [generate("p", seed, 64, may_stop=False) for seed in range(20)]
    assert {(g.finish_reason, len(g.tokens)) for g in forced} == {("length", 64)}
