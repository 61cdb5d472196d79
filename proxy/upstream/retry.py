"""When a failed upstream try is tried again, and after how long: backoff, ``Retry-After`` and
the retry budget (docs/behaviour.md#failover). Pure: the caller passes the time and the random
draw in; no I/O.
"""

from __future__ import annotations

import datetime
import email.utils
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal

Reason = str | int  # "connect", "reset" or an HTTP status, as ``retry_on`` lists them


@dataclass(frozen=True)
class Backoff:
    """Retry ``r`` (1-based) waits a random time between half and all of
    ``min(cap, base * 2 ** (r - 1))``: exponential, and jittered so that the children of one
    request, failed together, do not come back together ("equal jitter"). Half is kept fixed
    so retries are always spaced, even on an unlucky draw."""

    base: float = 0.05
    cap: float = 2.0

    def delay(self, retry: int, draw: float) -> float:
        """``draw`` in [0, 1): the random part."""
        ceiling = min(self.cap, self.base * 2.0 ** min(retry - 1, 64))
        return ceiling / 2 + ceiling / 2 * draw


def parse_retry_after(value: str, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delay-seconds or an HTTP date (RFC 9110
    §10.2.3), ``now`` in Unix seconds. None when it is neither; a date in the past is 0."""
    value = value.strip()
    if value.isascii() and value.isdigit():  # "1e3", "-1", "inf" are not delay-seconds
        return float(value)
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if moment.tzinfo is None:  # asctime's form has no zone: HTTP dates are always GMT
        moment = moment.replace(tzinfo=datetime.UTC)
    return max(moment.timestamp() - now, 0.0)


class RetryBudget:
    """Retries allowed over a sliding ``window``: ``percent`` of the requests in it, and never
    fewer than ``min_per_second`` per second of it (Finagle's RetryBudget; Envoy's retry budget
    has the same two knobs over concurrent requests).

    The window is kept in ``slices`` buckets, so memory stays fixed whatever the rate.
    """

    def __init__(
        self, percent: float, min_per_second: float, window: float = 10.0, slices: int = 10
    ) -> None:
        self.ratio = percent / 100
        self.floor = min_per_second * window
        self._width = window / slices
        self._slices = slices
        self._stamp = [-1] * slices  # the slice number each bucket counts now
        self._requests = [0] * slices
        self._retries = [0] * slices

    def _bucket(self, now: float) -> int:
        number = int(now // self._width)
        pos = number % self._slices
        if self._stamp[pos] != number:
            self._stamp[pos] = number
            self._requests[pos] = 0
            self._retries[pos] = 0
        return pos

    def requested(self, now: float) -> None:
        """A first try: it earns the budget its share."""
        self._requests[self._bucket(now)] += 1

    def spend(self, now: float) -> bool:
        """Take one retry from the budget; False (nothing taken) when it is used up."""
        pos = self._bucket(now)
        oldest = self._stamp[pos] - self._slices
        requests = retries = 0
        for stamp, asked, retried in zip(self._stamp, self._requests, self._retries, strict=True):
            if stamp > oldest:
                requests += asked
                retries += retried
        if retries + 1 > self.floor + self.ratio * requests:
            return False
        self._retries[pos] += 1
        return True

    def refund(self, spent_at: float) -> None:
        """Give back the retry ``spend`` took at ``spent_at``: it was never sent. A slice that
        has left the window since holds nothing to give back."""
        number = int(spent_at // self._width)
        pos = number % self._slices
        if self._stamp[pos] == number and self._retries[pos] > 0:
            self._retries[pos] -= 1


Outcome = Literal["retry", "final", "spent", "budget", "too_long"]


@dataclass(frozen=True)
class Verdict:
    """What to do after a failed try. ``retry``: again after ``delay`` seconds. Otherwise the
    failure stands: ``final`` (not a failure ``retry_on`` lists), ``spent`` (``retries`` used),
    ``budget`` (the retry budget is used up), ``too_long`` (``Retry-After`` past its cap).
    Every outcome but ``final`` lets a fallback upstream take over."""

    outcome: Outcome
    delay: float = 0.0
    spent_at: float | None = None  # when a retry took its budget share (a connect one takes none)

    @property
    def falls_back(self) -> bool:
        return self.outcome not in ("retry", "final")


@dataclass
class RetryPolicy:
    """One upstream's retry rules and its budget, shared by every request to it."""

    retries: int
    retry_on: Collection[Reason]
    backoff: Backoff
    retry_after_cap: float
    budget: RetryBudget
    draw: Callable[[], float] = field(default=random.random)

    def decide(
        self, tries: int, reason: Reason | None, retry_after: float | None, now: float
    ) -> Verdict:
        """After ``tries`` failed tries, the last one for ``reason``; ``retry_after`` in seconds
        when that answer carried one.

        A ``connect`` failure takes nothing from the budget: the server never saw the request,
        so its retry adds no load (the budget is there against retry storms on busy servers).
        Any other retry takes its share now, so that tries failing together cannot all take
        the last one; ``unsent`` gives it back if the retry never goes out (its wait was
        cancelled: the client left, a sibling failed).
        """
        if reason is None or reason not in self.retry_on:
            return Verdict("final")
        if tries > self.retries:
            return Verdict("spent")
        if retry_after is not None and not retry_after <= self.retry_after_cap:
            return Verdict("too_long")
        spent_at = None
        if reason != "connect":
            if not self.budget.spend(now):
                return Verdict("budget")
            spent_at = now
        delay = self.backoff.delay(tries, self.draw())
        if retry_after is not None:
            delay = max(delay, retry_after)
        return Verdict("retry", delay, spent_at)

    def unsent(self, verdict: Verdict) -> None:
        """A ``retry`` verdict whose retry never went out: its budget share back."""
        if verdict.spent_at is not None:
            self.budget.refund(verdict.spent_at)
