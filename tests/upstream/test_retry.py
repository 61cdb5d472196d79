"""The retry policy, literal in and out on a fake clock: backoff, Retry-After, budget, verdicts."""

from __future__ import annotations

import pytest

from proxy.upstream.retry import Backoff, RetryBudget, RetryPolicy, Verdict, parse_retry_after

# --- backoff ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("retry", "draw", "delay"),
    [
        (1, 0.0, 0.05),  # half of base at the lowest draw: retries are always spaced
        (1, 0.5, 0.075),
        (2, 0.0, 0.1),
        (3, 0.0, 0.2),
        (3, 0.999, 0.3998),
        (6, 0.0, 1.0),  # 0.1 * 2**5 = 3.2 s, capped at 2 s
        (6, 0.999, 1.999),
        (10_000, 0.0, 1.0),  # no overflow however far the count goes
    ],
)
def test_backoff_is_exponential_jittered_and_capped(retry: int, draw: float, delay: float) -> None:
    assert Backoff(base=0.1, cap=2.0).delay(retry, draw) == pytest.approx(delay)


# --- Retry-After --------------------------------------------------------------------------------

NOW = 784111770.0  # Sun, 06 Nov 1994 08:49:30 GMT


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("120", 120.0),
        (" 0 ", 0.0),
        ("Sun, 06 Nov 1994 08:49:37 GMT", 7.0),  # RFC 9110's three date forms
        ("Sunday, 06-Nov-94 08:49:37 GMT", 7.0),
        ("Sun Nov  6 08:49:37 1994", 7.0),
        ("Sun, 06 Nov 1994 08:00:00 GMT", 0.0),  # a date gone by: at once
        ("-1", None),
        ("1.5", None),
        ("1e3", None),
        ("inf", None),
        ("\u0661\u0662", None),  # digits, but not ASCII ones
        ("soon", None),
        ("", None),
    ],
)
def test_retry_after_is_delay_seconds_or_an_http_date(value: str, seconds: float | None) -> None:
    assert parse_retry_after(value, NOW) == seconds


# --- budget -------------------------------------------------------------------------------------


def test_the_budget_allows_percent_of_requests_over_its_minimum() -> None:
    budget = RetryBudget(percent=20, min_per_second=0.1, window=10)  # a floor of one retry
    for _ in range(10):
        budget.requested(now=0.0)
    assert [budget.spend(now=0.5) for _ in range(4)] == [True, True, True, False]  # 1 + 2


def test_the_minimum_allows_retries_with_no_requests_at_all() -> None:
    budget = RetryBudget(percent=20, min_per_second=0.3, window=10)
    assert [budget.spend(now=1.0) for _ in range(4)] == [True, True, True, False]


def test_a_refused_retry_takes_nothing_from_the_budget() -> None:
    budget = RetryBudget(percent=50, min_per_second=0, window=10)
    budget.requested(now=0.0)
    budget.requested(now=0.0)
    assert [budget.spend(now=0.0) for _ in range(3)] == [True, False, False]
    budget.requested(now=0.0)
    budget.requested(now=0.0)
    assert budget.spend(now=0.0) is True


def test_the_window_slides_requests_and_retries_out() -> None:
    budget = RetryBudget(percent=100, min_per_second=0, window=10, slices=10)
    budget.requested(now=0.5)
    assert budget.spend(now=0.5) is True
    assert budget.spend(now=9.9) is False  # the retry at 0.5 is still in the window
    budget.requested(now=5.0)
    assert budget.spend(now=9.9) is True
    assert budget.spend(now=10.5) is False  # the slice of 0.5 left: one request, one retry
    assert budget.spend(now=15.5) is False  # the request of 5.0 left too: none, retry of 9.9
    assert budget.spend(now=20.0) is False  # nothing in the window: no requests, no floor
    budget.requested(now=20.0)
    assert budget.spend(now=20.0) is True


def test_a_slice_reused_after_a_long_silence_starts_from_zero() -> None:
    budget = RetryBudget(percent=100, min_per_second=0, window=1, slices=2)
    for _ in range(5):
        budget.requested(now=0.0)
    # 100.0 falls in the same bucket as 0.0: its old counts must not carry over
    assert budget.spend(now=100.0) is False


# --- verdicts -----------------------------------------------------------------------------------


def policy(retries: int = 2, percent: float = 20, floor: float = 0.3) -> RetryPolicy:
    return RetryPolicy(
        retries=retries,
        retry_on=frozenset({"connect", "reset", 503}),
        backoff=Backoff(base=0.1, cap=1.0),
        retry_after_cap=5.0,
        budget=RetryBudget(percent=percent, min_per_second=floor, window=10),
        draw=lambda: 0.5,
    )


@pytest.mark.parametrize(
    ("tries", "reason", "retry_after", "verdict"),
    [
        (1, "connect", None, Verdict("retry", 0.075)),
        (2, "reset", None, Verdict("retry", 0.15)),
        (2, 503, None, Verdict("retry", 0.15)),
        (3, 503, None, Verdict("spent")),  # 1 try + 2 retries
        (1, 500, None, Verdict("final")),  # not listed in retry_on
        (1, None, None, Verdict("final")),  # a timeout waiting for the answer
        (1, 503, 3.0, Verdict("retry", 3.0)),  # Retry-After longer than the backoff
        (1, 503, 0.0, Verdict("retry", 0.075)),  # ... or shorter
        (1, 503, 5.0, Verdict("retry", 5.0)),
        (1, 503, 5.5, Verdict("too_long")),  # past retry_after_cap: relayed as it is
    ],
)
def test_a_failed_try_is_retried_after_its_delay_or_stands(
    tries: int, reason: str | int | None, retry_after: float | None, verdict: Verdict
) -> None:
    got = policy().decide(tries, reason, retry_after, now=0.0)
    assert got.outcome == verdict.outcome
    assert got.delay == pytest.approx(verdict.delay)


def test_retries_past_the_budget_are_refused_but_connect_failures_never_are() -> None:
    rules = policy(percent=20, floor=0.1)  # one retry, plus one per five requests
    for _ in range(5):
        rules.budget.requested(now=0.0)
    verdicts = [rules.decide(1, 503, None, now=0.0).outcome for _ in range(4)]
    assert verdicts == ["retry", "retry", "budget", "budget"]
    assert rules.decide(1, "reset", None, now=0.0).outcome == "budget"
    assert rules.decide(1, "connect", None, now=0.0).outcome == "retry"  # the server saw nothing


def test_a_retry_never_sent_gives_its_budget_share_back() -> None:
    rules = policy(percent=0, floor=0.1)  # one retry in the window
    first = rules.decide(1, 503, None, now=1.0)
    assert first.outcome == "retry"
    assert rules.decide(1, 503, None, now=1.5).outcome == "budget"
    rules.unsent(first)  # its wait was cancelled: the client left
    assert rules.decide(1, 503, None, now=2.0).outcome == "retry"
    assert rules.decide(1, 503, None, now=2.0).outcome == "budget"


def test_a_connect_retry_never_sent_gives_back_nothing_it_did_not_take() -> None:
    rules = policy(percent=0, floor=0.1)
    connect = rules.decide(1, "connect", None, now=0.0)
    assert (connect.outcome, connect.spent_at) == ("retry", None)
    assert rules.decide(1, 503, None, now=0.0).outcome == "retry"
    rules.unsent(connect)
    assert rules.decide(1, 503, None, now=0.0).outcome == "budget"


def test_a_refund_after_its_slice_left_the_window_changes_nothing() -> None:
    budget = RetryBudget(percent=0, min_per_second=0.1, window=10, slices=10)  # one retry
    assert budget.spend(now=0.5) is True
    assert budget.spend(now=12.0) is True  # the retry of 0.5 has left the window
    budget.refund(spent_at=0.5)  # nothing of it is left to give back
    assert budget.spend(now=12.0) is False


@pytest.mark.parametrize(
    ("outcome", "falls_back"),
    [("retry", False), ("final", False), ("spent", True), ("budget", True), ("too_long", True)],
)
def test_a_fallback_takes_over_only_from_a_failure_retry_on_lists(
    outcome: str, falls_back: bool
) -> None:
    assert Verdict(outcome).falls_back is falls_back  # type: ignore[arg-type]
