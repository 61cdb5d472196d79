"""Clients told apart, served in turn and capped (docs/behaviour.md#admission,
docs/operating.md#clients): the id made of a request (proxy.request.clients), fair admission
over real servers, and ``clients.max_children``'s 429 and 400.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from proxy.config.models import Clients, Config
from proxy.request import clients
from proxy.request.clients import ClientIds, keyed_id
from tests.support.logs import LogCapture
from tests.support.polling import until
from tests.support.servers import Backend, Proxy, proxy_config, with_upstream

WITHIN = 30.0
CHAT = "/v1/chat/completions"
ENDLESS = {
    "model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True,
    "max_tokens": 100_000, "ignore_eos": True,
}  # fmt: skip
FLOOD = {"Authorization": "Bearer sk-flood-secret"}
VICTIM = {"Authorization": "Bearer sk-victim-secret"}


async def hold(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> None:
    """A stream held open until the task is cancelled: then its client leaves."""
    async with http.post(url, json=body, headers=headers) as response:
        assert response.status == 200
        await asyncio.Event().wait()


def request_from(peer: str | None = "10.0.0.9", **headers: str) -> Any:
    transport = mock.Mock()
    transport.get_extra_info.return_value = (peer, 40000) if peer else None
    return make_mocked_request("POST", CHAT, headers=headers, transport=transport)


# --- who a request is from --------------------------------------------------------------------


def test_by_authorization_a_client_is_a_keyed_hash_of_its_key_never_the_key() -> None:
    ids = ClientIds(Clients())
    first = ids.of(request_from(Authorization="Bearer sk-one"))
    assert len(first) == 16
    assert int(first, 16) >= 0
    assert "sk-one" not in first
    assert ids.of(request_from("10.0.0.8", Authorization="Bearer sk-one")) == first  # any peer
    assert ids.of(request_from(Authorization="Bearer sk-two")) != first
    assert first == keyed_id("Bearer sk-one")


def test_ids_remembered_are_the_ids_made_afresh_and_the_memory_is_bounded() -> None:
    """An id is made once per value and remembered; values are the clients' to choose, so past
    the bound the memory starts again, and every id is still the keyed hash of its value."""
    made = {f"Bearer sk-{i}": clients._keyed(f"Bearer sk-{i}") for i in range(700)}
    for _ in range(2):
        for value, expected in made.items():
            assert keyed_id(value) == expected
            assert len(clients._ids) <= 256
    assert keyed_id("Bearer sk-0") == made["Bearer sk-0"] != keyed_id("Bearer sk-1")


def test_by_authorization_a_request_without_one_is_its_peer_address() -> None:
    ids = ClientIds(Clients())
    assert ids.of(request_from("10.0.0.9")) == "10.0.0.9"
    assert ids.of(request_from(None)) == "unknown"


def test_by_peer_the_authorization_header_is_not_looked_at() -> None:
    ids = ClientIds(Clients(identify="peer"))
    assert ids.of(request_from("10.0.0.9", Authorization="Bearer sk-one")) == "10.0.0.9"


def test_by_header_the_last_value_the_load_balancer_added_counts() -> None:
    ids = ClientIds(Clients(identify="header", header="X-Forwarded-For"))
    forged = request_from("10.1.1.1", **{"X-Forwarded-For": "6.6.6.6, 192.0.2.7"})
    honest = request_from("10.1.1.1", **{"X-Forwarded-For": "192.0.2.7"})
    assert ids.of(forged) == ids.of(honest) == keyed_id("192.0.2.7")
    assert ids.of(request_from("10.1.1.1")) == "10.1.1.1"  # no header: the peer
    assert ids.of(request_from("10.1.1.1", **{"X-Forwarded-For": "6.6.6.6, "})) == "10.1.1.1"


# --- fair admission over real servers ---------------------------------------------------------


@pytest.mark.parametrize("admission", ["fair", "fifo"])
async def test_a_clients_child_behind_anothers_flood_of_fan_outs_gets_the_next_free_slot(
    admission: str,
    make_backend: Callable[..., Awaitable[Backend]],
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    http: aiohttp.ClientSession,
) -> None:
    """One client's streams fill max_concurrency 2 (an n = 1 and an n = 4) and queue seven
    children (that n = 4's three, and another n = 4); another client's n = 1 stream queues behind
    them. One slot comes free: fair admission gives it to the client holding none, first come
    first served to the flood's oldest child (the contrast)."""
    backend = await make_backend(token_delay=0.005)
    config = with_upstream(proxy_config(backend), max_concurrency=2, admission=admission)
    proxy = await make_proxy(config)
    slots = proxy.pool.state(proxy.upstream).slots

    def flood(name: str, n: int) -> asyncio.Task[None]:
        headers = {**FLOOD, "X-Request-Id": name}
        return asyncio.create_task(hold(http, proxy.url + CHAT, {**ENDLESS, "n": n}, headers))

    def active(name: str) -> list[str]:
        return [rid for rid in backend.state.active if rid.endswith(name)]

    first = flood("one", 1)
    await backend.state.wait_for(lambda s: len(active("one")) == 1, WITHIN)
    clients = [first, flood("four", 4)]
    await until(lambda: slots.queued == 3, 30.0)
    clients.append(flood("more", 4))
    await until(lambda: slots.queued == 7, 30.0)
    clients.append(
        asyncio.create_task(hold(http, proxy.url + CHAT, {**ENDLESS, "seed": 999}, VICTIM))
    )
    await until(lambda: slots.queued == 8, 30.0)
    try:
        first.cancel()  # one slot comes free
        await backend.state.wait_for(lambda s: len(s.active) == 2 and not active("one"), WITHIN)
        victim_started = any(body.get("seed") == 999 for body in backend.state.active.values())
        assert victim_started == (admission == "fair")
        assert len(active("four")) == (1 if admission == "fair" else 2)
        assert slots.queued == 7
    finally:
        for client in clients:
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)


@pytest.mark.parametrize("grace", [30.0, 0.0])
async def test_a_client_sending_one_request_after_another_keeps_its_slot_between_them(
    grace: float,
    make_backend: Callable[..., Awaitable[Backend]],
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    http: aiohttp.ClientSession,
) -> None:
    """A flood holds both slots and queues more; a victim's short request gets the slot one of
    the flood's streams gives back. When it ends, the victim holds fewer slots than the flood
    that waits: its slot is kept for it for ``return_grace``, and its next request, sent after
    the answer, starts at once. With no grace the slot goes to the flood, and the next request
    waits behind it (the contrast: this is what made a sequential client wait)."""
    backend = await make_backend(token_delay=0.005)
    config = with_upstream(proxy_config(backend), max_concurrency=2, return_grace=grace)
    proxy = await make_proxy(config)
    slots = proxy.pool.state(proxy.upstream).slots
    flood = [asyncio.create_task(hold(http, proxy.url + CHAT, {**ENDLESS, "n": 4}, FLOOD))]
    await until(lambda: slots.queued == 2, 30.0)
    short = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    victim = asyncio.create_task(http.post(proxy.url + CHAT, json=short, headers=VICTIM))
    await until(lambda: slots.queued == 3, 30.0)
    flood.append(asyncio.create_task(hold(http, proxy.url + CHAT, {**ENDLESS, "n": 4}, FLOOD)))
    await until(lambda: slots.queued == 7, 30.0)
    try:
        flood[0].cancel()  # its two slots come free: one to the victim, one to the other stream
        async with await victim as answer:
            assert answer.status == 200
            await answer.read()
        second = asyncio.create_task(http.post(proxy.url + CHAT, json=short, headers=VICTIM))
        if grace:
            async with await second as answer:  # no slot was freed: it started on the kept one
                assert answer.status == 200
                await answer.read()
            assert (slots.queued, slots.kept) == (3, 1)  # the flood still waits; kept again
        else:
            await until(lambda: slots.queued == 3, 30.0)  # behind the flood's two waiting children
            await asyncio.sleep(0.2)
            assert not second.done()
            second.cancel()
    finally:
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)


# --- clients.max_children ---------------------------------------------------------------------


async def capped(
    make_backend: Callable[..., Awaitable[Backend]],
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    cap: int,
    **upstream: Any,
) -> tuple[Backend, Proxy]:
    backend = await make_backend(token_delay=0.005)
    config = proxy_config(backend, clients=Clients(max_children=cap))
    return backend, await make_proxy(with_upstream(config, **upstream) if upstream else config)


def short(n: int = 1, **fields: Any) -> dict[str, Any]:
    return {**ENDLESS, "stream": False, "max_tokens": 2, "n": n, **fields}


async def test_a_client_at_max_children_gets_429_with_retry_after_and_an_openai_body(
    make_backend: Callable[..., Awaitable[Backend]],
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    http: aiohttp.ClientSession,
) -> None:
    backend, proxy = await capped(make_backend, make_proxy, 4)
    held = asyncio.create_task(hold(http, proxy.url + CHAT, {**ENDLESS, "n": 4}, FLOOD))
    try:
        await backend.state.wait_for(lambda s: len(s.active) == 4, WITHIN)
        async with http.post(proxy.url + CHAT, json=short(), headers=FLOOD) as refused:
            assert refused.status == 429
            assert refused.headers["Retry-After"] == "1"
            error = (await refused.json())["error"]
        assert error["type"] == "rate_limit_error"
        assert error["code"] == "rate_limit_exceeded"
        assert error["param"] is None
        assert "4 upstream requests queued or running" in error["message"]
        assert "at most 4" in error["message"]
        assert proxy.metric("n_proxy_client_limited_total", upstream="default") == 1
        async with http.post(proxy.url + CHAT, json=short(), headers=VICTIM) as other:
            assert other.status == 200  # the cap is each client's own
    finally:
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
    await until(lambda: not proxy.pool.tabs, 30.0)
    async with http.post(proxy.url + CHAT, json=short(4), headers=FLOOD) as again:
        assert again.status == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, short(4), "n"),
        (
            "/v1/completions",
            {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 2},
            "prompt",
        ),
    ],
)
async def test_a_request_needing_more_children_than_max_children_is_400_not_a_429(
    path: str,
    body: dict[str, Any],
    param: str,
    make_backend: Callable[..., Awaitable[Backend]],
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    http: aiohttp.ClientSession,
) -> None:
    backend, proxy = await capped(make_backend, make_proxy, 3)
    async with http.post(proxy.url + path, json=body, headers=FLOOD) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert "at most 3" in error["message"]
    assert not backend.state.seen  # nothing went upstream
    assert proxy.metric("n_proxy_client_limited_total") == 0


@pytest.mark.parametrize("end", ["completes", "client_leaves", "a_child_fails"])
async def test_children_count_against_max_children_until_their_places_are_released(
    end: str,
    make_backend: Callable[..., Awaitable[Backend]],
    make_proxy: Callable[[Config], Awaitable[Proxy]],
    http: aiohttp.ClientSession,
) -> None:
    """Running or queued, a child counts from admission until its place goes back, however its
    request ended; then the client may use its whole cap again."""
    backend, proxy = await capped(make_backend, make_proxy, 4, max_concurrency=2)
    tabs = proxy.pool.tabs
    if end == "client_leaves":
        leaving = asyncio.create_task(hold(http, proxy.url + CHAT, {**ENDLESS, "n": 4}, FLOOD))
        await backend.state.wait_for(lambda s: len(s.active) == 2, WITHIN)
        assert [tab.places for tab in tabs.values()] == [4]  # two running, two queued
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
    else:
        fault = (
            {"x_demo": {"only_seed": 8, "fault": "status_500"}} if end == "a_child_fails" else {}
        )
        async with http.post(proxy.url + CHAT, json=short(4, seed=5, **fault), headers=FLOOD) as r:
            assert r.status == (500 if fault else 200)
    await until(lambda: not tabs, 30.0)
    async with http.post(proxy.url + CHAT, json=short(4), headers=FLOOD) as again:
        assert again.status == 200


# --- the request's log line -------------------------------------------------------------------


async def test_the_request_line_names_the_client_by_its_id_and_no_line_holds_the_key(
    proxy: Proxy, http: aiohttp.ClientSession, request_log: LogCapture
) -> None:
    async with http.post(proxy.url + CHAT, json=short(2), headers=VICTIM) as response:
        assert response.status == 200
    async with http.post(proxy.url + CHAT, json=short()) as response:
        assert response.status == 200
    await request_log.wait_for(2, within=WITHIN)
    assert [line["client"] for line in request_log.lines] == [
        keyed_id(VICTIM["Authorization"]), "127.0.0.1",
    ]  # fmt: skip
    assert not [text for text in request_log.records if "sk-victim-secret" in text]
