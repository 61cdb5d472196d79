"""The request record: each step writes its facts once, then tells only the observers that watch
that step; the numbers the observers read (overhead, first chunk, replicas) come from it alone."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import aiohttp
import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from proxy.config.models import single_upstream_config
from proxy.observe.record import (
    ChildRecord,
    LargeRequest,
    Observer,
    Observers,
    RequestRecord,
)
from proxy.observe.tracing import Tracing
from tests.support.logs import LogCapture
from tests.support.ports import free_port
from tests.support.servers import Backend, Servers, with_upstream

CHAT = "/v1/chat/completions"


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

    def counted(self, record: RequestRecord) -> None:
        self.steps.append(("counted", record.status, record.ended_at))

    def ended(self, record: RequestRecord) -> None:
        self.steps.append(("ended", record.status))


def test_only_the_steps_an_observer_overrides_are_gathered() -> None:
    seen = Seen()
    observers = Observers([seen, Observer()])
    assert observers.begun == (seen.begun,)
    assert observers.sent == (seen.sent,)
    assert observers.head == (seen.head,)
    assert observers.counted == (seen.counted,)
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
    assert seen.steps[-2:] == [("counted", 200, record.ended_at), ("ended", 200)]
    assert record.seconds >= 0


def test_a_request_is_counted_once_before_it_ends_or_as_it_ends() -> None:
    """``counted`` takes the end time and tells the observers that count; ``ended`` counts a
    request nothing counted before, and never counts one twice."""
    seen = Seen()
    early = RequestRecord(Observers([seen]), "POST", "/v1/completions", {})
    early.status = 200
    early.counted()
    counted_at = early.ended_at
    assert counted_at > 0
    early.status = 499  # a status set after the count is the end's, not counted again
    early.counted()
    early.ended()
    assert seen.steps[1:] == [("counted", 200, counted_at), ("ended", 499)]
    assert early.ended_at == counted_at


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


async def test_the_log_line_the_metrics_and_the_spans_of_one_fan_out_agree_on_every_shared_fact(
    servers: Servers, backend: Backend, http: aiohttp.ClientSession, request_log: LogCapture
) -> None:
    """All three are observers of one record: the same request read three ways gives the same
    status, route, upstream, n, children, replicas, retries, duration and first chunk."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dead = f"http://127.0.0.1:{free_port()}"  # refused: children placed there are retried
    config = with_upstream(single_upstream_config(backend.url), urls=(dead, backend.url))
    proxy = await servers.proxy(config, tracing=Tracing(provider))
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "n": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 5,
    }
    async with http.post(proxy.url + CHAT, json=body, headers={"X-Request-Id": "agree"}) as r:
        assert r.status == 200
        await r.read()
    await request_log.wait_for(1)
    (line,) = request_log.lines
    spans = exporter.get_finished_spans()
    (server,) = [s for s in spans if s.kind == SpanKind.SERVER]
    children = sorted(
        (s for s in spans if s.kind == SpanKind.CLIENT),
        key=lambda s: int(str((s.attributes or {})["n_proxy.child_index"])),
    )
    facts = dict(server.attributes or {})
    labels = {"route": CHAT, "fanned_out": "true"}

    assert line["request_id"] == "agree"
    assert line["status"] == facts["http.response.status_code"] == 200
    assert proxy.metric("n_proxy_requests_total", status="200", **labels) == 1
    assert line["route"] == facts["http.route"] == CHAT
    assert line["upstream"] == facts["n_proxy.upstream"] == "default"
    assert line["n"] == facts["n_proxy.n"] == proxy.metric("n_proxy_request_n_sum") == 3
    assert line["children"] == facts["n_proxy.children"] == len(children) == 3
    assert proxy.metric("n_proxy_upstream_responses_total", outcome="2xx") == 3
    spent = [int(str((s.attributes or {})["n_proxy.retries"])) for s in children]
    assert line["retries"] == sum(spent) == proxy.metric("n_proxy_retries_total")
    assert {str((s.attributes or {})["n_proxy.replica"]) for s in children} == {backend.url}
    assert line["replica"] == backend.url
    duration = proxy.metric("n_proxy_request_duration_seconds_sum", **labels)
    assert line["duration_ms"] == round(duration * 1000, 3)
    first_chunk = proxy.metric("n_proxy_time_to_first_chunk_seconds_sum", **labels)
    assert line["ttft_ms"] == round(first_chunk * 1000, 3)
    provider.shutdown()


@pytest.mark.parametrize("fanned_out", [False, True], ids=["pass-through", "fan-out"])
def test_a_passed_through_answers_usage_is_read_from_its_tail_as_it_is_counted(
    fanned_out: bool,
) -> None:
    """A pass-through's usage, id and model come from the answer's last bytes; a fan-out's are
    its stitcher's, set before, and its tail (a stream's last bytes) is not read."""
    record = RequestRecord(Observers([]), "POST", "/v1/chat/completions", {})
    record.fanned_out = fanned_out
    stitched = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    if fanned_out:
        record.usage = stitched
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    record.tail = orjson.dumps({"id": "c-1", "model": "m", "usage": usage})
    record.counted()
    if fanned_out:
        assert (record.usage, record.response_id, record.response_model) == (stitched, None, None)
    else:
        assert (record.usage, record.response_id, record.response_model) == (usage, "c-1", "m")
