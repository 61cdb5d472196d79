"""GET /v1/models with routes to several upstreams: the union of their lists, merged by id; a
failing upstream left out and counted; one upstream alone is passed through as before."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from proxy.config.models import parse_config
from tests.support.servers import Servers

MODELS = "/v1/models"


def config_text(urls: dict[str, str], routes: str, extra: str = "") -> str:
    upstreams = ", ".join(f"{{name: {name}, url: '{url}'}}" for name, url in urls.items())
    return f"upstreams: [{upstreams}]\nroutes: {routes}\n{extra}"


async def test_models_is_the_union_of_every_routed_upstreams_list(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    alpha = await servers.backend(model="alpha")
    beta = await servers.backend(model="beta")
    text = config_text({"a": alpha.url, "b": beta.url}, "[{model: 'beta*', upstream: b}]")
    proxy = await servers.proxy(parse_config(text, {}))
    async with http.get(proxy.url + MODELS, headers={"Authorization": "Bearer k"}) as r:
        assert r.status == 200
        answer = await r.json()
    assert answer["object"] == "list"
    assert [card["id"] for card in answer["data"]] == ["alpha", "beta"]
    assert answer["data"][1] == {
        "id": "beta", "object": "model", "created": 0, "owned_by": "n-proxy-devserver",
    }  # fmt: skip
    assert proxy.metric("n_proxy_model_list_failures_total") == 0


async def test_models_named_by_two_upstreams_are_listed_once_the_first_ones_card(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    async def listing(request: web.Request) -> web.StreamResponse:
        cards = [{"id": "alpha", "owned_by": "second"}, {"id": "gamma"}, {"no": "id"}]
        return web.json_response({"object": "list", "data": cards})

    alpha = await servers.backend(model="alpha")
    second = await servers.upstream(listing)
    text = config_text({"a": alpha.url, "b": second.url}, "[{model: 'g*', upstream: b}]")
    proxy = await servers.proxy(parse_config(text, {}))
    async with http.get(proxy.url + MODELS) as r:
        answer = await r.json()
    assert [(c["id"], c.get("owned_by")) for c in answer["data"]] == [
        ("alpha", "n-proxy-devserver"),
        ("gamma", None),
    ]


async def test_failing_and_silent_upstreams_are_left_out_and_counted(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    never = asyncio.Event()

    async def silent(request: web.Request) -> web.StreamResponse:
        await never.wait()  # answers after the proxy's model_list_timeout, if ever
        raise AssertionError("unreachable")

    async def refusing(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "no"}}, status=500)

    alpha = await servers.backend(model="alpha")
    quiet = await servers.upstream(silent)
    broken = await servers.upstream(refusing)
    urls = {"a": alpha.url, "q": quiet.url, "x": broken.url, "dead": "http://127.0.0.1:9"}
    routes = (
        "[{model: 'q*', upstream: q}, {model: 'x*', upstream: x}, {model: 'd', upstream: dead}]"
    )
    text = config_text(urls, routes, "model_list_timeout: 0.5\n")
    proxy = await servers.proxy(parse_config(text, {}))
    async with http.get(proxy.url + MODELS) as r:
        assert r.status == 200
        answer = await r.json()
    assert [card["id"] for card in answer["data"]] == ["alpha"]
    for name in ("q", "x", "dead"):
        assert proxy.metric("n_proxy_model_list_failures_total", upstream=name) == 1
    assert proxy.metric("n_proxy_model_list_failures_total", upstream="a") == 0


async def test_no_upstream_answering_the_model_list_is_a_502(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    urls = {"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:9"}
    proxy = await servers.proxy(parse_config(config_text(urls, "[{model: b, upstream: b}]"), {}))
    async with http.get(proxy.url + MODELS) as r:
        assert r.status == 502
        assert "no upstream answered /v1/models (a, b)" in (await r.json())["error"]["message"]


async def test_one_upstream_or_a_path_route_passes_models_through(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    alpha = await servers.backend(model="alpha")
    beta = await servers.backend(model="beta")
    urls = {"a": alpha.url, "b": beta.url}
    for routes in ("[]", "[{path_prefix: /v1/models, upstream: b}, {model: 'a*', upstream: a}]"):
        proxy = await servers.proxy(parse_config(config_text(urls, routes), {}))
        async with http.get(proxy.url + MODELS) as r:
            answer = await r.json()
        assert [card["id"] for card in answer["data"]] == ["alpha" if routes == "[]" else "beta"]
