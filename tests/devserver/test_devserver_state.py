"""Tests of the demo backend's request bookkeeping, as /debug/state shows it."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from proxy.devserver.state import HISTORY, DevState
from tests.support.servers import Backend

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


async def _state(http: aiohttp.ClientSession, backend: Backend) -> Any:
    async with http.get(backend.url + "/debug/state") as response:
        assert response.status == 200
        return await response.json()


async def test_debug_state_shows_a_request_active_then_under_exactly_one_outcome(
    http: aiohttp.ClientSession, backend: Backend
) -> None:
    """A request is active while it runs, then filed once under how it ended: a stream broken on
    purpose is "faulted", not also "finished" as its handler returns, nor "aborted" as its
    connection goes."""
    url = backend.url + CHAT
    endless = {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 10_000}
    endless.update(ignore_eos=True, x_demo={"token_delay": 0.01})
    async with http.post(url, json=endless, headers={"X-Request-Id": "left"}) as response:
        assert response.status == 200
        await response.content.readline()  # generating now
        assert await _state(http, backend) == {
            "active": ["left"], "finished": [], "aborted": [], "faulted": [],
        }  # fmt: skip
    await backend.state.wait_for(lambda s: "left" in s.aborted)  # the client left

    done = {"model": "m", "messages": MESSAGES, "max_tokens": 2}
    async with http.post(url, json=done, headers={"X-Request-Id": "done"}) as response:
        assert response.status == 200
        await response.read()

    broken = {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 8}
    broken["x_demo"] = {"fault": "reset_mid_stream", "after_tokens": 2}
    async with http.post(url, json=broken, headers={"X-Request-Id": "broken"}) as response:
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    await backend.state.wait_for(lambda s: "broken" in s.faulted)
    assert await _state(http, backend) == {
        "active": [], "finished": ["done"], "aborted": ["left"], "faulted": ["broken"],
    }  # fmt: skip


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


async def test_metrics_show_the_most_requests_that_generated_at_once(
    http: aiohttp.ClientSession, backend: Backend
) -> None:
    url = backend.url + CHAT
    endless = {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 10_000}
    endless.update(ignore_eos=True, x_demo={"token_delay": 0.01})
    async with http.post(url, json=endless) as one, http.post(url, json=endless) as two:
        assert (one.status, two.status) == (200, 200)
        await backend.state.wait_for(lambda s: len(s.active) == 2)
    await backend.state.wait_for(lambda s: not s.active)  # both clients left
    async with http.post(url, json={"model": "m", "messages": MESSAGES}) as three:
        await three.read()
    async with http.get(backend.url + "/metrics") as response:
        text = await response.text()
    assert "devserver_requests_running 0\n" in text
    assert "devserver_requests_peak 2\n" in text
