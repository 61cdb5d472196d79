"""The census of what a proxy holds: what it reports as held, and its gauges."""

from __future__ import annotations

from proxy.observe.census import GAUGES, Census, UpstreamCensus


def census(**changes: object) -> Census:
    upstream = UpstreamCensus("u", 0, 0, 0, {"http://a": 0, "http://b": 0})
    fields: dict[str, object] = {
        "requests": 0, "children": 0, "streams": 0, "connections": 0, "idle": 3,
        "upstreams": (upstream,),
    }  # fmt: skip
    fields.update(changes)
    return Census(**fields)  # type: ignore[arg-type]


def test_an_idle_proxy_holds_nothing_though_it_keeps_idle_connections() -> None:
    assert census().held() == []


def test_held_names_every_count_that_is_not_zero() -> None:
    upstream = UpstreamCensus("u", 2, 1, 2, {"http://a": 0, "http://b": 2})
    held = census(requests=1, children=3, streams=1, connections=2, upstreams=(upstream,))
    assert held.held() == [
        "1 requests in flight",
        "3 fan-out children running",
        "1 fan-out streams open",
        "2 upstream connections checked out",
        "upstream u: 2 slots held",
        "upstream u: 1 children queued",
        "upstream u: 2 upstream requests in flight",
        "upstream u: replica http://b has 2 outstanding",
    ]


def test_gauges_are_the_documented_ones() -> None:
    gauges = census(requests=1, children=2, connections=3).gauges()
    assert set(gauges) == set(GAUGES)
    assert gauges == {
        "n_proxy_requests_in_flight": 1,
        "n_proxy_fanout_children": 2,
        "n_proxy_upstream_connections_in_use": 3,
        "n_proxy_upstream_connections_idle": 3,
    }
