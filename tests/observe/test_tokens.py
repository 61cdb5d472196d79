"""Tokens on /metrics (docs/operating.md#tokens): counted from the usage each answer carries (a
fan-out's merged usage, a passed-through answer's own, never asked for on its behalf), labelled
by route, upstream and a bounded model name; time to first token and per output token by model;
children per fanned-out request."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from proxy.observe.catalog import OTHER, PER_UPSTREAM
from tests.support.servers import Backend, Proxy

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "count my tokens"}]
KINDS = ("prompt", "completion", "cached", "reasoning")
Samples = dict[tuple[tuple[str, str], ...], float]


def samples(proxy: Proxy, name: str) -> Samples:
    """Each label set of ``name`` on the proxy's /metrics, with its value."""
    text = proxy.pool.metrics.render().decode()
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def tokens(proxy: Proxy, **labels: str) -> dict[str, float]:
    """The four token counts, summed over the label sets that hold ``labels``."""
    return {kind: proxy.metric(f"n_proxy_{kind}_tokens_total", **labels) for kind in KINDS}


def expected(usage: dict[str, Any]) -> dict[str, float]:
    details = usage.get("completion_tokens_details") or {}
    return {
        "prompt": usage["prompt_tokens"],
        "completion": usage["completion_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "reasoning": details.get("reasoning_tokens", 0),
    }


def stream_usage(raw: bytes) -> dict[str, Any] | None:
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: {")]
    found = [e["usage"] for e in map(json.loads, events) if e.get("usage")]
    return found[-1] if found else None


async def post(http: aiohttp.ClientSession, proxy: Proxy, body: dict[str, Any]) -> bytes:
    async with http.post(proxy.url + CHAT, json={"messages": MESSAGES, **body}) as r:
        assert r.status == 200
        return await r.read()


def added(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {kind: after[kind] - before[kind] for kind in KINDS}


async def test_fanned_out_answers_count_their_merged_usage_by_route_upstream_and_model(
    http: aiohttp.ClientSession, proxy: Proxy
) -> None:
    labels = {"route": CHAT, "upstream": "default", "model": "tiny-a"}
    before = tokens(proxy, **labels)
    answer = json.loads(await post(http, proxy, {"model": "tiny-a", "n": 3, "max_tokens": 5}))
    after_json = tokens(proxy, **labels)
    assert added(before, after_json) == expected(answer["usage"])
    raw = await post(http, proxy, {"model": "tiny-a", "n": 2, "max_tokens": 4, "stream": True,
                                   "stream_options": {"include_usage": True}})  # fmt: skip
    usage = stream_usage(raw)
    assert usage is not None
    assert added(after_json, tokens(proxy, **labels)) == expected(usage)
    children = samples(proxy, "n_proxy_children_per_request_sum")
    assert children[(("route", CHAT),)] == 5  # 3 and 2 children


async def test_a_passed_through_answer_counts_the_usage_it_carries_and_is_not_altered(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend
) -> None:
    labels = {"route": CHAT, "model": "tiny-b"}
    before = tokens(proxy, **labels)
    answer = json.loads(await post(http, proxy, {"model": "tiny-b", "max_tokens": 3}))
    after_json = tokens(proxy, **labels)
    assert added(before, after_json) == expected(answer["usage"])
    body = {"model": "tiny-b", "max_tokens": 6, "stream": True}
    raw = await post(http, proxy, {**body, "stream_options": {"include_usage": True}})
    usage = stream_usage(raw)
    assert usage is not None
    after_stream = tokens(proxy, **labels)
    assert added(after_json, after_stream) == expected(usage)
    # A stream that did not ask for usage gets none, and counts none: the proxy does not ask.
    raw = await post(http, proxy, body)
    assert stream_usage(raw) is None
    assert tokens(proxy, **labels) == after_stream
    _, sent, _ = backend.state.seen[-1]
    assert "stream_options" not in sent


async def test_the_model_label_is_a_name_the_upstream_reported_or_other_a_bounded_set(
    http: aiohttp.ClientSession, proxy: Proxy
) -> None:
    for i in range(PER_UPSTREAM + 8):  # the demo backend answers with the model asked for
        await post(http, proxy, {"model": f"made-up-{i}", "max_tokens": 1})
    models = {dict(k)["model"] for k in samples(proxy, "n_proxy_prompt_tokens_total")}
    assert OTHER in models
    assert len(models - {OTHER}) <= PER_UPSTREAM
    assert tokens(proxy, model=OTHER)["prompt"] > 0  # the last ones, under "other"


async def test_streams_observe_their_time_to_first_token_and_per_output_token_by_model(
    http: aiohttp.ClientSession, proxy: Proxy
) -> None:
    await post(http, proxy, {"model": "tiny-c", "n": 2, "max_tokens": 6, "stream": True,
                             "stream_options": {"include_usage": True}})  # fmt: skip
    await post(http, proxy, {"model": "tiny-c", "max_tokens": 6, "stream": True,
                             "stream_options": {"include_usage": True}})  # fmt: skip
    await post(http, proxy, {"model": "tiny-c", "n": 2, "max_tokens": 6})  # JSON: no first token
    labels = (("model", "tiny-c"), ("route", CHAT))
    assert samples(proxy, "n_proxy_time_to_first_token_seconds_count")[labels] == 2
    assert samples(proxy, "n_proxy_time_per_output_token_seconds_count")[labels] == 2
    assert samples(proxy, "n_proxy_time_per_output_token_seconds_sum")[labels] > 0


async def test_only_answers_on_a_fan_out_path_count_tokens(
    http: aiohttp.ClientSession, proxy: Proxy
) -> None:
    async with http.post(proxy.url + "/v1/embeddings", json={"model": "e", "input": "x"}) as r:
        assert r.status == 200
        assert (await r.json())["usage"]["prompt_tokens"] > 0
    models = {dict(k)["route"] for k in samples(proxy, "n_proxy_prompt_tokens_total")}
    assert "other" not in models
    assert tokens(proxy)["prompt"] == 0
