"""Tests for proxy.core.remembered: work on strings someone else chose, remembered, bounded."""

from __future__ import annotations

from proxy.core import Remembered


class _Work:
    """Upper-cases its key, counting the keys it was asked for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, key: str) -> str:
        self.asked.append(key)
        return key.upper()


def test_a_key_is_worked_out_once_then_remembered() -> None:
    work = _Work()
    remembered = Remembered(work, most=4, longest=10)
    assert [remembered.of(k) for k in ("a", "b", "a", "a", "b")] == ["A", "B", "A", "A", "B"]
    assert work.asked == ["a", "b"]
    assert len(remembered) == 2


def test_past_its_bound_the_memory_starts_again_and_the_answers_stay_right() -> None:
    """Keys sent only to fill it cost their work: the usual ones are kept again afterwards."""
    work = _Work()
    remembered = Remembered(work, most=3, longest=10)
    for key in ("usual", "x1", "x2", "x3", "x4", "usual", "usual"):
        assert remembered.of(key) == key.upper()
        assert len(remembered) <= 3
    assert work.asked == ["usual", "x1", "x2", "x3", "x4", "usual"]  # kept again once asked


def test_a_key_longer_than_its_bound_is_worked_out_every_time_and_never_kept() -> None:
    work = _Work()
    remembered = Remembered(work, most=4, longest=3)
    long = "abcd"
    assert [remembered.of(long) for _ in range(3)] == ["ABCD"] * 3
    assert work.asked == [long] * 3
    assert len(remembered) == 0
    assert remembered.of("abc") == "ABC"
    assert len(remembered) == 1


def test_work_that_gives_none_is_asked_again_and_still_answered() -> None:
    asked: list[str] = []

    def nothing(key: str) -> None:
        asked.append(key)

    remembered: Remembered[None] = Remembered(nothing, most=4, longest=10)
    assert remembered.of("a") is None
    assert remembered.of("a") is None
    assert asked == ["a", "a"]
