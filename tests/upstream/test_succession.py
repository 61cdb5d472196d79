"""A reload's succession between two configs' upstreams, without servers: which line and
replicas a new config takes over, who counts an ejection afterwards, which series go."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.config.models import Clients, Config, Eject, Upstream
from proxy.core.errors import ClientLimited
from proxy.observe.metrics import Metrics
from proxy.upstream.service import Upstreams
from proxy.upstream.succession import gone, newest

A, B, C = "http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11"  # never dialled


def config(*upstreams: tuple[str, tuple[str, ...], int]) -> Config:
    """Upstreams as ``(name, urls, max_concurrency)``; one failure ejects a replica."""
    listed = tuple(
        Upstream(name=name, urls=urls, max_concurrency=limit, eject=Eject(failures=1))
        for name, urls, limit in upstreams
    )
    return Config(upstreams=listed)


def series(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample /metrics shows, by name and labels."""
    text = metrics.render().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def naming(metrics: Metrics, label: str, value: str) -> list[str]:
    return sorted({name for name, labels in series(metrics) if (label, value) in labels})


async def test_a_new_config_takes_over_the_newest_line_of_each_upstream_it_names() -> None:
    metrics = Metrics()
    first = Upstreams(config(("a", (A,), 1), ("b", (B,), 1)), metrics)
    second = Upstreams(config(("a", (A,), 1)), metrics, earlier=[first])
    third = Upstreams(config(("a", (A,), 4), ("b", (B,), 2)), metrics, earlier=[second, first])
    lines = newest(u._states for u in (second, first))
    assert {name: state.slots for name, state in lines.items()} == {
        "a": second._states["a"].slots, "b": first._states["b"].slots,
    }  # fmt: skip
    assert third._states["a"].slots is first._states["a"].slots  # one line since the first
    assert third._states["b"].slots is first._states["b"].slots  # dropped, named again
    assert third._states["a"].slots.capacity == 1  # resized at the hand-over, not before
    third.take_over([second, first])
    assert (lines["a"].slots.capacity, lines["b"].slots.capacity) == (4, 2)


async def test_a_clients_children_count_against_one_cap_through_reloads() -> None:
    """clients.max_children holds across configs: the places a client took under the old one
    count in the new one, and a slot kept for it there is still its own."""
    capped = config(("a", (A,), 2)).model_copy(update={"clients": Clients(max_children=2)})
    metrics = Metrics()
    old = Upstreams(capped, metrics)
    (upstream,) = old.config.upstreams
    tickets = old.admit(upstream, 2, "client")
    new = Upstreams(capped, metrics, earlier=[old])
    new.take_over([old])
    assert new.tabs is old.tabs
    with pytest.raises(ClientLimited):
        new.admit(new.config.upstreams[0], 1, "client")
    tickets.release()
    new.admit(new.config.upstreams[0], 2, "client").release()
    assert new.tabs == {}


async def test_an_ejection_by_an_old_request_is_counted_by_the_config_that_serves_now() -> None:
    metrics = Metrics()
    old = Upstreams(config(("a", (A, B), 1)), metrics)
    new = Upstreams(config(("a", (A, C), 1)), metrics, earlier=[old])
    new.take_over([old])
    (upstream,) = old.config.upstreams
    old.state(upstream).failed(A)  # one replica in both: ejected for the new config's requests
    ejected = new.state(new.config.upstreams[0]).replicas.get(A)
    assert ejected is not None
    assert not ejected.usable(time.monotonic())
    found = series(metrics)
    assert found["n_proxy_replica_up", (("replica", A), ("upstream", "a"))] == 0
    assert found["n_proxy_ejections_total", (("replica", A), ("upstream", "a"))] == 1
    old.state(upstream).failed(B)  # a replica the new config dropped: no series comes back
    assert naming(metrics, "replica", B) == []


async def test_the_series_of_the_upstreams_and_replicas_a_reload_drops_go() -> None:
    metrics = Metrics()
    before = config(("a", (A, B), 1), ("b", (C,), 1))
    falling_back = before.upstreams[0].model_copy(update={"fallback": "b"})
    old = Upstreams(
        before.model_copy(update={"upstreams": (falling_back, *before.upstreams[1:])}), metrics
    )
    metrics.known(old.config)
    metrics.retries.labels("b", "503").inc()  # a label set no config names up front
    new = Upstreams(config(("a", (A,), 1)), metrics, earlier=[old])
    assert gone(new._states, old._states) == ({"b"}, {("a", B)})
    assert naming(metrics, "upstream", "b") == [
        "n_proxy_cached_tokens_total", "n_proxy_children_aborted_total",
        "n_proxy_client_limited_total", "n_proxy_completion_tokens_total",
        "n_proxy_ejections_total",
        "n_proxy_model_list_failures_total",
        "n_proxy_prompt_tokens_total",
        "n_proxy_queue_wait_seconds_bucket", "n_proxy_queue_wait_seconds_count",
        "n_proxy_queue_wait_seconds_sum", "n_proxy_reasoning_tokens_total",
        "n_proxy_rejected_total", "n_proxy_replica_up",
        "n_proxy_retries_refused_total", "n_proxy_retries_total", "n_proxy_slot_stalls_total",
        "n_proxy_upstream_duration_seconds_bucket", "n_proxy_upstream_duration_seconds_count",
        "n_proxy_upstream_duration_seconds_sum", "n_proxy_upstream_responses_total",
        "n_proxy_upstream_ttfb_seconds_bucket", "n_proxy_upstream_ttfb_seconds_count",
        "n_proxy_upstream_ttfb_seconds_sum",
    ]  # fmt: skip
    assert naming(metrics, "replica", B) == ["n_proxy_ejections_total", "n_proxy_replica_up"]
    assert naming(metrics, "fallback", "b") == ["n_proxy_fallbacks_total"]
    new.take_over([old])
    assert naming(metrics, "upstream", "b") == []
    assert naming(metrics, "fallback", "b") == []
    assert naming(metrics, "replica", B) == []
    assert naming(metrics, "replica", A) == ["n_proxy_ejections_total", "n_proxy_replica_up"]
