"""A reload's succession between two configs' upstreams, without servers: which line and
replicas a new config takes over."""

from __future__ import annotations

from proxy.config.models import Config, Eject, Upstream
from proxy.observe.metrics import Metrics
from proxy.upstream.service import Upstreams
from proxy.upstream.succession import newest

A, B, C = "http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11"  # never dialled


def config(*upstreams: tuple[str, tuple[str, ...], int]) -> Config:
    """Upstreams as ``(name, urls, max_concurrency)``; one failure ejects a replica."""
    listed = tuple(
        Upstream(name=name, urls=urls, max_concurrency=limit, eject=Eject(failures=1))
        for name, urls, limit in upstreams
    )
    return Config(upstreams=listed)


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
