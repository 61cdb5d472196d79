"""Tests of the demo backend's request bookkeeping."""

from __future__ import annotations

import pytest

from proxy.devserver.state import HISTORY, DevState


async def test_wait_for_raises_timeout_error() -> None:
    state = DevState()
    with pytest.raises(TimeoutError):
        await state.wait_for(lambda s: bool(s.finished), timeout=0.01)


async def test_history_lists_stay_bounded_for_long_demos() -> None:
    state = DevState()
    for k in range(2 * HISTORY + 1):
        state.record(f"r{k}", {}, {})
        state.begin(f"r{k}", {})
        state.end(f"r{k}", "finished")
    assert len(state.seen) == HISTORY
    assert len(state.finished) == HISTORY
    assert state.finished[-1] == f"r{2 * HISTORY}"
    assert state.seen[0][0] == f"r{HISTORY + 1}"
