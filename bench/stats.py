"""Medians over alternating rounds, paired by round so slow drift on the machine cancels out."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

Row = dict[str, Any]


def median(values: Iterable[float]) -> float:
    items = list(values)
    return statistics.median(items) if items else float("nan")


def rotated(items: Sequence[str], turn: int) -> list[str]:
    """A different order each round, so no contender always runs first (or last)."""
    k = turn % len(items) if items else 0
    return [*items[k:], *items[:k]]


def paired(
    rows: Sequence[Row],
    key: Callable[[Row], bool],
    baseline: Callable[[Row], bool],
    value: Callable[[Row, Row], float],
) -> list[float]:
    """``value(row, its baseline)`` for each round that measured both."""
    by_round = {r["round"]: r for r in rows if baseline(r)}
    return [value(r, by_round[r["round"]]) for r in rows if key(r) and r["round"] in by_round]
