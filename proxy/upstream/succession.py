"""A reload's succession (docs/operating.md#reload): each upstream of a new config takes over the
line and replicas of the same upstream in the configs still serving. ``Upstreams`` does it; this
module is the bookkeeping."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from proxy.upstream.state import UpstreamState

States = Mapping[str, UpstreamState]  # one config's upstreams by name


def newest(earlier: Iterable[States]) -> dict[str, UpstreamState]:
    """The newest state of each upstream name in ``earlier`` (given newest first). Every live
    config that names an upstream shares its line, so any would do; the newest has the replicas
    discovery found last."""
    found: dict[str, UpstreamState] = {}
    for states in earlier:
        for name, state in states.items():
            found.setdefault(name, state)
    return found


def hand_over(states: States, earlier: Iterable[States]) -> None:
    """``states`` serve from now on: each line they name takes their limits (``Slots.resize``)."""
    for state in states.values():
        state.slots.resize(state.upstream.max_concurrency, state.upstream.max_queue)
