"""A reload's succession (docs/operating.md#reload): each upstream of a new config takes over the
line and replicas of the same upstream in the configs still serving, and the metric series that
only earlier configs name are let go. ``Upstreams`` does it; this module is the bookkeeping."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from proxy.upstream.state import UpstreamState, grace

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
    """``states`` serve from now on: each line they name takes their limits (``Slots.resize``),
    and every earlier state reports ejections to its successor, when there is one."""
    for state in states.values():
        upstream = state.upstream
        state.slots.resize(upstream.max_concurrency, upstream.max_queue, grace(upstream))
    for each in earlier:
        for name, state in each.items():
            state.current = states.get(name)


def gone(states: States, earlier: States) -> tuple[set[str], set[tuple[str, str]]]:
    """The upstreams and the (upstream, replica) pairs ``earlier`` names and ``states`` does not.
    A replica is named by a configured URL (its series exist from the start) or by an address
    DNS discovery found."""

    def pairs(of: States) -> set[tuple[str, str]]:
        return {
            (name, url)
            for name, state in of.items()
            for url in (*state.upstream.urls, *state.replicas.urls)
        }

    kept = pairs(states)
    replicas = {pair for pair in pairs(earlier) if pair[0] in states and pair not in kept}
    return set(earlier) - set(states), replicas
