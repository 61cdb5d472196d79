"""Sidecar operations over real loopback servers: routing, placement, limits, admin, drain."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.config.models import Config, parse_config
from proxy.server.app import GENERATIONS
from proxy.server.process import Server
from tests.support.servers import Backend, Proxy, Servers, running_server

MESSAGES = [{"role": "user", "content": "hello"}]
MakeBackend = Callable[..., Awaitable[Backend]]
MakeProxy = Callable[[Config], Awaitable[Proxy]]


def two_upstreams(a: Backend, b: Backend, extra: str = "") -> Config:
    return parse_config(
        f"""
upstreams:
  - {{name: llama, url: "{a.url}"}}
  - {{name: other, url: "{b.url}"}}
routes:
  - {{model: "llama-*", upstream: llama}}
  - {{path_prefix: /echo/a, upstream: llama}}
default_upstream: other
{extra}
""",
        env={},
    )


def rids(backend: Backend) -> list[str]:
    return [rid for rid, _, _ in backend.state.seen]


async def test_routes_by_model_glob_and_by_path_prefix(
    http: aiohttp.ClientSession, make_backend: MakeBackend, make_proxy: MakeProxy
) -> None:
    a, b = await make_backend(), await make_backend()
    proxy = await make_proxy(two_upstreams(a, b))
    for model, rid in (("llama-3", "to-a"), ("gpt-x", "to-b")):
        body = {"model": model, "messages": MESSAGES, "n": 2}
        async with http.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
        ) as r:
            assert r.status == 200
    assert sorted(rids(a)) == ["0_to-a", "1_to-a"]
    assert sorted(rids(b)) == ["0_to-b", "1_to-b"]
    # by path: to `llama` although the body's model matches no glob; the echo names its host
    for path, backend in (("/echo/a/1", a), ("/echo/b/1", b)):
        async with http.post(proxy.url + path, json={"model": "gpt-x"}) as r:
            assert (await r.json())["headers"]["host"] == backend.url.removeprefix("http://")


@pytest.mark.parametrize(("placement", "spread"), [("spread", True), ("pack", False)])
async def test_placement_spreads_children_or_packs_them_on_one_replica(
    http: aiohttp.ClientSession,
    make_backend: MakeBackend,
    make_proxy: MakeProxy,
    placement: str,
    spread: bool,
) -> None:
    a, b = await make_backend(), await make_backend()
    config = parse_config(
        f'upstreams: [{{name: u, urls: ["{a.url}", "{b.url}"], placement: {placement}}}]', env={}
    )
    proxy = await make_proxy(config)
    for request in range(3):
        body = {"model": "m", "messages": MESSAGES, "n": 4}
        async with http.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": f"r{request}"}
        ) as r:
            assert r.status == 200
    for request in range(3):
        on_a = {rid for rid in rids(a) if rid.endswith(f"_r{request}")}
        on_b = {rid for rid in rids(b) if rid.endswith(f"_r{request}")}
        assert len(on_a) + len(on_b) == 4
        if spread:
            assert len(on_a) == len(on_b) == 2
        else:
            assert not on_a or not on_b
    if not spread:  # one replica per request, but requests still rotate over replicas
        assert rids(a)
        assert rids(b)


async def test_max_concurrency_queues_then_answers_429_with_retry_after(
    http: aiohttp.ClientSession, make_backend: MakeBackend, make_proxy: MakeProxy
) -> None:
    backend = await make_backend()
    config = parse_config(
        f'upstreams: [{{name: u, url: "{backend.url}", max_concurrency: 2, max_queue: 1}}]', env={}
    )
    proxy = await make_proxy(config)
    slow = {
        "model": "m",
        "messages": MESSAGES,
        "n": 2,
        "stream": True,
        "max_tokens": 10_000,
        "ignore_eos": True,
        "x_demo": {"token_delay": 0.01},
    }
    holder = await http.post(proxy.url + "/v1/chat/completions", json=slow)
    assert holder.status == 200
    queued = asyncio.create_task(
        http.post(
            proxy.url + "/v1/chat/completions",
            json={"model": "m", "messages": MESSAGES, "max_tokens": 2},
        )
    )
    await backend.state.wait_for(lambda s: len(s.active) == 2)
    slots = proxy.app[GENERATIONS].upstreams.state(proxy.config.upstreams[0]).slots
    for _ in range(1000):  # bounded: until the third request is parked in the proxy's queue
        if slots.queued == 1:
            break
        await asyncio.sleep(0)
    assert slots.queued == 1
    async with http.post(proxy.url + "/v1/models") as rejected:
        assert rejected.status == 429
        assert rejected.headers["Retry-After"] == "1"
        assert (await rejected.json())["error"]["type"] == "rate_limit_error"
    assert not queued.done()
    holder.close()  # frees both slots: the queued request now goes through
    response = await asyncio.wait_for(queued, 30)
    assert response.status == 200
    response.release()


async def test_configured_headers_are_injected_with_env_expanded(
    http: aiohttp.ClientSession, backend: Backend, make_proxy: MakeProxy
) -> None:
    config = parse_config(
        f'upstreams: [{{name: u, url: "{backend.url}",'
        ' headers: {Authorization: "Bearer ${KEY}"}}]',
        env={"KEY": "s3cret"},
    )
    proxy = await make_proxy(config)
    body = {"model": "m", "messages": MESSAGES, "n": 2}
    async with http.post(
        proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer client"}
    ) as r:
        assert r.status == 200
    assert [h["authorization"] for _, _, h in backend.state.seen] == ["Bearer s3cret"] * 2


def url(server: Server, path: str, admin: bool = False) -> str:
    return f"http://127.0.0.1:{server.admin_port if admin else server.proxy_port}{path}"


async def wait_ready(http: aiohttp.ClientSession, server: Server) -> None:
    await asyncio.wait_for(server.upstreams.health_checked.wait(), 30)
    async with http.get(url(server, "/readyz", admin=True)) as r:
        assert r.status == 200


async def test_livez_and_readyz_on_the_admin_port(
    http: aiohttp.ClientSession, server: Server, backend: Backend
) -> None:
    async with http.get(url(server, "/livez", admin=True)) as r:
        assert r.status == 200
    await wait_ready(http, server)
    async with http.get(url(server, "/readyz", admin=True)) as r:
        assert (await r.json())["replicas"] == {"u": {backend.url: True}}  # each one's health
    async with http.get(url(server, "/livez")) as r:  # the proxy port passes /livez upstream
        assert r.status == 404


async def test_readyz_fails_during_drain_while_a_stream_completes(
    http: aiohttp.ClientSession, server: Server, backend: Backend
) -> None:
    await wait_ready(http, server)
    body = {
        "model": "m",
        "messages": MESSAGES,
        "n": 2,
        "stream": True,
        "max_tokens": 30,
        "x_demo": {"token_delay": 0.01},
    }
    async with http.post(url(server, "/v1/chat/completions"), json=body) as stream:
        assert stream.status == 200
        drain = asyncio.create_task(server.drain())
        await asyncio.sleep(0)
        async with http.get(url(server, "/readyz", admin=True)) as r:
            assert r.status == 503
            assert (await r.json())["draining"] is True
        raw = await stream.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    assert b'"error"' not in raw
    await asyncio.wait_for(drain, 30)
    assert not backend.state.active


async def test_drain_out_of_time_cuts_streams_with_one_error_and_done(
    http: aiohttp.ClientSession, backend: Backend
) -> None:
    async with running_server(backend.url, drain_seconds=0.2) as server:
        body = {
            "model": "m",
            "messages": MESSAGES,
            "n": 2,
            "stream": True,
            "max_tokens": 10_000,
            "ignore_eos": True,
            "x_demo": {"token_delay": 0.01},
        }
        async with http.post(url(server, "/v1/chat/completions"), json=body) as stream:
            assert stream.status == 200
            await stream.content.readline()
            await server.drain()
            raw = await stream.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        assert raw.count(b"[DONE]") == 1
        assert b"shutting down" in raw
        await backend.state.wait_for(lambda s: not s.active)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_metrics_change_as_requests_flow(http: aiohttp.ClientSession, server: Server) -> None:
    async def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        async with http.get(url(server, "/metrics", admin=True)) as r:
            assert r.status == 200
            return samples(await r.text())

    before = await scrape()
    body: dict[str, Any] = {
        "model": "m",
        "messages": MESSAGES,
        "n": 3,
        "stream": True,
        "max_tokens": 4,
    }
    async with http.post(url(server, "/v1/chat/completions"), json=body) as r:
        await r.read()
    async with http.post(url(server, "/v1/chat/completions"), json={**body, "n": 0}) as r:
        assert r.status == 400
    after = await scrape()
    ok = (
        "n_proxy_requests_total",
        (("fanned_out", "true"), ("route", "/v1/chat/completions"), ("status", "200")),
    )
    bad = (
        "n_proxy_requests_total",
        (("fanned_out", "false"), ("route", "/v1/chat/completions"), ("status", "400")),
    )
    assert after[ok] - before.get(ok, 0) == 1
    assert after[bad] - before.get(bad, 0) == 1
    assert (
        after[("n_proxy_request_n_count", ())] - before.get(("n_proxy_request_n_count", ()), 0) == 1
    )
    assert (
        after[("n_proxy_stitched_chunks_total", ())]
        - before.get(("n_proxy_stitched_chunks_total", ()), 0)
        == 3 * 6
    )
    ttfb = ("n_proxy_upstream_ttfb_seconds_count", (("upstream", "u"),))
    assert after[ttfb] - before.get(ttfb, 0) >= 3
    assert after[("n_proxy_children_in_flight", (("upstream", "u"),))] == 0
    assert after[("n_proxy_overhead_seconds_count", ())] >= 1


async def test_aborted_children_are_counted(
    http: aiohttp.ClientSession, make_backend: MakeBackend
) -> None:
    slow = await make_backend(token_delay=0.01)
    async with running_server(slow.url) as server:
        body = {
            "model": "m",
            "messages": MESSAGES,
            "n": 3,
            "seed": 0,
            "max_tokens": 10_000,
            "ignore_eos": True,
            "x_demo": {"only_seed": 2, "fault": "status_500"},
        }
        async with http.post(url(server, "/v1/chat/completions"), json=body) as r:
            assert r.status == 500
        async with http.get(url(server, "/metrics", admin=True)) as r:
            values = samples(await r.text())
        assert values[("n_proxy_children_aborted_total", (("upstream", "u"),))] == 2
        await slow.state.wait_for(lambda s: not s.active)


@pytest.mark.parametrize(("readiness", "ready"), [("required", False), ("optional", True)])
async def test_readyz_fails_while_a_required_upstream_is_down(
    http: aiohttp.ClientSession, servers: Servers, backend: Backend, readiness: str, ready: bool
) -> None:
    """A dead upstream marked required keeps the pod out of the Service though another passes;
    an optional one (the default) does not."""
    config = parse_config(
        f"""
admin: {{host: 127.0.0.1, port: 0}}
listen: {{host: 127.0.0.1, port: 0}}
upstreams:
  - {{name: spare, url: "{backend.url}"}}
  - {{name: primary, url: "http://127.0.0.1:9", readiness: {readiness}}}
""",
        env={},
    )
    server = await servers.server(config)
    await asyncio.wait_for(server.upstreams.health_checked.wait(), 30)
    async with http.get(url(server, "/readyz", admin=True)) as r:
        assert r.status == (200 if ready else 503)
        body = await r.json()
    assert body["ready"] is ready
    assert body["upstreams"] == {"spare": True, "primary": False}
