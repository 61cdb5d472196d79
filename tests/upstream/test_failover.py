"""Replicas that fail over (docs/behaviour.md#failover), over real loopback servers:
per-replica health, retries before the first byte (spaced by backoff, within a budget, then a
fallback upstream), ejection, DNS discovery, load-aware placement, and a replica dying under
load."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.config.models import Config, Eject, Upstream
from proxy.core.sse import SSEDecoder
from proxy.server.app import GENERATIONS
from proxy.upstream.discovery import Resolver
from tests.support.client import post
from tests.support.logs import LogCapture
from tests.support.polling import until
from tests.support.ports import free_port
from tests.support.rawupstream import RawUpstream
from tests.support.servers import Backend, Proxy, Servers

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello"}]
# Seconds any one wait may take before the test fails instead of hanging: generous, as 200
# concurrent fan-outs on a loaded 2-core machine take seconds to even reach the backends.
WITHIN = 30.0
MakeBackend = Callable[..., Awaitable[Backend]]
ProxyFor = Callable[..., Awaitable[Proxy]]
# What a replica that fails on purpose answers a generation request: it closes the connection
# before any status line (``closes``), or sends a 503 head whose body never comes (``STALL``);
# either way its health check passes, so only the retries keep children away from it.
STALL = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\n"


# --- the rig ------------------------------------------------------------------------------------


@pytest.fixture
def proxy_for(servers: Servers) -> ProxyFor:
    """A proxy in front of these replicas: one upstream, named u, with these options."""

    async def make(urls: list[str], resolver: Resolver | None = None, **options: Any) -> Proxy:
        upstream = Upstream(name="u", urls=tuple(urls), **options)
        return await servers.proxy(Config(upstreams=(upstream,)), resolver)

    return make


@dataclass
class Waits:
    """The pool's waits between tries: each delay recorded, then slept (``real``) or not."""

    delays: list[float] = field(default_factory=list)
    real: bool = False

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(delay if self.real else 0)


def record_waits(proxy: Proxy, real: bool = False, draw: float = 0.0) -> Waits:
    """Record the proxy's waits; ``draw`` fixes the jitter (0: each wait is half its ceiling)."""
    waits = Waits(real=real)
    proxy.pool.sleep = waits
    for upstream in proxy.app[GENERATIONS].upstreams.config.upstreams:
        proxy.pool.state(upstream).retry.draw = lambda: draw
    return waits


def dead_url() -> str:
    """A replica nothing listens on: connecting is refused."""
    return f"http://127.0.0.1:{free_port()}"


async def start_slammer(servers: Servers) -> RawUpstream:
    """A replica that closes every generation request's connection before a status line."""
    return await servers.start(RawUpstream(closes={CHAT}))


async def start_staller(servers: Servers) -> RawUpstream:
    """A replica that answers every generation request 503 with a Content-Length body it never
    sends, holding the connection open."""
    return await servers.start(RawUpstream(scripts={CHAT: STALL}))


# --- requests -----------------------------------------------------------------------------------


def chat(n: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES, "seed": 7, "max_tokens": 8}
    if n != 1:
        body["n"] = n
    if stream:
        body["stream"] = True
    return {**body, **extra}


def clean_stream(raw: bytes, n: int) -> bool:
    decoder = SSEDecoder()
    events = decoder.feed(raw) + decoder.close()
    data = [e.data for e in events]
    if data.count("[DONE]") != 1 or data[-1] != "[DONE]":
        return False
    chunks = [orjson.loads(d) for d in data[:-1]]
    finished = {
        c["index"] for chunk in chunks for c in chunk.get("choices", []) if c.get("finish_reason")
    }
    return not any("error" in chunk for chunk in chunks) and finished == set(range(n))


def rids(backend: Backend) -> list[str]:
    return [rid for rid, _, _ in backend.state.seen]


# --- per-replica health and placement -----------------------------------------------------------


async def test_a_dead_replica_with_default_settings_fails_no_request(
    http: aiohttp.ClientSession,
    make_backend: MakeBackend,
    proxy_for: ProxyFor,
    request_log: LogCapture,
) -> None:
    live = await make_backend()
    dead = dead_url()
    proxy = await proxy_for([live.url, dead])
    jobs = [post(http, proxy.url + CHAT, chat(2), f"json{i}") for i in range(10)]
    jobs += [post(http, proxy.url + CHAT, chat(1, stream=True), f"one{i}") for i in range(6)]
    jobs += [post(http, proxy.url + CHAT, chat(3, stream=True), f"three{i}") for i in range(4)]
    results = await asyncio.gather(*jobs)
    assert [status for status, _, _ in results] == [200] * 20
    for _, raw, _ in results[10:16]:
        assert clean_stream(raw, 1)
    for _, raw, _ in results[16:]:
        assert clean_stream(raw, 3)
    for _, raw, _ in results[:10]:
        assert [c["index"] for c in orjson.loads(raw)["choices"]] == [0, 1]
    # every child ended on the live replica, once
    assert len(rids(live)) == 10 * 2 + 6 + 4 * 3
    await proxy.until(lambda: proxy.usable() == {live.url: True, dead: False})
    assert proxy.metric("n_proxy_replica_up", replica=dead) == 0
    assert proxy.metric("n_proxy_replica_up", replica=live.url) == 1
    # Children placed there before the first health round were retried (connect is always safe).
    retries = proxy.metric("n_proxy_retries_total", reason="connect")
    assert sum(line["retries"] for line in request_log.lines) == retries


async def test_a_replica_that_comes_to_life_gets_children_within_one_health_interval(
    http: aiohttp.ClientSession,
    make_backend: MakeBackend,
    proxy_for: ProxyFor,
    request_log: LogCapture,
) -> None:
    live = await make_backend()
    port = free_port()  # refused until the replica comes to life on it
    later = f"http://127.0.0.1:{port}"
    proxy = await proxy_for([live.url, later], health_interval=0.2)
    state = proxy.pool.state(proxy.upstream)
    await proxy.until(lambda: state.health_rounds >= 1)
    assert proxy.usable() == {live.url: True, later: False}
    assert proxy.pool.checked_replicas["u"] == {
        live.url: True,
        later: False,
    }  # what /readyz lists
    for i in range(2):
        assert (await post(http, proxy.url + CHAT, chat(2), f"before{i}"))[0] == 200
    assert len(rids(live)) == 4  # spread, but only over the healthy replica

    revived = (await make_backend(port=port)).state
    rounds = state.health_rounds
    await proxy.until(lambda: proxy.usable()[later])
    # A round that began before the replica listened may still fail it; the next passes.
    assert state.health_rounds <= rounds + 2
    assert proxy.pool.checked_replicas["u"] == {live.url: True, later: True}
    for i in range(2):
        assert (await post(http, proxy.url + CHAT, chat(2), f"after{i}"))[0] == 200
    parents = [rid.split("_", 1)[1] for rid, _, _ in revived.seen]
    assert sorted(parents) == ["after0", "after1"]  # one child of each request
    # Marked down is a warning; back up is news at info.
    changes = [(level, fields["ok"]) for level, fields in request_log.levels("replica health")]
    assert changes == [("warning", False), ("info", True)]


# --- retries ------------------------------------------------------------------------------------


async def test_a_replica_that_closes_at_once_is_retried_with_connect_and_reset(
    http: aiohttp.ClientSession,
    make_backend: MakeBackend,
    proxy_for: ProxyFor,
    servers: Servers,
    request_log: LogCapture,
) -> None:
    live = await make_backend()
    slammed = await start_slammer(servers)
    slammer = slammed.url
    proxy = await proxy_for(
        [live.url, slammer], retry_on=("connect", "reset"), eject=Eject(failures=0)
    )
    jobs = [post(http, proxy.url + CHAT, chat(2), f"json{i}") for i in range(6)]
    jobs += [post(http, proxy.url + CHAT, chat(1), f"one{i}") for i in range(4)]
    jobs += [post(http, proxy.url + CHAT, chat(2, stream=True), f"stream{i}") for i in range(4)]
    results = await asyncio.gather(*jobs)
    assert [status for status, _, _ in results] == [200] * 14
    assert all(clean_stream(raw, 2) for _, raw, _ in results[10:])
    tries = len(slammed.requests(CHAT))
    assert tries >= 6 + 4  # every 2-child request put one child there
    assert len(rids(live)) == 6 * 2 + 4 + 4 * 2
    assert proxy.metric("n_proxy_retries_total", upstream="u", reason="reset") == tries
    assert sum(line["retries"] for line in request_log.lines) == tries


async def test_with_the_default_retry_on_a_reset_is_not_retried(
    http: aiohttp.ClientSession, proxy_for: ProxyFor, servers: Servers
) -> None:
    slammed = await start_slammer(servers)
    slammer = slammed.url
    proxy = await proxy_for([slammer])
    status, raw, _ = await post(http, proxy.url + CHAT, chat(1))
    assert status == 502
    assert orjson.loads(raw)["error"]["type"] == "server_error"
    assert len(slammed.requests(CHAT)) == 1


async def answer_503(request: web.Request, retry_after: str | None = None) -> web.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else None
    body = {"error": {"message": "busy", "type": "overloaded"}}
    return web.json_response(body, status=503, headers=headers)


async def test_a_replica_answering_503_is_retried_when_503_is_listed(
    http: aiohttp.ClientSession,
    make_backend: MakeBackend,
    proxy_for: ProxyFor,
    servers: Servers,
) -> None:
    live = await make_backend()
    recorded = await servers.upstream(answer_503)
    busy = recorded.url
    proxy = await proxy_for([live.url, busy], retry_on=("connect", 503), eject=Eject(failures=0))
    jobs = [post(http, proxy.url + CHAT, chat(2), f"json{i}") for i in range(6)]
    jobs += [post(http, proxy.url + CHAT, chat(1), f"one{i}") for i in range(4)]
    jobs += [post(http, proxy.url + CHAT, chat(3, stream=True), f"stream{i}") for i in range(4)]
    results = await asyncio.gather(*jobs)
    assert [status for status, _, _ in results] == [200] * 14
    assert all(clean_stream(raw, 3) for _, raw, _ in results[10:])
    assert len(recorded.seen) >= 6 + 4
    assert proxy.metric("n_proxy_retries_total", reason="503") == len(recorded.seen)
    assert not proxy.pool.connections.in_use  # every retried 503 was read to its end or closed
    # the retried child is the same child: its request id and body reached the live replica
    for tried in recorded.seen:
        (seen,) = [b for r, b, _ in live.state.seen if r == tried.request_id]
        assert seen == orjson.loads(tried.body)


async def test_with_the_default_retry_on_a_503_is_relayed_as_before(
    http: aiohttp.ClientSession, proxy_for: ProxyFor, servers: Servers
) -> None:
    recorded = await servers.upstream(answer_503)
    busy = recorded.url
    proxy = await proxy_for([busy])
    for n, stream in ((1, False), (2, False), (2, True)):
        status, raw, _ = await post(http, proxy.url + CHAT, chat(n, stream=stream))
        assert status == 503
        assert orjson.loads(raw)["error"]["message"] == "busy"
    assert proxy.metric("n_proxy_retries_total") == 0
    assert len(recorded.seen) == 1 + 2 + 2


@pytest.mark.parametrize("retries", [0, 1, 3])
async def test_retries_never_exceed_retries_and_resend_the_same_request(
    http: aiohttp.ClientSession,
    proxy_for: ProxyFor,
    servers: Servers,
    request_log: LogCapture,
    retries: int,
) -> None:
    a = await servers.upstream(answer_503)
    busy_a = a.url
    b = await servers.upstream(answer_503)
    busy_b = b.url
    proxy = await proxy_for(
        [busy_a, busy_b], retries=retries, retry_on=(503,), eject=Eject(failures=0)
    )
    status, _, _ = await post(http, proxy.url + CHAT, chat(1, seed=11), "same")
    assert status == 503
    tries = a.seen + b.seen
    assert len(tries) == 1 + retries
    assert {(t.request_id, t.body) for t in tries} == {(tries[0].request_id, tries[0].body)}
    assert orjson.loads(tries[0].body)["seed"] == 11
    assert tries[0].request_id == "same"
    if retries:  # each retry on the other replica
        assert abs(len(a.seen) - len(b.seen)) <= 1
    assert request_log.lines[-1]["retries"] == retries


async def test_nothing_is_retried_after_the_first_byte(
    http: aiohttp.ClientSession, proxy_for: ProxyFor, servers: Servers
) -> None:
    async def breaks_mid_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}}],
        }
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        assert request.transport is not None
        request.transport.abort()
        return response

    recorded = await servers.upstream(breaks_mid_stream)

    url = recorded.url
    proxy = await proxy_for([url], retry_on=("connect", "reset", 503), retries=3)
    status, raw, _ = await post(http, proxy.url + CHAT, chat(2, stream=True))
    assert status == 200
    assert raw.count(b"[DONE]") == 1
    assert b'"error"' in raw
    assert len(recorded.seen) == 2  # one try per child: the 200 had reached the client
    with pytest.raises(aiohttp.ClientPayloadError):  # pass-through: the client sees the cut
        await post(http, proxy.url + CHAT, chat(1, stream=True))
    assert len(recorded.seen) == 3
    assert proxy.metric("n_proxy_retries_total") == 0


async def test_consecutive_failures_eject_a_replica(
    http: aiohttp.ClientSession,
    make_backend: MakeBackend,
    proxy_for: ProxyFor,
    servers: Servers,
    request_log: LogCapture,
) -> None:
    live = await make_backend()
    recorded = await servers.upstream(answer_503)
    busy = recorded.url
    proxy = await proxy_for(
        [live.url, busy], retry_on=(503,), eject=Eject(failures=2, seconds=600), health_interval=600
    )
    state = proxy.pool.state(proxy.upstream)
    await proxy.until(lambda: state.health_rounds == 1)  # the next one is 600 s away
    for i in range(10):
        assert (await post(http, proxy.url + CHAT, chat(1), f"r{i}"))[0] == 200
    assert len(recorded.seen) == 2  # then out for 600 s (its health check passes ...)
    assert proxy.usable() == {live.url: True, busy: False}
    assert proxy.metric("n_proxy_ejections_total", replica=busy) == 1
    assert proxy.metric("n_proxy_replica_up", replica=busy) == 0
    assert request_log.levels("replica ejected") == [
        ("warning", {"upstream": "u", "replica": busy})
    ]
    # ... and a passing health check brings it back at once
    await proxy.pool.healthy(proxy.upstream)
    assert proxy.usable() == {live.url: True, busy: True}


# --- DNS discovery ------------------------------------------------------------------------------


async def test_dns_discovery_adds_and_removes_replicas(
    http: aiohttp.ClientSession, proxy_for: ProxyFor, servers: Servers
) -> None:
    first = await servers.backend()
    port, one = first.port, first.state
    two = (await servers.backend(host="127.0.0.2", port=port)).state
    answer = ["127.0.0.1"]
    asked: list[tuple[str, int]] = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return list(answer)

    name = f"inference.test:{port}"
    proxy = await proxy_for(
        [f"http://{name}"],
        resolver,
        discovery={"dns": True, "interval": 0.05},
        health_interval=0.05,
    )
    a, b = f"http://127.0.0.1:{port}", f"http://127.0.0.2:{port}"
    await proxy.until(lambda: set(proxy.usable()) == {a})
    assert asked[0] == ("inference.test", port)
    assert (await post(http, proxy.url + CHAT, chat(2), "only-a"))[0] == 200
    assert [rid for rid, _, _ in one.seen] == ["0_only-a", "1_only-a"]
    assert one.seen[0][2]["host"] == name  # the configured name, not the address

    answer.append("127.0.0.2")
    await proxy.until(lambda: set(proxy.usable()) == {a, b})
    assert (await post(http, proxy.url + CHAT, chat(2), "both"))[0] == 200
    assert [rid for rid, _, _ in two.seen] in (["0_both"], ["1_both"])

    # A stream in flight on the replica that leaves finishes; new requests avoid it.
    slow = chat(2, stream=True, max_tokens=40, x_demo={"token_delay": 0.02}, ignore_eos=True)
    async with http.post(proxy.url + CHAT, json=slow, headers={"X-Request-Id": "s"}) as stream:
        assert stream.status == 200
        await one.wait_for(lambda s: len(s.active) == 1)
        answer.remove("127.0.0.1")
        await proxy.until(lambda: set(proxy.usable()) == {b})
        for i in range(3):
            assert (await post(http, proxy.url + CHAT, chat(2), f"only-b{i}"))[0] == 200
        assert clean_stream(await stream.read(), 2)
    assert not [rid for rid, _, _ in one.seen if rid.endswith("only-b0")]
    assert proxy.metric("n_proxy_replica_up", replica=a) == 0  # its series is gone
    assert proxy.metric("n_proxy_replica_up", replica=b) == 1


# --- a replica dies under load ------------------------------------------------------------------


async def test_killing_one_of_three_replicas_under_load(
    http: aiohttp.ClientSession, proxy_for: ProxyFor, servers: Servers
) -> None:
    """200 concurrent n=4 requests; one replica dies halfway. Requests with no child started
    there answer 200; the others answer 200, or a stream ended by one error event
    (docs/behaviour.md#errors); nothing hangs."""
    backends = [await servers.backend() for _ in range(3)]
    victim = backends[0].state
    urls = [backend.url for backend in backends]
    proxy = await proxy_for(
        urls, retry_on=("connect", "reset"), max_concurrency=4096, health_interval=0.1
    )
    streams = [i % 2 == 1 for i in range(200)]
    slow = {"x_demo": {"token_delay": 0.01}, "max_tokens": 20, "ignore_eos": True}
    jobs = [
        asyncio.ensure_future(post(http, proxy.url + CHAT, chat(4, stream=stream, **slow), f"k{i}"))
        for i, stream in enumerate(streams)
    ]
    await victim.wait_for(lambda s: len(s.seen) >= 40, timeout=WITHIN)
    started_there = {rid.split("_", 1)[1] for rid, _, _ in victim.seen}
    await servers.stop(backends[0])  # its open connections are cut, its port refuses
    results = await asyncio.wait_for(asyncio.gather(*jobs), WITHIN)  # nothing hangs
    started_there |= {rid.split("_", 1)[1] for rid, _, _ in victim.seen}  # raced the kill
    failed = 0
    for i, (stream, (status, raw, _)) in enumerate(zip(streams, results, strict=True)):
        if f"k{i}" not in started_there:
            assert status == 200, (i, raw[:200])
            if stream:
                assert clean_stream(raw, 4)
            continue
        if status == 200 and (not stream or clean_stream(raw, 4)):
            continue
        failed += 1
        if status == 200:  # a stream cut after its 200: one error event, then [DONE]
            assert raw.endswith(b"data: [DONE]\n\n")
            assert raw.count(b"[DONE]") == 1
            assert b'"server_error"' in raw
        else:
            assert status in (502, 504)
            assert orjson.loads(raw)["error"]["type"] == "server_error"
    assert started_there  # the kill did cut requests short
    assert failed <= len(started_there)
    await proxy.until(lambda: not proxy.usable()[urls[0]])


# --- backoff, Retry-After, budget, fallback -----------------------------------------------------


async def test_a_dead_replica_is_retried_after_growing_jittered_waits(
    http: aiohttp.ClientSession, proxy_for: ProxyFor
) -> None:
    dead = dead_url()
    proxy = await proxy_for([dead], retries=3, backoff={"base": 0.1, "cap": 0.3})
    waits = record_waits(proxy, draw=0.0)
    status, _, _ = await post(http, proxy.url + CHAT, chat(2))
    assert status == 502
    # per child: half of 0.1, 0.2, then of the 0.3 cap
    assert sorted(waits.delays) == pytest.approx([0.05, 0.05, 0.1, 0.1, 0.15, 0.15])
    assert proxy.metric("n_proxy_retries_total", reason="connect") == 6
    waits = record_waits(proxy, draw=0.999)
    status, _, _ = await post(http, proxy.url + CHAT, chat(1))
    assert waits.delays == pytest.approx([0.09995, 0.1999, 0.29985])  # nearly the ceilings


async def test_tries_reach_the_replica_spaced_by_the_backoff(
    http: aiohttp.ClientSession, proxy_for: ProxyFor, servers: Servers
) -> None:
    arrived: dict[str, list[float]] = {}

    async def stamp_503(request: web.Request) -> web.Response:
        arrived.setdefault(request.headers["X-Request-Id"], []).append(time.monotonic())
        return await answer_503(request)

    busy = (await servers.upstream(stamp_503)).url
    proxy = await proxy_for(
        [busy], retries=2, retry_on=(503,), backoff={"base": 0.2, "cap": 1}, eject=Eject(failures=0)
    )
    record_waits(proxy, real=True, draw=0.0)  # real waits of 0.1 s, then 0.2 s
    status, _, _ = await post(http, proxy.url + CHAT, chat(2), "spaced")
    assert status == 503
    assert sorted(arrived) == ["0_spaced", "1_spaced"]
    # The first child whose last try fails fails the request, and its sibling's wait is cut
    # then: on a loaded machine the sibling's last tries may not have gone out yet.
    assert max(len(times) for times in arrived.values()) == 3
    for times in arrived.values():
        gaps = [b - a for a, b in itertools.pairwise(times)]
        for gap, wait in zip(gaps, (0.1, 0.2), strict=False):
            assert wait <= gap < wait + WITHIN  # generous above: a loaded machine is slow


def answer_503_retry_after(value: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    return functools.partial(answer_503, retry_after=value)


async def test_retry_after_sets_the_wait_and_past_its_cap_the_answer_is_relayed(
    http: aiohttp.ClientSession,
    make_backend: MakeBackend,
    proxy_for: ProxyFor,
    servers: Servers,
) -> None:
    live = await make_backend()
    busy = (await servers.upstream(answer_503_retry_after("2"))).url
    options: dict[str, Any] = {"retry_on": (503,), "eject": Eject(failures=0), "placement": "pack"}
    proxy = await proxy_for([busy, live.url], backoff={"retry_after_cap": 5}, **options)
    waits = record_waits(proxy)
    status, raw, _ = await post(
        http, proxy.url + CHAT, chat(2), "wait"
    )  # both children on busy first
    assert status == 200
    assert [c["index"] for c in orjson.loads(raw)["choices"]] == [0, 1]
    assert waits.delays == [2.0, 2.0]  # Retry-After, not the 25 ms backoff
    assert sorted(rids(live)) == ["0_wait", "1_wait"]

    slow = (await servers.upstream(answer_503_retry_after("60"))).url
    proxy = await proxy_for([slow, live.url], backoff={"retry_after_cap": 5}, **options)
    waits = record_waits(proxy)
    async with http.post(proxy.url + CHAT, json=chat(1), headers={"X-Request-Id": "late"}) as r:
        assert r.status == 503  # the server's own answer, for the client to honour
        assert r.headers["Retry-After"] == "60"
    assert waits.delays == []
    assert "late" not in rids(live)


async def test_the_retry_budget_caps_retries_under_a_burst_of_n8_requests(
    http: aiohttp.ClientSession,
    proxy_for: ProxyFor,
    servers: Servers,
    request_log: LogCapture,
) -> None:
    recorded = await servers.upstream(answer_503)
    busy = recorded.url
    budget = {"percent": 20, "min_per_second": 0.1, "window": 10}  # 1 retry + 1 per 5 requests
    proxy = await proxy_for(
        [busy], retries=2, retry_on=(503,), retry_budget=budget, eject=Eject(failures=0)
    )
    record_waits(proxy)
    results = await asyncio.gather(
        *(post(http, proxy.url + CHAT, chat(8), f"b{i}") for i in range(3))
    )
    assert [status for status, _, _ in results] == [503] * 3
    retries = proxy.metric("n_proxy_retries_total", reason="503")
    refused = proxy.metric("n_proxy_retries_refused_total", upstream="u", reason="503")
    assert 1 <= retries <= 1 + 0.2 * 24  # without the budget: 48
    # The first child to fail fails its request and aborts its siblings, some perhaps before
    # their first try: at most 24 first tries, and only the retries the budget allowed.
    assert len(recorded.seen) <= 24 + retries
    assert refused >= 1
    assert sum(line["retries"] for line in request_log.lines) == retries


@pytest.mark.parametrize("failing", ["refuses", "answers 503"])
async def test_the_fallback_upstream_answers_when_every_replica_failed(
    http: aiohttp.ClientSession,
    make_backend: MakeBackend,
    servers: Servers,
    failing: str,
) -> None:
    spare = await make_backend()
    recorded = await servers.upstream(answer_503)
    busy = recorded.url
    url = busy if failing == "answers 503" else dead_url()
    primary = Upstream(
        name="u",
        urls=(url,),
        retries=1,
        retry_on=("connect", 503),
        eject=Eject(failures=0),
        headers={"Authorization": "Bearer primary-key", "X-Primary": "1"},
        fallback="spare",
    )
    fallback = Upstream(
        name="spare", urls=(spare.url,), headers={"Authorization": "Bearer spare-key"}
    )
    proxy = await servers.proxy(Config(upstreams=(primary, fallback)))
    record_waits(proxy)
    for stream in (False, True):
        rid = f"fb-{stream}"
        status, raw, _ = await post(http, proxy.url + CHAT, chat(2, stream=stream), rid)
        assert status == 200
        if stream:
            assert clean_stream(raw, 2)
        else:
            assert [c["index"] for c in orjson.loads(raw)["choices"]] == [0, 1]
        seen = {r: headers for r, _, headers in spare.state.seen if r.endswith(rid)}
        assert sorted(seen) == [f"0_{rid}", f"1_{rid}"]  # the same children
        for headers in seen.values():
            assert headers["authorization"] == "Bearer spare-key"  # never the primary's key
            assert "x-primary" not in headers
    if failing == "answers 503":
        assert len(recorded.seen) == 2 * 2 * 2  # two tries of each child
    assert proxy.metric("n_proxy_fallbacks_total", upstream="u", fallback="spare") == 4
    spare_state = proxy.pool.state(fallback)
    assert (spare_state.slots.in_use, spare_state.slots.queued) == (0, 0)
    assert all(r.outstanding == 0 for r in spare_state.replicas)


@pytest.mark.parametrize("then", ["retry", "fallback"])
async def test_a_retried_answer_whose_body_stalls_lets_its_retry_go_at_once(
    http: aiohttp.ClientSession, make_backend: MakeBackend, servers: Servers, then: str
) -> None:
    live = await make_backend()
    staller = await start_staller(servers)
    stalled = staller.url
    options: dict[str, Any] = {
        "retry_on": (503,), "eject": Eject(failures=0), "timeouts": {"idle": 3600},
    }  # fmt: skip
    upstreams: tuple[Upstream, ...]
    if then == "retry":
        options["placement"] = "pack"  # the first try on the stalling replica
        upstreams = (Upstream(name="u", urls=(stalled, live.url), **options),)
    else:
        primary = Upstream(name="u", urls=(stalled,), retries=0, fallback="spare", **options)
        upstreams = (primary, Upstream(name="spare", urls=(live.url,)))
    proxy = await servers.proxy(Config(upstreams=upstreams))
    record_waits(proxy)
    # Within WITHIN (post's bound), far below timeouts.idle: the stalled body is not waited for.
    status, _, _ = await post(http, proxy.url + CHAT, chat(1), "stalled")
    assert status == 200
    assert len(staller.requests(CHAT)) == 1
    assert rids(live) == ["stalled"]
    assert not proxy.pool.connections.in_use  # the stalled answer's connection was closed


async def test_a_failure_retry_on_does_not_list_never_goes_to_the_fallback(
    http: aiohttp.ClientSession, make_backend: MakeBackend, servers: Servers
) -> None:
    spare = await make_backend()
    busy = (await servers.upstream(answer_503)).url
    primary = Upstream(name="u", urls=(busy,), fallback="spare")  # retry_on: [connect]
    proxy = await servers.proxy(
        Config(upstreams=(primary, Upstream(name="spare", urls=(spare.url,))))
    )
    assert (await post(http, proxy.url + CHAT, chat(2)))[0] == 503
    assert not spare.state.seen
    assert proxy.metric("n_proxy_fallbacks_total") == 0


async def test_a_backoff_wait_cancelled_by_the_client_leaves_nothing_behind(
    http: aiohttp.ClientSession, proxy_for: ProxyFor
) -> None:
    dead = dead_url()
    proxy = await proxy_for([dead], retries=3, max_concurrency=1)
    state = proxy.pool.state(proxy.upstream)
    waiting = asyncio.Event()

    async def long_wait(delay: float) -> None:
        waiting.set()
        await asyncio.sleep(WITHIN)

    proxy.pool.sleep = long_wait
    before = len(asyncio.all_tasks())
    for n, stream in ((1, False), (2, False), (2, True)):
        waiting.clear()
        job = asyncio.ensure_future(post(http, proxy.url + CHAT, chat(n, stream=stream)))
        await asyncio.wait_for(waiting.wait(), WITHIN)
        assert (state.slots.in_use, state.slots.queued) == (1, n - 1)  # a second child queues
        job.cancel()  # the client leaves during the wait
        with pytest.raises(asyncio.CancelledError):
            await job
        # The proxy notices the closed connection on its own time: poll, bounded.
        await until(lambda: state.slots.in_use == 0 and len(asyncio.all_tasks()) <= before, WITHIN)
        assert state.slots.queued == 0
        assert all(r.outstanding == 0 for r in state.replicas)


@dataclass
class HeldWaits:
    """The pool's waits between tries, held until ``release`` is set; each one that the proxy
    cancels (its client left) is counted."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0
    cancelled: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, delay: float) -> None:
        self.waiting += 1
        self.changed.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            self.changed.set()
            raise
        finally:
            self.waiting -= 1

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(WITHIN):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


async def test_a_retry_whose_wait_is_cancelled_is_neither_counted_nor_spent(
    http: aiohttp.ClientSession, proxy_for: ProxyFor, servers: Servers
) -> None:
    recorded = await servers.upstream(answer_503)
    busy = recorded.url
    budget = {"percent": 0, "min_per_second": 0.1, "window": 10}  # one retry in the window
    proxy = await proxy_for(
        [busy], retries=1, retry_on=(503,), retry_budget=budget, eject=Eject(failures=0)
    )
    waits = HeldWaits()
    proxy.pool.sleep = waits
    leaving = asyncio.ensure_future(post(http, proxy.url + CHAT, chat(1), "leaves"))
    await waits.until(lambda: waits.waiting == 1)
    leaving.cancel()  # the client leaves during the backoff wait
    with pytest.raises(asyncio.CancelledError):
        await leaving
    await waits.until(lambda: waits.cancelled == 1)
    assert proxy.metric("n_proxy_retries_total", reason="503") == 0
    waits.release.set()
    # The budget's one retry was given back: the next request's retry goes out.
    assert (await post(http, proxy.url + CHAT, chat(1), "stays"))[0] == 503
    assert [t.request_id for t in recorded.seen] == ["leaves", "stays", "stays"]
    assert proxy.metric("n_proxy_retries_total", reason="503") == 1
    assert proxy.metric("n_proxy_retries_refused_total") == 0


async def test_under_a_503_storm_with_clients_leaving_counted_retries_are_the_retries_sent(
    http: aiohttp.ClientSession,
    proxy_for: ProxyFor,
    servers: Servers,
    request_log: LogCapture,
) -> None:
    recorded = await servers.upstream(answer_503)
    busy = recorded.url
    budget = {"percent": 100, "min_per_second": 100}
    proxy = await proxy_for(
        [busy], retries=2, retry_on=(503,), retry_budget=budget, eject=Eject(failures=0)
    )
    waits = HeldWaits()
    proxy.pool.sleep = waits
    clients = 8
    jobs = [
        asyncio.ensure_future(post(http, proxy.url + CHAT, chat(1), f"s{i}"))
        for i in range(clients)
    ]
    await waits.until(lambda: waits.waiting == clients)  # every first try failed: all wait
    for job in jobs[::2]:
        job.cancel()  # half the clients leave during their first wait
    await asyncio.gather(*jobs[::2], return_exceptions=True)
    await waits.until(lambda: waits.cancelled == clients // 2)
    waits.release.set()
    assert [status for status, _, _ in await asyncio.gather(*jobs[1::2])] == [503] * (clients // 2)
    sent = len(recorded.seen) - clients  # every try the upstream saw but the first ones
    assert sent == clients // 2 * 2  # the clients that stayed: two retries each
    assert proxy.metric("n_proxy_retries_total", reason="503") == sent
    assert sum(line["retries"] for line in request_log.lines) == sent


async def test_a_client_leaving_a_fallback_stream_gives_back_the_fallbacks_places(
    http: aiohttp.ClientSession, make_backend: MakeBackend, servers: Servers
) -> None:
    spare = await make_backend()
    primary = Upstream(name="u", urls=(dead_url(),), fallback="spare")
    proxy = await servers.proxy(
        Config(upstreams=(primary, Upstream(name="spare", urls=(spare.url,))))
    )
    record_waits(proxy)
    other = proxy.pool.state(proxy.app[GENERATIONS].upstreams.config.upstream("spare"))
    long = chat(2, stream=True, max_tokens=10_000, ignore_eos=True, x_demo={"token_delay": 0.05})
    async with http.post(proxy.url + CHAT, json=long) as stream:
        assert stream.status == 200
        await spare.state.wait_for(lambda s: len(s.active) == 2, WITHIN)
        assert other.slots.in_use == 2
        assert [r.outstanding for r in other.replicas] == [2]
    # the client left: both children aborted, their places in the fallback's line given back
    await spare.state.wait_for(lambda s: not s.active, WITHIN)
    await until(lambda: other.slots.in_use == 0, WITHIN)
    assert [r.outstanding for r in other.replicas] == [0]


# --- load-aware placement -----------------------------------------------------------------------


async def test_least_outstanding_sends_children_away_from_a_busy_replica(
    http: aiohttp.ClientSession, make_backend: MakeBackend, proxy_for: ProxyFor
) -> None:
    a, b = await make_backend(), await make_backend()
    proxy = await proxy_for([a.url, b.url], placement="least_outstanding", health_interval=600)
    state = proxy.pool.state(proxy.upstream)
    await proxy.until(lambda: state.health_rounds == 1)  # the next one is 600 s away
    long = chat(1, stream=True, max_tokens=10_000, ignore_eos=True, x_demo={"token_delay": 0.05})
    state.replicas.checked(b.url, ok=False)  # so that three long streams all go to a
    async with contextlib.AsyncExitStack() as held:
        for i in range(3):
            stream = await held.enter_async_context(
                http.post(proxy.url + CHAT, json=long, headers={"X-Request-Id": f"long{i}"})
            )
            assert stream.status == 200
        await a.state.wait_for(lambda s: len(s.active) == 3, WITHIN)
        state.replicas.checked(b.url, ok=True)
        for i in range(3):
            assert (await post(http, proxy.url + CHAT, chat(2), f"r{i}"))[0] == 200
            assert (await post(http, proxy.url + CHAT, chat(1), f"one{i}"))[0] == 200
        # round-robin would have put one child of each n=2 request and half the rest on a
        assert sorted(rids(a)) == ["long0", "long1", "long2"]
        assert sorted(rids(b)) == sorted(
            [f"{c}_r{i}" for i in range(3) for c in (0, 1)] + [f"one{i}" for i in range(3)]
        )


@pytest.mark.parametrize(("n", "per_replica"), [(4, [2, 2]), (5, [1, 2, 2]), (6, [2, 2, 2])])
async def test_pack_k_puts_k_children_of_a_request_on_each_replica(
    http: aiohttp.ClientSession,
    make_backend: MakeBackend,
    proxy_for: ProxyFor,
    n: int,
    per_replica: list[int],
) -> None:
    backends = [await make_backend() for _ in range(3)]
    proxy = await proxy_for(
        [b.url for b in backends], placement={"choose": "least_outstanding", "pack": 2}
    )
    for request in range(2):
        assert (await post(http, proxy.url + CHAT, chat(n), f"p{request}"))[0] == 200
        counts = [sum(rid.endswith(f"_p{request}") for rid in rids(b)) for b in backends]
        assert sorted(c for c in counts if c) == per_replica
        # the children sharing a replica are neighbours (0 and 1, 2 and 3, ...): one pack each
        groups = sorted(
            sorted(int(rid.split("_")[0]) for rid in rids(b) if rid.endswith(f"_p{request}"))
            for b in backends
        )
        assert [g for g in groups if g] == sorted(
            list(range(first, min(first + 2, n))) for first in range(0, n, 2)
        )
