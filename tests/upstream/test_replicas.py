"""The replica set's state machine, literal in and out: placement, retries, ejection, discovery."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.upstream.replicas import (
    Address,
    Change,
    Ejection,
    Placement,
    ReplicaSet,
    resolved_addresses,
)

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"
PACK = Placement(pack=None)
LEAST = Placement(choose="least_outstanding")


class Draws(random.Random):
    """The second choice of ``least_outstanding``, drawn from a list instead of at random."""

    def __init__(self, *draws: int) -> None:
        super().__init__()
        self.draws = list(draws)

    def randrange(self, stop: int, *args: object, **kwargs: object) -> int:  # type: ignore[override]
        draw = self.draws.pop(0)
        assert 0 <= draw < stop
        return draw


def busy(replicas: ReplicaSet, **outstanding: int) -> ReplicaSet:
    """``busy(replicas, a=2)``: replica ``http://a:8000`` has two requests in flight."""
    for name, count in outstanding.items():
        replica = replicas.get(f"http://{name}:8000")
        assert replica is not None
        replica.outstanding = count
    return replicas


def test_spread_rotates_children_over_every_replica() -> None:
    replicas = ReplicaSet([A, B, C])
    assert replicas.place(4, now=0) == [A, B, C, A]
    assert replicas.place(2, now=0) == [B, C]
    assert replicas.place(1, now=0) == [C]


def test_pack_puts_a_request_on_one_replica_and_rotates_requests() -> None:
    replicas = ReplicaSet([A, B], placement=PACK)
    assert replicas.place(3, now=0) == [A, A, A]
    assert replicas.place(3, now=0) == [B, B, B]


@pytest.mark.parametrize("placement", [Placement(), PACK, LEAST, Placement(pack=2)])
def test_placement_skips_an_unhealthy_replica(placement: Placement) -> None:
    replicas = ReplicaSet([A, B], placement=placement)
    replicas.checked(B, ok=False)
    assert [replicas.place(2, now=0) for _ in range(3)] == [[A, A]] * 3


def test_no_usable_replica_fails_open_to_all_of_them() -> None:
    replicas = ReplicaSet([A, B])
    replicas.checked(A, ok=False)
    replicas.checked(B, ok=False)
    assert replicas.place(2, now=0) == [A, B]


@pytest.mark.parametrize(
    ("placement", "counts", "expected"),
    [
        (LEAST, (4, 2), [[A, B, C, A], [B, C]]),  # at equal load: round-robin
        (Placement(pack=2), (5, 2), [[A, A, B, B, C], [B, B]]),
        (Placement(choose="least_outstanding", pack=3), (4, 2), [[A, A, A, B], [B, B]]),
    ],
)
def test_idle_replicas_are_placed_in_turn_whatever_the_placement(
    placement: Placement, counts: tuple[int, ...], expected: list[list[str]]
) -> None:
    replicas = ReplicaSet([A, B, C], placement=placement)
    assert [replicas.place(count, now=0) for count in counts] == expected


def test_least_outstanding_takes_the_less_busy_of_its_turn_and_a_random_other() -> None:
    replicas = busy(ReplicaSet([A, B, C], placement=LEAST, rng=Draws(0, 1)), a=3, b=1)
    # A's turn, drawn B (position 0 of the others): B is less busy
    assert replicas.place(1, now=0) == [B]
    # B's turn, drawn C (position 1 of the others, A and C): C is idle
    assert replicas.place(1, now=0) == [C]


def test_least_outstanding_keeps_its_turn_on_a_tie_and_counts_its_own_children() -> None:
    replicas = busy(ReplicaSet([A, B], placement=LEAST, rng=Draws(0, 0, 0, 0)), a=2)
    # B twice (A is busier), then A and B are even at 2: the turn (A's, then B's) wins
    assert replicas.place(4, now=0) == [B, B, A, B]


def test_least_outstanding_avoids_a_busy_replica_whatever_the_draw() -> None:
    replicas = busy(ReplicaSet([A, B], placement=LEAST), a=10)
    assert [replicas.place(1, now=0) for _ in range(6)] == [[B]] * 6


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (1, [A]),
        (4, [A, A, A, A]),
        (5, [A, A, A, A, B]),
        (9, [A, A, A, A, B, B, B, B, A]),  # two replicas: the third group on the less busy
    ],
)
def test_pack_k_puts_up_to_k_children_of_a_request_on_each_replica(
    count: int, expected: list[str]
) -> None:
    draws = Draws(*[0] * count)
    replicas = ReplicaSet([A, B], placement=Placement("least_outstanding", pack=4), rng=draws)
    assert replicas.place(count, now=0) == expected


def test_pack_k_sends_each_group_to_the_less_busy_replica() -> None:
    replicas = busy(ReplicaSet([A, B, C], placement=Placement("least_outstanding", pack=2)), a=9)
    replicas.rng = Draws(0, 1, 1)
    # A's turn, drawn B: B. B's turn (1), drawn C: C at 0 beats B at 2. C's turn, drawn B: tie.
    assert replicas.place(6, now=0) == [B, B, C, C, C, C]


def test_a_retry_takes_the_less_busy_of_the_untried_replicas() -> None:
    replicas = busy(ReplicaSet([A, B, C], placement=LEAST, rng=Draws(0, 0)), b=5)
    assert replicas.retry_to([A], now=0) == C  # B's turn, drawn C
    assert replicas.retry_to([A], now=0) == C  # C's turn, drawn B


def test_consecutive_failures_eject_for_the_configured_time() -> None:
    replicas = ReplicaSet([A, B], Ejection(failures=3, seconds=10))
    assert [replicas.failed(B, now=1) for _ in range(3)] == [False, False, True]
    assert replicas.place(2, now=5) == [A, A]
    assert replicas.failed(B, now=6) is False  # a late failure does not extend the ejection
    assert sorted(replicas.place(2, now=11)) == [A, B]  # back after eject.seconds
    assert replicas.failed(B, now=12) is False  # the count started again from zero


def test_a_success_resets_the_failure_count() -> None:
    replicas = ReplicaSet([A, B], Ejection(failures=2, seconds=10))
    assert replicas.failed(B, now=0) is False
    replicas.succeeded(B)
    assert replicas.failed(B, now=0) is False
    assert replicas.failed(B, now=0) is True


def test_zero_failures_never_ejects() -> None:
    replicas = ReplicaSet([A, B], Ejection(failures=0, seconds=10))
    assert not any(replicas.failed(B, now=0) for _ in range(100))
    assert replicas.place(2, now=0) == [A, B]


def test_a_passing_health_check_ends_an_ejection_at_once() -> None:
    replicas = ReplicaSet([A, B], Ejection(failures=1, seconds=10))
    assert replicas.failed(B, now=0) is True
    assert replicas.place(2, now=1) == [A, A]
    replicas.checked(B, ok=True)
    assert replicas.place(2, now=1) == [B, A]


def test_a_failing_check_keeps_the_replica_out_until_one_passes() -> None:
    replicas = ReplicaSet([A, B])
    replicas.checked(A, ok=False)
    assert replicas.place(1, now=100) == [B]
    replicas.checked(A, ok=True)
    assert sorted(replicas.place(2, now=100)) == [A, B]


def test_a_retry_prefers_a_usable_replica_it_has_not_tried() -> None:
    replicas = ReplicaSet([A, B, C])
    replicas.checked(C, ok=False)
    assert {replicas.retry_to([A], now=0) for _ in range(4)} == {B}
    assert {replicas.retry_to([A, B], now=0) for _ in range(4)} == {A, B}  # usable, tried
    replicas.checked(A, ok=False)
    replicas.checked(B, ok=False)
    assert replicas.retry_to([A, B], now=0) == C  # none usable: one not tried yet
    assert replicas.retry_to([A, B, C], now=0) == C  # the last one tried


def test_a_single_replica_retries_on_itself() -> None:
    replicas = ReplicaSet([A], Ejection(failures=1, seconds=10))
    assert replicas.failed(A, now=0) is True
    assert replicas.retry_to([A], now=0) == A
    assert replicas.place(1, now=0) == [A]  # ejected, but fail open


def test_a_retry_goes_to_a_current_replica_when_discovery_dropped_the_tried_one() -> None:
    replicas = ReplicaSet(["http://svc:8000"])
    x, y = Address("http://10.0.0.1:8000"), Address("http://10.0.0.2:8000")
    replicas.discovered("http://svc:8000", [x, y])
    replicas.checked(x.url, ok=False)
    replicas.checked(y.url, ok=False)
    replicas.discovered("http://svc:8000", [y])
    assert replicas.retry_to([x.url, y.url], now=0) == y.url
    assert replicas.retry_to(["http://svc:8000"], now=0) == y.url


def test_discovery_adds_and_removes_replicas_and_keeps_state_of_the_rest() -> None:
    replicas = ReplicaSet(["http://svc:8000"])
    x, y, z = (Address(f"http://10.0.0.{i}:8000", "svc:8000") for i in (1, 2, 3))
    assert replicas.discovered("http://svc:8000", [x, y]) == Change(
        added=(x.url, y.url), removed=("http://svc:8000",)
    )
    replicas.checked(y.url, ok=False)
    assert replicas.discovered("http://svc:8000", [y, z]) == Change(
        added=(z.url,), removed=(x.url,)
    )
    assert replicas.urls == [y.url, z.url]
    replica = replicas.get(y.url)
    assert replica is not None
    assert (replica.healthy, replica.host) == (False, "svc:8000")
    assert replicas.place(2, now=0) == [z.url, z.url]


def test_an_empty_answer_keeps_the_last_known_replicas() -> None:
    replicas = ReplicaSet(["http://svc:8000"])
    x = Address("http://10.0.0.1:8000", "svc:8000")
    replicas.discovered("http://svc:8000", [x])
    assert replicas.discovered("http://svc:8000", []) == Change()
    assert replicas.urls == [x.url]


def test_each_source_keeps_its_own_addresses() -> None:
    replicas = ReplicaSet(["http://a:1", "http://b:2"])
    replicas.discovered("http://a:1", [Address("http://10.0.0.1:1", "a:1")])
    assert replicas.urls == ["http://10.0.0.1:1", "http://b:2"]
    assert replicas.discovered("http://unknown:1", [Address("http://x:1")]) == Change()


def test_a_removed_replica_ignores_late_outcomes() -> None:
    replicas = ReplicaSet(["http://svc:8000"], Ejection(failures=1, seconds=10))
    replicas.discovered("http://svc:8000", [Address("http://10.0.0.1:8000")])
    assert replicas.failed("http://svc:8000", now=0) is False
    replicas.succeeded("http://svc:8000")
    replicas.checked("http://svc:8000", ok=False)
    assert replicas.urls == ["http://10.0.0.1:8000"]


# --- a reload carries the replicas over (docs/operating.md#reload) ---------------------------


def test_a_reload_keeps_the_state_of_the_replicas_that_stay_and_starts_new_ones_fresh() -> None:
    before = ReplicaSet([A, B], Ejection(failures=1, seconds=10))
    busy(before, a=2)
    before.checked(B, ok=False)
    after = ReplicaSet([B, C])
    after.carry(before, resolved=False)
    assert after.urls == [B, C]
    assert after.get(B) is before.get(B)  # one replica: its requests in flight count in both
    assert [(r.url, r.healthy, r.outstanding) for r in after] == [(B, False, 0), (C, True, 0)]
    assert after.place(2, now=0) == [C, C]  # the dead one stays out, not optimistic again


def test_a_reload_keeps_the_addresses_discovery_found_while_it_goes_on() -> None:
    x, y = (Address(f"http://10.0.0.{i}:8000", "svc:8000") for i in (1, 2))
    before = ReplicaSet(["http://svc:8000", A])
    before.discovered("http://svc:8000", [x, y])
    before.checked(y.url, ok=False)
    resolved = ReplicaSet(["http://svc:8000"])
    resolved.carry(before, resolved=True)
    assert resolved.urls == [x.url, y.url]
    assert resolved.get(y.url) is before.get(y.url)
    assert resolved.discovered("http://svc:8000", [y]) == Change(removed=(x.url,))
    plain = ReplicaSet(["http://svc:8000"])  # discovery off now: the URL itself, fresh
    plain.carry(before, resolved=False)
    assert [(r.url, r.host, r.healthy) for r in plain] == [("http://svc:8000", None, True)]


@pytest.mark.parametrize(
    ("url", "ips", "expected"),
    [
        (
            "http://svc.ns.svc:8000",
            ["10.0.0.1", "10.0.0.2", "10.0.0.1"],
            [
                Address("http://10.0.0.1:8000", "svc.ns.svc:8000"),
                Address("http://10.0.0.2:8000", "svc.ns.svc:8000"),
            ],
        ),
        ("https://svc/v1", ["fd00::1"], [Address("https://[fd00::1]/v1", "svc")]),
        (
            "http://user@svc:80/base",
            ["10.1.2.3"],
            [Address("http://user@10.1.2.3:80/base", "svc:80")],
        ),
    ],
)
def test_resolved_addresses_keep_scheme_port_path_and_the_host_name(
    url: str, ips: list[str], expected: list[Address]
) -> None:
    assert list(resolved_addresses(url, ips)) == expected


# --- any sequence of events keeps placement within the rules -----------------------------------

POOL = [f"http://10.0.0.{i}:8000" for i in range(5)]
_url = st.sampled_from(POOL)
_event = st.one_of(
    st.tuples(st.just("failed"), _url),
    st.tuples(st.just("succeeded"), _url),
    st.tuples(st.just("checked"), _url, st.booleans()),
    st.tuples(st.just("discovered"), st.lists(_url, max_size=5)),
    st.tuples(st.just("tick"), st.floats(0, 20)),
)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(_event, max_size=40),
    failures=st.integers(0, 3),
    placement=st.sampled_from([Placement(), PACK, LEAST, Placement("least_outstanding", 2)]),
    outstanding=st.lists(st.integers(0, 3), min_size=5, max_size=5),
    tried=st.lists(_url, max_size=4),
)
def test_placement_and_retries_keep_the_rules_after_any_events(
    events: list[tuple[object, ...]],
    failures: int,
    placement: Placement,
    outstanding: list[int],
    tried: list[str],
) -> None:
    replicas = ReplicaSet(["http://svc:8000"], Ejection(failures, seconds=5), placement)
    now = 0.0
    for event in events:
        match event:
            case ("failed", url):
                replicas.failed(str(url), now)
            case ("succeeded", url):
                replicas.succeeded(str(url))
            case ("checked", url, ok):
                replicas.checked(str(url), bool(ok))
            case ("discovered", urls):
                assert isinstance(urls, list)
                replicas.discovered("http://svc:8000", [Address(u, "svc:8000") for u in urls])
            case ("tick", seconds):
                assert isinstance(seconds, float)
                now += seconds
        for replica in replicas:
            replica.outstanding = outstanding[POOL.index(replica.url)] if replica.url in POOL else 0
        current = set(replicas.urls)
        assert current  # never empty: an empty answer keeps the last set
        usable = {r.url for r in replicas if r.usable(now)}
        if failures == 0:
            assert usable == {r.url for r in replicas if r.healthy}  # nothing is ever ejected
        placed = replicas.place(3, now)
        assert len(placed) == 3
        assert set(placed) <= (usable or current)  # only usable ones, or all when none is
        if placement.pack is None:
            assert len(set(placed)) == 1
        if placement.pack == 2:
            assert placed[0] == placed[1]  # a group stays together
        retry = replicas.retry_to(tried, now)
        assert retry in current
        if usable - set(tried):
            assert retry in usable - set(tried)
        elif usable:
            assert retry in usable


@pytest.mark.parametrize("placement", [Placement(), PACK, LEAST, Placement(pack=3)])
def test_no_children_place_nothing(placement: Placement) -> None:
    assert ReplicaSet([A, B], placement=placement).place(0, now=0) == []
