"""Plain counts: counters and histograms that are Python numbers, turned into Prometheus metric
families only when scraped. prometheus-client's own metric objects take a lock on every update
(1.6 µs an ``observe``); these cost an add or two. One process only: ``--workers`` uses
prometheus-client's (``proxy.observe.metrics``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric


class Count:
    """A count: a plain one, or prometheus-client's under ``--workers`` (``counted``). A class,
    not a protocol: compiled code calls a class's method directly, and a protocol's by looking
    it up by name at each call (600 instructions)."""

    def inc(self, amount: float = 1) -> None:
        raise NotImplementedError


class Observe:
    """An observed value's histogram: a plain one, or prometheus-client's (``observed``)."""

    def observe(self, amount: float) -> None:
        raise NotImplementedError


class _Counted(Count):
    def __init__(self, child: Any) -> None:
        self.child = child

    def inc(self, amount: float = 1) -> None:
        self.child.inc(amount)


class _Observed(Observe):
    def __init__(self, child: Any) -> None:
        self.child = child

    def observe(self, amount: float) -> None:
        self.child.observe(amount)


def counted(child: object) -> Count:
    """A family's labelled child as a ``Count``: a plain one as it is, prometheus-client's
    wrapped."""
    return child if isinstance(child, Count) else _Counted(child)


def observed(child: object) -> Observe:
    """A family's labelled child as an ``Observe``: a plain one as it is, prometheus-client's
    wrapped."""
    return child if isinstance(child, Observe) else _Observed(child)


class _Count(Count):
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class _Spread(Observe):
    """A histogram's buckets as plain counts; cumulated only when scraped."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # bisect_left: the first bound >= amount, Prometheus's `le`. Written out: compiled, it
        # compares floats natively, where a call to bisect's took 750 instructions.
        bounds = self.bounds
        low, high = 0, len(bounds)
        while low < high:
            middle = (low + high) // 2
            if bounds[middle] < amount:
                low = middle + 1
            else:
                high = middle
        self.counts[low] += 1
        self.sum += amount


class _Family:
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)


class PlainCounter(_Family):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self._children: dict[tuple[str, ...], _Count] = {}
        if not self.labelnames:
            self.labels()  # exported at zero from the start, as prometheus-client does

    def labels(self, *values: str) -> _Count:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _Count()
        return child

    def remove(self, *values: str) -> None:
        self._children.pop(values, None)

    def inc(self, amount: float = 1) -> None:
        self.labels().inc(amount)

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value)
        return family


class PlainHistogram(_Family):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
    ) -> None:
        super().__init__(name, documentation, labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _Spread] = {}
        if not self.labelnames:
            self.labels()

    def labels(self, *values: str) -> _Spread:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _Spread(self.bounds)
        return child

    def remove(self, *values: str) -> None:
        self._children.pop(values, None)

    def observe(self, amount: float) -> None:
        self.labels().observe(amount)

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        names = [*(str(b) for b in self.bounds), "+Inf"]
        for values, child in list(self._children.items()):
            total = 0
            buckets = []
            for name, count in zip(names, child.counts, strict=True):
                total += count
                buckets.append((name, float(total)))
            family.add_metric(list(values), buckets, child.sum)
        return family
