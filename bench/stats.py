"""Medians and quantiles, taken one way for every scenario, and rounds paired so drift cancels."""

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

Row = dict[str, Any]
NAN = float("nan")


def numbers(values: Iterable[Any]) -> list[float]:
    """The values that were measured: ``None`` and NaN (a moment that never came) left out."""
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def median(values: Iterable[Any]) -> float:
    """The median of what was measured; NaN when nothing was."""
    found = numbers(values)
    return statistics.median(found) if found else NAN


def medians(rows: Iterable[Row], *keys: str) -> Row:
    """The median of each of ``keys`` over ``rows``."""
    rows = list(rows)
    return {k: median(r.get(k) for r in rows) for k in keys}


def grouped(rows: Iterable[Row], *keys: str) -> list[tuple[tuple[Any, ...], list[Row]]]:
    """Rows grouped by their values of ``keys``, the groups in first-seen order."""
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    return list(groups.items())


def quartiles(values: Iterable[Any]) -> tuple[float, float, float]:
    """First quartile, median, third quartile (all three the value itself for one value)."""
    found = numbers(values)
    if len(found) < 2:
        return (found[0],) * 3 if found else (NAN,) * 3
    q1, q2, q3 = statistics.quantiles(found, n=4)
    return q1, q2, q3


def percentile(ascending: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of an ascending list; NaN when empty."""
    if not ascending:
        return NAN
    rank = max(1, min(len(ascending), math.ceil(q / 100 * len(ascending))))
    return ascending[rank - 1]


def ratio(a: Any, b: Any) -> float:
    """a / b, NaN when either was not measured or b is 0."""
    return float(a) / float(b) if numbers([a]) and numbers([b]) and b else NAN


def minus(a: Any, b: Any) -> float:
    return float(a - b)


def paired(
    rows: Sequence[Row], field: str, mine: object, base: object, key: str,
    op: Callable[[Any, Any], float] = ratio,
) -> list[float]:  # fmt: skip
    """``op`` (``ratio`` or ``minus``) of ``key`` in ``mine``'s row and in ``base``'s of the same
    round, for each round that measured both."""
    by_round = {r["round"]: r for r in rows if r[field] == base}
    return [
        op(r[key], by_round[r["round"]][key])
        for r in rows
        if r[field] == mine and r["round"] in by_round
    ]
