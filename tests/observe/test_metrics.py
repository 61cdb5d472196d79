"""Metrics: the plain families, what a scrape shows as requests flow, and the shipped dashboard
and alert rules (deploy/observability), which may name only metrics the proxy exports."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from bisect import bisect_left
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from proxy.config.models import parse_config
from proxy.observe.metrics import PROTOCOL_ERROR_KINDS
from proxy.observe.plain import PlainCounter, PlainHistogram
from proxy.server.process import Server
from tests.meta.test_docs import anchors
from tests.support.ports import free_port
from tests.support.servers import Backend, running_server

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
MESSAGES = [{"role": "user", "content": "hello"}]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def exposition(*families: PlainCounter | PlainHistogram) -> str:
    class One(Collector):
        def collect(self) -> Any:
            return [f.collect() for f in families]

    registry = CollectorRegistry()
    registry.register(One())
    return generate_latest(registry).decode()


def test_plain_histogram_buckets_are_cumulative_with_prometheus_le() -> None:
    family = PlainHistogram("t_seconds", "Test.", ["route"], buckets=(0.1, 1))
    child = family.labels("/x")
    for value in (0.05, 0.1, 0.5, 3):
        child.observe(value)
    text = exposition(family)
    assert 't_seconds_bucket{le="0.1",route="/x"} 2.0' in text  # 0.1 itself is le 0.1
    assert 't_seconds_bucket{le="1.0",route="/x"} 3.0' in text
    assert 't_seconds_bucket{le="+Inf",route="/x"} 4.0' in text
    assert 't_seconds_count{route="/x"} 4.0' in text
    assert 't_seconds_sum{route="/x"} 3.65' in text


_AMOUNTS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.1, 1.0, 2.0])


@given(
    bounds=st.lists(st.floats(-1e6, 1e6) | st.sampled_from([0.1, 1.0, 2.0]), max_size=20).map(
        lambda found: sorted(set(found))
    ),
    amounts=st.lists(_AMOUNTS, max_size=20),
)
@settings(max_examples=300, deadline=None)
def test_plain_histogram_buckets_each_amount_as_prometheus_does(
    bounds: list[float], amounts: list[float]
) -> None:
    """Each amount counts in the first bucket whose bound is at or above it (``le``), one above
    every bound in +Inf: where ``bisect_left`` puts it, as before the search was written out."""
    family = PlainHistogram("t_seconds", "Test.", [], buckets=bounds)
    child = family.labels()
    expected = [0] * (len(bounds) + 1)
    for amount in amounts:
        child.observe(amount)
        expected[bisect_left(bounds, amount)] += 1
    assert child.counts == expected


def test_plain_counter_without_labels_is_exported_at_zero() -> None:
    text = exposition(PlainCounter("t_things", "Test."))  # no labels
    assert "t_things_total 0.0" in text
    assert "_created" not in text


@pytest.fixture
async def one_slot_server(backend: Backend) -> AsyncIterator[Server]:
    """A whole server whose upstream takes one child at a time and retries a 503."""
    async with running_server(
        backend.url, upstream="max_concurrency: 1, retry_on: [connect, 503]"
    ) as server:
        yield server


async def scrape(http: aiohttp.ClientSession, server: Server) -> Samples:
    async with http.get(f"http://127.0.0.1:{server.admin_port}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def families(http: aiohttp.ClientSession, server: Server) -> set[str]:
    async with http.get(f"http://127.0.0.1:{server.admin_port}/metrics") as r:
        return {f.name for f in text_string_to_metric_families(await r.text())}


def url(server: Server, path: str) -> str:
    return f"http://127.0.0.1:{server.proxy_port}{path}"


async def test_a_fresh_proxy_exports_labelled_counters_at_zero_and_process_metrics(
    http: aiohttp.ClientSession, one_slot_server: Server
) -> None:
    values = await scrape(http, one_slot_server)
    for outcome in ("2xx", "3xx", "4xx", "5xx", "timeout", "unreachable"):
        assert (
            values[("n_proxy_upstream_responses_total", (("outcome", outcome), ("upstream", "u")))]
            == 0
        )
    for reason in ("connect", "503"):
        assert values[("n_proxy_retries_total", (("reason", reason), ("upstream", "u")))] == 0
    for name in ("n_proxy_children_aborted_total", "n_proxy_rejected_total"):
        assert values[(name, (("upstream", "u"),))] == 0
    assert values[("n_proxy_client_timeouts_total", (("phase", "headers"),))] == 0
    for kind in PROTOCOL_ERROR_KINDS:
        assert values[("n_proxy_client_protocol_errors_total", (("kind", kind),))] == 0
    assert values[("n_proxy_queue_depth", (("upstream", "u"),))] == 0
    route = (("fanned_out", "true"), ("route", "/v1/chat/completions"))
    assert values[("n_proxy_request_duration_seconds_count", route)] == 0
    assert values[("n_proxy_request_n_count", ())] == 0
    assert values[("process_cpu_seconds_total", ())] > 0
    assert values[("process_resident_memory_bytes", ())] > 0
    assert not [name for name, _ in values if name.endswith("_created")]


async def test_client_seen_times_queue_and_outcomes_change_as_requests_flow(
    http: aiohttp.ClientSession, one_slot_server: Server, backend: Backend
) -> None:
    before = await scrape(http, one_slot_server)
    body: dict[str, Any] = {
        "model": "m",
        "messages": MESSAGES,
        "n": 3,
        "stream": True,
        "max_tokens": 8,
        "x_demo": {"token_delay": 0.02},
    }
    # max_concurrency 1: while child 0 streams, the other two wait in the queue, and so does
    # a pass-through sent meanwhile.
    async with http.post(url(one_slot_server, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200
        await r.content.readline()
        during = await scrape(http, one_slot_server)
        plain = {"prompt": "x", "max_tokens": 2}
        queued = asyncio.ensure_future(
            http.post(url(one_slot_server, "/v1/completions"), json=plain)
        )
        await r.read()
    async with await queued as r:
        assert r.status == 200
    after = await scrape(http, one_slot_server)

    def grew(name: str, *labels: tuple[str, str]) -> float:
        key = (name, tuple(sorted(labels)))
        return after[key] - before.get(key, 0)

    assert during[("n_proxy_queue_depth", (("upstream", "u"),))] == 2
    assert during[("n_proxy_slots_in_use", (("upstream", "u"),))] == 1
    assert after[("n_proxy_queue_depth", (("upstream", "u"),))] == 0
    fanned = (("route", "/v1/chat/completions"), ("fanned_out", "true"))
    passed = (("route", "/v1/completions"), ("fanned_out", "false"))
    assert grew("n_proxy_request_duration_seconds_count", *fanned) == 1
    assert grew("n_proxy_time_to_first_chunk_seconds_count", *fanned) == 1
    assert grew("n_proxy_request_duration_seconds_count", *passed) == 1
    assert grew("n_proxy_time_to_first_chunk_seconds_count", *passed) == 0  # not streamed
    # Streamed for ~8 tokens x 20 ms per child, children in turns: well past the first chunk.
    assert grew("n_proxy_request_duration_seconds_sum", *fanned) > grew(
        "n_proxy_time_to_first_chunk_seconds_sum", *fanned
    )
    assert grew("n_proxy_queue_wait_seconds_count", ("upstream", "u")) == 4
    waited = grew("n_proxy_queue_wait_seconds_sum", ("upstream", "u"))
    assert waited > 0.3  # two children and the pass-through each waited out a child's stream
    # Waiting for a slot is the upstream's queue, not time the proxy spends.
    assert grew("n_proxy_overhead_seconds_sum") < waited / 3
    assert grew("n_proxy_upstream_responses_total", ("upstream", "u"), ("outcome", "2xx")) == 4


HELD = (
    "n_proxy_requests_in_flight",
    "n_proxy_fanout_children",
    "n_proxy_upstream_connections_in_use",
    "n_proxy_upstream_connections_idle",
)


def held(values: Samples, backend: Backend) -> dict[str, float]:
    """What the proxy holds, as /metrics says: the census gauges, per upstream u."""
    u = (("upstream", "u"),)
    out = {name: values[(name, ())] for name in HELD}
    out["slots"] = values[("n_proxy_slots_in_use", u)]
    out["queued"] = values[("n_proxy_queue_depth", u)]
    out["upstream_requests"] = values[("n_proxy_children_in_flight", u)]
    out["outstanding"] = values[("n_proxy_replica_outstanding", (("replica", backend.url), *u))]
    return out


async def test_what_a_request_holds_is_on_metrics_while_held_and_back_at_zero_after(
    http: aiohttp.ClientSession, one_slot_server: Server, backend: Backend
) -> None:
    await asyncio.wait_for(
        one_slot_server.upstreams.health_checked.wait(), 30
    )  # its first check is over
    before = held(await scrape(http, one_slot_server), backend)
    before.pop("n_proxy_upstream_connections_idle")  # a health check's, kept for reuse
    assert set(before.values()) == {0}
    body: dict[str, Any] = {
        "model": "m",
        "messages": MESSAGES,
        "n": 3,
        "stream": True,
        "max_tokens": 8,
        "x_demo": {"token_delay": 0.02},
    }
    async with http.post(url(one_slot_server, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200
        await r.content.readline()
        during = held(await scrape(http, one_slot_server), backend)
        await r.read()
    # max_concurrency 1: one child upstream, two queued, all three running as tasks.
    assert during["n_proxy_requests_in_flight"] == 1
    assert during["n_proxy_fanout_children"] == 3
    assert (during["slots"], during["queued"]) == (1, 2)
    assert during["upstream_requests"] == during["outstanding"] == 1
    assert during["n_proxy_upstream_connections_in_use"] >= 1  # a health check may add one
    for _ in range(500):  # the handler ends a moment after its last byte: bounded, 5 s
        after = held(await scrape(http, one_slot_server), backend)
        if after["n_proxy_requests_in_flight"] == 0:
            break
        await asyncio.sleep(0.01)
    assert after.pop("n_proxy_upstream_connections_idle") >= 1  # kept for the next request
    health_check = after.pop("n_proxy_upstream_connections_in_use")
    assert set(after.values()) == {0}
    assert health_check <= 1  # one may be under way


async def test_unreachable_and_timed_out_upstreams_are_counted_as_such(
    http: aiohttp.ClientSession, backend: Backend
) -> None:
    config = parse_config(
        f"""
listen: {{host: 127.0.0.1, port: 0}}
admin: {{host: 127.0.0.1, port: 0}}
upstreams:
  - {{name: dead, url: "http://127.0.0.1:9", retries: 0}}
  - name: slow
    url: "{backend.url}"
    timeouts: {{first_byte: 0.2}}
routes:
  - {{model: "slow", upstream: slow}}
""",
        env={},
    )
    server = Server(config)
    await server.start()
    try:
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 2}
        async with http.post(url(server, "/v1/chat/completions"), json=body) as r:
            assert r.status == 502
        stream = {**body, "n": 2, "stream": True}
        async with http.post(url(server, "/v1/chat/completions"), json=stream) as r:
            assert r.status == 502
        slow = {**body, "model": "slow", "n": 2, "x_demo": {"headers_delay": 1.0}}
        async with http.post(url(server, "/v1/chat/completions"), json=slow) as r:
            assert r.status == 504
        values = await scrape(http, server)
    finally:
        await server.close()
    outcomes = "n_proxy_upstream_responses_total"
    # The pass-through, then the stream's first child to fail (its sibling may be cancelled
    # before it fails too).
    assert values[(outcomes, (("outcome", "unreachable"), ("upstream", "dead")))] in (2, 3)
    assert values[(outcomes, (("outcome", "timeout"), ("upstream", "slow")))] >= 1


# --- deploy/observability ------------------------------------------------------------------------

_METRIC = re.compile(r"\b((?:n_proxy|process|python)_[a-z0-9_]+)\b")
_SUFFIX = re.compile(r"_(bucket|sum|count|total)$")


def dashboard_queries() -> list[str]:
    dashboard = json.loads((OBSERVABILITY / "dashboard.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    queries += [
        v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    return queries


def rule_groups() -> list[dict[str, Any]]:
    manifest = yaml.safe_load((OBSERVABILITY / "alerts.yaml").read_text())
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["name"]
    groups: list[dict[str, Any]] = manifest["spec"]["groups"]
    return groups


def named_metrics(query: str) -> set[str]:
    return {_SUFFIX.sub("", name) for name in _METRIC.findall(query)}


async def test_dashboard_and_alert_rules_name_only_metrics_the_proxy_exports(
    http: aiohttp.ClientSession, one_slot_server: Server
) -> None:
    body = {"model": "m", "messages": MESSAGES, "n": 2, "stream": True, "max_tokens": 2}
    async with http.post(url(one_slot_server, "/v1/chat/completions"), json=body) as r:
        await r.read()
    exported = {_SUFFIX.sub("", name) for name, _ in await scrape(http, one_slot_server)}
    exported |= await families(http, one_slot_server)  # a labelled family with no child yet
    queries = dashboard_queries()
    queries += [rule["expr"] for group in rule_groups() for rule in group["rules"]]
    assert len(queries) > 20
    for query in queries:
        named = named_metrics(query)
        assert named, f"names no proxy metric: {query}"
        assert named <= exported, f"{sorted(named - exported)} not exported: {query}"


def test_dashboard_panels_are_well_formed() -> None:
    dashboard = json.loads((OBSERVABILITY / "dashboard.json").read_text())
    assert dashboard["uid"] == "n-proxy"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    for panel in panels:
        assert panel["title"]
        assert panel["targets"]
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    refs = [t["refId"] for p in panels for t in p["targets"]]
    assert all(re.fullmatch("[A-Z]", r) for r in refs)


_DURATION = re.compile(r"\d+[smhd]")


def test_alert_rules_are_well_formed() -> None:
    alerts = [rule for group in rule_groups() for rule in group["rules"]]
    assert len({rule["alert"] for rule in alerts}) == len(alerts) >= 8
    for rule in alerts:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
        assert "for" not in rule or _DURATION.fullmatch(rule["for"]), rule["for"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["expr"]


def test_each_alert_has_a_runbook_in_the_operating_docs() -> None:
    """Its ``runbook_url`` is its section of docs/operating.md under the project's address."""
    homepage = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Homepage"]
    base = f"{homepage}/blob/main/docs/operating.md#"
    sections = anchors(ROOT / "docs" / "operating.md")
    for rule in (rule for group in rule_groups() for rule in group["rules"]):
        url = rule["annotations"]["runbook_url"]
        assert url.startswith(base), url
        assert url.removeprefix(base) == rule["alert"].lower() in sections, url


def test_the_dashboard_shows_tokens_times_per_token_and_the_fan_out_factor_by_model() -> None:
    queries = " ".join(dashboard_queries())
    for metric in (
        "n_proxy_completion_tokens_total",
        "n_proxy_prompt_tokens_total",
        "n_proxy_time_to_first_token_seconds_bucket",
        "n_proxy_time_per_output_token_seconds_bucket",
        "n_proxy_children_per_request_sum",
    ):
        assert metric in queries, metric
    assert "sum by (model)" in queries


def test_alert_rules_pass_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(
            "promtool not installed (Debian: apt-get install prometheus); the rules' "
            "structure is still checked by test_alert_rules_are_well_formed"
        )
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups()}))
    done = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


async def test_under_workers_the_new_series_add_up_over_the_workers(backend: Backend) -> None:
    """Multiprocess mode: prometheus-client's files instead of plain counts, queues sampled."""
    port, admin = free_port(), free_port()
    command = [
        sys.executable, "-m", "proxy", "--upstream", backend.url, "--workers", "2",
        "--port", str(port), "--admin-port", str(admin),
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert process.stdout is not None
        for _ in range(2):
            await asyncio.wait_for(process.stdout.readline(), 30)  # each worker's banner
        body = {"model": "m", "messages": MESSAGES, "n": 2, "stream": True, "max_tokens": 2}
        async with aiohttp.ClientSession() as http:
            for _ in range(10):
                async with http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json=body,
                    headers={"Connection": "close"},  # spread over the workers
                ) as r:
                    assert r.status == 200
                    await r.read()
            await asyncio.sleep(1.5)  # a queue sample from each worker
            async with http.get(f"http://127.0.0.1:{admin}/metrics") as r:
                text = await r.text()
        values = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        route = (("fanned_out", "true"), ("route", "/v1/chat/completions"))
        upstream = (("upstream", "default"),)
        assert values[("n_proxy_request_duration_seconds_count", route)] == 10
        assert values[("n_proxy_time_to_first_chunk_seconds_count", route)] == 10
        assert values[("n_proxy_queue_wait_seconds_count", upstream)] == 20
        ok = (("outcome", "2xx"), ("upstream", "default"))
        assert values[("n_proxy_upstream_responses_total", ok)] == 20
        assert values[("n_proxy_queue_depth", upstream)] == 0
        replica = (("replica", backend.url), ("upstream", "default"))
        assert values[("n_proxy_replica_outstanding", replica)] == 0
        for name in HELD[:3]:  # sampled from each worker and added up
            assert values[(name, ())] == 0
        assert values[("n_proxy_upstream_connections_idle", ())] >= 1
        assert not [name for name, _ in values if name.endswith("_created")]
        exported = {_SUFFIX.sub("", name) for name, _ in values}
        queries = dashboard_queries() + [r["expr"] for g in rule_groups() for r in g["rules"]]
        for query in queries:
            # process_*: single process only; fallbacks: no fallback configured, no label set.
            named = {m for m in named_metrics(query) if not m.startswith("process_")}
            named.discard("n_proxy_fallbacks")
            assert named <= exported, f"{sorted(named - exported)} not exported: {query}"
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 15) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
