"""The request record: each step writes its facts once, then tells only the observers that watch
that step; the numbers the observers read (overhead, first chunk, replicas) come from it alone."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import pytest

from proxy.observe.record import (
    ChildRecord,
    LargeRequest,
    Observer,
    Observers,
    RequestRecord,
)


class Seen(Observer):
    """Watches some steps only: the rest stay ``Observer``'s, and are never called."""

    def __init__(self) -> None:
        self.steps: list[tuple[Any, ...]] = []

    def begun(self, record: RequestRecord) -> None:
        self.steps.append(("begun", record.method))

    def sent(self, child: ChildRecord, headers: MutableMapping[str, str]) -> None:
        headers["traceparent"] = "mine"  # not sent yet: an observer may still add a header
        self.steps.append(("sent", child.index, child.replica))

    def head(self, child: ChildRecord) -> None:
        self.steps.append(("head", child.index, child.status))

    def ended(self, record: RequestRecord) -> None:
        self.steps.append(("ended", record.status))


def test_only_the_steps_an_observer_overrides_are_gathered() -> None:
    seen = Seen()
    observers = Observers([seen, Observer()])
    assert observers.begun == (seen.begun,)
    assert observers.sent == (seen.sent,)
    assert observers.head == (seen.head,)
    assert observers.ended == (seen.ended,)
    assert observers.admitted == ()
    assert observers.retry == ()
    assert observers.child_ended == ()


def test_each_step_writes_its_facts_then_tells_its_observers() -> None:
    seen = Seen()
    record = RequestRecord(Observers([seen]), "POST", "/v1/completions", {})
    assert seen.steps == [("begun", "POST")]
    first, second = record.child(0), record.child(1)
    assert record.children == [first, second]
    first.admitted(record.started)
    assert record.queued == first.queued >= 0
    second.admitted(record.started - 5)
    assert second.queued >= 5
    assert record.queued == first.queued  # the first child sent is the request's wait
    headers: dict[str, str] = {}
    first.sent("http://a", headers)
    assert headers == {"traceparent": "mine"}
    sent_at = first.sent_at
    assert record.sent_at == sent_at > 0
    first.retry("connect")
    first.sent("http://b", {})  # a retry: its replica, not a second start
    assert (first.retries, record.retries, first.replica, first.sent_at) == (
        1,
        1,
        "http://b",
        sent_at,
    )
    first.head(200)
    assert first.status == 200
    assert first.head_at >= sent_at
    first.ended(None)
    assert record.done_at == first.done_at >= first.head_at
    assert seen.steps[1:] == [("sent", 0, "http://a"), ("head", 0, 200)]
    record.status = 200
    record.ended()
    assert seen.steps[-1] == ("ended", 200)
    assert record.seconds >= 0


def test_overhead_is_the_time_before_the_first_try_less_the_queue_and_after_the_last_body() -> None:
    record = RequestRecord(Observers([]), "POST", "/v1/completions", {})
    assert record.overhead is None  # nothing went upstream: no overhead to speak of
    record.started = 100.0
    record.queued = 2.0
    record.sent_at = 102.5
    record.done_at = 110.0
    record.ended_at = 110.25
    assert record.overhead == 0.5  # relayed: the body left as it came
    record.relayed = False  # stitched: the time after the last upstream byte is the proxy's
    assert record.overhead == 0.75


def test_first_chunk_and_replicas_are_read_from_the_record() -> None:
    record = RequestRecord(Observers([]), "POST", "/v1/completions", {})
    assert record.first_chunk is None
    assert record.replicas() is None
    record.started = 10.0
    record.first_chunk_at = 10.25
    assert record.first_chunk == 0.25
    for replica in ("http://b", "http://a", "http://b", None):
        child = record.child(len(record.children))
        if replica is not None:
            child.sent(replica, {})
    assert record.replicas() == "http://b,http://a"  # each once, in child order


@pytest.mark.parametrize(
    ("body_bytes", "children", "called"),
    [(0, 1, False), (99, 2, False), (100, 0, True), (0, 3, True)],
)
def test_a_large_request_hook_sees_only_large_requests(
    body_bytes: int, children: int, called: bool
) -> None:
    ends: list[RequestRecord] = []
    observers = Observers([], large=LargeRequest(100, 3, ends.append))
    record = RequestRecord(observers, "POST", "/", {})
    record.bytes_in = body_bytes
    for i in range(children):
        record.child(i)
    record.ended()
    assert ends == ([record] if called else [])
