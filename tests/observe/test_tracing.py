"""Tracing: a server span per request, a client span per child with its own ``traceparent``,
off (and opentelemetry never imported) unless ``OTEL_*`` asks for it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from proxy.config.models import single_upstream_config
from proxy.observe import line as request_line
from proxy.observe import log
from proxy.observe.tracing import Tracing, tracing_from_env, wanted
from tests.support.servers import Backend, Servers, with_upstream

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "hello"}]
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
        ({"OTEL_SERVICE_NAME": "n-proxy"}, False),  # naming the service asks for nothing
    ],
)
def test_tracing_is_on_only_when_otel_variables_ask_for_traces(
    environ: dict[str, str], on: bool
) -> None:
    assert wanted(environ) is on


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def lines() -> Iterator[list[dict[str, object]]]:
    """The request lines the proxy logs, parsed."""
    saved = (log.logger.handlers[:], log.logger.level, log.logger.propagate, request_line._direct)
    out: list[dict[str, object]] = []
    request_line.write_directly(None)
    log.logger.setLevel("INFO")
    log.logger.propagate = False

    class Keep(log._JsonFormatter):
        pass

    handler = log._BatchingHandler()
    handler.setFormatter(Keep())
    handler.add = lambda line: out.append(json.loads(line))  # type: ignore[method-assign]
    log.logger.handlers[:] = [handler]
    yield out
    log.logger.handlers[:], log.logger.level, log.logger.propagate, direct = saved
    request_line.write_directly(direct)


@pytest.fixture
async def traced_proxy(
    servers: Servers, backend: Backend, exporter: InMemorySpanExporter
) -> AsyncIterator[str]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = single_upstream_config(backend.url)
    proxy = await servers.proxy(config, tracing=Tracing(provider))
    yield proxy.url
    await servers.stop(proxy)
    provider.shutdown()


def by_kind(spans: tuple[ReadableSpan, ...], kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in spans if s.kind == kind]


async def test_n3_request_has_one_server_span_and_three_child_spans_each_sent_as_traceparent(
    http: aiohttp.ClientSession,
    traced_proxy: str,
    backend: Backend,
    exporter: InMemorySpanExporter,
    lines: list[dict[str, object]],
) -> None:
    body = {"model": "m", "messages": MESSAGES, "n": 3, "max_tokens": 3}
    headers = {"traceparent": CLIENT_PARENT}
    async with http.post(f"{traced_proxy}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200
        await r.read()
    spans = exporter.get_finished_spans()
    (server,) = by_kind(spans, SpanKind.SERVER)
    children = by_kind(spans, SpanKind.CLIENT)
    assert len(spans) == 4
    assert len(children) == 3
    # The server span continues the client's trace; every child span is the server span's.
    assert f"{server.context.trace_id:032x}" == CLIENT_TRACE
    assert server.parent is not None
    assert f"{server.parent.span_id:016x}" == "b7ad6b7169203331"
    for child in children:
        assert child.parent is not None
        assert child.parent.span_id == server.context.span_id
        assert child.context.trace_id == server.context.trace_id
    assert server.attributes is not None
    assert server.attributes["n_proxy.n"] == 3
    assert server.attributes["http.response.status_code"] == 200
    assert server.name == "chat m"  # GenAI's "{operation} {model}"; the route an attribute
    assert server.attributes["http.route"] == "/v1/chat/completions"
    indexes = {c.attributes["n_proxy.child_index"] for c in children if c.attributes}
    assert indexes == {0, 1, 2}
    for child in children:
        assert child.attributes is not None
        assert child.attributes["n_proxy.replica"] == backend.url
        assert child.attributes["n_proxy.retries"] == 0
        assert child.attributes["http.response.status_code"] == 200
    # Each child reached the backend with its own span as parent, not the client's.
    sent = sorted(h["traceparent"] for _, _, h in backend.state.seen)
    expected = sorted(f"00-{CLIENT_TRACE}-{c.context.span_id:016x}-01" for c in children)
    assert sent == expected
    assert len(set(sent)) == 3
    (line,) = [entry for entry in lines if entry["msg"] == "request"]
    assert line["trace_id"] == CLIENT_TRACE


async def test_pass_through_has_a_client_span_and_a_fresh_trace_without_a_traceparent(
    http: aiohttp.ClientSession,
    traced_proxy: str,
    backend: Backend,
    exporter: InMemorySpanExporter,
    lines: list[dict[str, object]],
) -> None:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2}
    async with http.post(f"{traced_proxy}/v1/chat/completions", json=body) as r:
        assert r.status == 200
    spans = exporter.get_finished_spans()
    (server,) = by_kind(spans, SpanKind.SERVER)
    (client,) = by_kind(spans, SpanKind.CLIENT)
    assert server.parent is None
    assert client.parent is not None
    assert client.parent.span_id == server.context.span_id
    (_, _, sent), *_ = backend.state.seen
    ids = f"00-{server.context.trace_id:032x}-{client.context.span_id:016x}-"
    assert sent["traceparent"].startswith(ids)  # then the flags: sampled, maybe random
    (line,) = [entry for entry in lines if entry["msg"] == "request"]
    assert line["trace_id"] == f"{server.context.trace_id:032x}"


async def test_unreachable_upstream_marks_the_child_span_as_an_error(
    http: aiohttp.ClientSession, servers: Servers, exporter: InMemorySpanExporter
) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = single_upstream_config("http://127.0.0.1:9")  # discard port: nothing listens
    proxy = await servers.proxy(config, tracing=Tracing(provider))
    body = {"model": "m", "messages": MESSAGES, "n": 2}
    async with http.post(proxy.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 502
    await servers.stop(proxy)  # every span ended: the handler is over
    spans = exporter.get_finished_spans()
    (server,) = by_kind(spans, SpanKind.SERVER)
    assert not server.status.is_ok
    failed = [c for c in by_kind(spans, SpanKind.CLIENT) if not c.status.is_ok]
    assert failed  # the first failure; its sibling may be cancelled before it answers
    assert failed[0].attributes is not None
    assert failed[0].attributes["error.type"] == "UpstreamUnavailable"


def test_tracing_off_never_imports_opentelemetry() -> None:
    """A whole server answering a fan-out and a pass-through, OTEL_* unset: no opentelemetry."""
    script = """
import asyncio, sys
import aiohttp
from proxy.config.models import Listen, single_upstream_config
from proxy.devserver import DevConfig, start_devserver
from proxy.server.process import Server

async def main():
    runner, port, _ = await start_devserver(DevConfig())
    config = single_upstream_config(f"http://127.0.0.1:{port}")
    config = config.model_copy(update={"listen": Listen(host="127.0.0.1", port=0)})
    server = Server(config)
    await server.start()
    url = f"http://127.0.0.1:{server.proxy_port}/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        for n in (1, 3):
            async with http.post(url, json={**body, "n": n}) as r:
                assert r.status == 200, r.status
    assert server.tracing is None
    await server.close()
    await runner.cleanup()

asyncio.run(main())
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
print(loaded)
"""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environ["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


async def test_otlp_endpoint_builds_a_batching_otlp_pipeline(
    http: aiohttp.ClientSession,
    servers: Servers,
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT alone: a fan-out's spans reach a collector at that endpoint
    over OTLP/HTTP (protobuf, /v1/traces), all in one batch, sent when the batch is flushed
    and not as each span ends; and the GenAI metrics beside them (/v1/metrics)."""

    async def collect(request: web.Request) -> web.Response:
        return web.Response(body=b"", content_type="application/x-protobuf")  # accepted

    collector = await servers.upstream(collect)
    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # no timed export: only the flush
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")
    tracing = tracing_from_env(os.environ)
    assert tracing is not None
    config = single_upstream_config(backend.url)
    proxy = await servers.proxy(config, tracing=tracing)
    body = {"model": "m", "messages": MESSAGES, "n": 2, "max_tokens": 2}
    async with http.post(proxy.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        await r.read()
    await servers.stop(proxy)  # every span ended: the handler is over
    assert collector.seen == []  # three spans ended, all still in the batch
    assert await tracing.close(WITHIN) is True
    exports = {seen.path: seen for seen in collector.seen}
    assert len(collector.seen) == len(exports) == 2
    export = exports["/v1/traces"]
    assert export.method == "POST"
    assert export.headers["Content-Type"] == "application/x-protobuf"
    sent = ExportTraceServiceRequest.FromString(export.body)
    (resource,) = sent.resource_spans
    service = [
        a.value.string_value for a in resource.resource.attributes if a.key == "service.name"
    ]
    assert service == ["n-proxy"]
    spans = [span for scope in resource.scope_spans for span in scope.spans]
    kinds = sorted(Span.SpanKind.Name(span.kind) for span in spans)
    assert kinds == ["SPAN_KIND_CLIENT", "SPAN_KIND_CLIENT", "SPAN_KIND_SERVER"]
    assert len({span.trace_id for span in spans}) == 1  # one request's trace
    metrics = ExportMetricsServiceRequest.FromString(exports["/v1/metrics"].body)
    (resource_metrics,) = metrics.resource_metrics
    names = {m.name for scope in resource_metrics.scope_metrics for m in scope.metrics}
    assert {"gen_ai.client.token.usage", "gen_ai.client.operation.duration"} <= names


DRAIN_SECONDS = 3.0
# Above DRAIN_SECONDS, what exiting may take on a loaded machine (listeners closed, the last
# spans' bound): generous, and far below the SDK's own 30 s.
EXIT_MARGIN = 10.0
WITHIN = 30.0  # any one wait of these tests, bounded


async def test_sigterm_exits_within_drain_seconds_while_the_collector_never_answers(
    backend: Backend, tmp_path: Path
) -> None:
    collector_connections: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        collector_connections.append(writer)  # accepted, read, never answered
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass

    collector = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    config = tmp_path / "config.yaml"
    config.write_text(
        f"upstreams: [{{name: chat, url: '{backend.url}'}}]\n"
        f"drain_seconds: {DRAIN_SECONDS}\ndrain_grace_seconds: 0.2\n"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environ.update(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.sockets[0].getsockname()[1]}",
        OTEL_EXPORTER_OTLP_TIMEOUT="60",  # the SDK's own bound: one export may take a minute
        OTEL_BSP_SCHEDULE_DELAY="600000",  # the spans wait in their batch until the shutdown
    )
    command = [sys.executable, "-m", "proxy", "--config", str(config), "--port", "0"]
    process = await asyncio.create_subprocess_exec(
        *command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        assert process.stderr is not None
        async with asyncio.timeout(WITHIN):
            banner = (await process.stdout.readline()).decode()
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", banner)
        assert found, banner
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 2, "n": 2}
        url = found.group(1) + "/v1/chat/completions"
        async with aiohttp.ClientSession() as http, http.post(url, json=body) as r:
            assert r.status == 200  # three spans batched, for a collector that never answers
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        async with asyncio.timeout(WITHIN + DRAIN_SECONDS):
            assert await process.wait() == 0
        exited_after = time.monotonic() - signalled
        log = (await process.stderr.read()).decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        collector.close()
        for writer in collector_connections:
            writer.close()
    assert exited_after < DRAIN_SECONDS + EXIT_MARGIN
    (dropped,) = [json.loads(line) for line in log.splitlines() if "spans not sent" in line]
    assert dropped["level"] == "info"


@pytest.mark.parametrize("stream", [False, True])
async def test_spans_carry_the_genai_attributes_of_a_fanned_out_chat(
    http: aiohttp.ClientSession,
    traced_proxy: str,
    backend: Backend,
    exporter: InMemorySpanExporter,
    stream: bool,
) -> None:
    """The model, the operation, n, the merged usage and every choice's finish reason on the
    server span; the model, the operation and the replica's address on each child's span."""
    body: dict[str, object] = {
        "model": "tiny-chat", "messages": MESSAGES, "n": 3, "max_tokens": 4, "stream": stream,
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with http.post(f"{traced_proxy}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        raw = await r.read()
    if stream:
        lines = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: {")]
        (usage,) = [p["usage"] for p in map(json.loads, lines) if p.get("usage")]
    else:
        usage = json.loads(raw)["usage"]
    spans = exporter.get_finished_spans()
    (server,) = by_kind(spans, SpanKind.SERVER)
    assert server.attributes is not None
    assert server.attributes["gen_ai.operation.name"] == "chat"
    assert server.attributes["gen_ai.request.model"] == "tiny-chat"
    assert server.attributes["gen_ai.request.choice.count"] == 3
    assert server.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
    assert server.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
    assert server.attributes["gen_ai.response.finish_reasons"] == ("length",) * 3
    children = by_kind(spans, SpanKind.CLIENT)
    assert len(children) == 3
    port = int(backend.url.rsplit(":", 1)[1])
    for child in children:
        assert child.attributes is not None
        assert child.attributes["gen_ai.operation.name"] == "chat"
        assert child.attributes["gen_ai.request.model"] == "tiny-chat"
        assert (child.attributes["server.address"], child.attributes["server.port"]) == (
            "127.0.0.1",
            port,
        )


async def test_completions_span_names_the_text_completion_operation(
    http: aiohttp.ClientSession, traced_proxy: str, exporter: InMemorySpanExporter
) -> None:
    body = {"model": "tiny", "prompt": "once", "n": 2, "max_tokens": 2}
    async with http.post(f"{traced_proxy}/v1/completions", json=body) as r:
        assert r.status == 200
        answer = await r.json()
    (server,) = by_kind(exporter.get_finished_spans(), SpanKind.SERVER)
    assert server.attributes is not None
    assert server.attributes["gen_ai.operation.name"] == "text_completion"
    assert server.attributes["gen_ai.request.choice.count"] == 2
    reasons = tuple(c["finish_reason"] for c in answer["choices"])
    assert server.attributes["gen_ai.response.finish_reasons"] == reasons
    assert server.attributes["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"]


@pytest.fixture
def metric_reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
async def genai_proxy(
    servers: Servers,
    backend: Backend,
    exporter: InMemorySpanExporter,
    metric_reader: InMemoryMetricReader,
) -> AsyncIterator[str]:
    """A traced proxy with its GenAI metrics read in memory, its upstream named as vLLM."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    meters = MeterProvider(metric_readers=[metric_reader])
    config = with_upstream(single_upstream_config(backend.url), provider="vllm")
    proxy = await servers.proxy(config, tracing=Tracing(provider, meters))
    yield proxy.url
    await servers.stop(proxy)
    provider.shutdown()
    meters.shutdown()


async def test_spans_follow_the_genai_conventions_name_provider_parameters_and_answer(
    http: aiohttp.ClientSession, genai_proxy: str, exporter: InMemorySpanExporter
) -> None:
    """``{operation} {model}`` spans; the provider the config names; the sampling parameters
    asked; the answer's id and model; the same on each child's span but the answer."""
    body = {
        "model": "tiny-chat", "messages": MESSAGES, "n": 2, "max_tokens": 3, "seed": 11,
        "temperature": 0.7, "top_p": 0.9, "stop": ["\n\n", "END"],
    }  # fmt: skip
    async with http.post(f"{genai_proxy}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        answer = await r.json()
    spans = exporter.get_finished_spans()
    (server,) = by_kind(spans, SpanKind.SERVER)
    assert server.name == "chat tiny-chat"
    assert server.attributes is not None
    assert {k: v for k, v in server.attributes.items() if k.startswith("gen_ai.request.")} == {
        "gen_ai.request.model": "tiny-chat",
        "gen_ai.request.choice.count": 2,
        "gen_ai.request.max_tokens": 3,
        "gen_ai.request.seed": 11,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.stop_sequences": ("\n\n", "END"),
    }
    assert server.attributes["gen_ai.provider.name"] == "vllm"
    assert server.attributes["gen_ai.response.id"] == answer["id"]
    assert server.attributes["gen_ai.response.model"] == answer["model"]
    for child in by_kind(spans, SpanKind.CLIENT):
        assert child.name == "chat tiny-chat"
        assert child.attributes is not None
        assert child.attributes["gen_ai.provider.name"] == "vllm"
        assert child.attributes["gen_ai.request.seed"] == 11


async def test_a_passed_through_answer_names_its_id_model_and_tokens_on_its_span(
    http: aiohttp.ClientSession, genai_proxy: str, exporter: InMemorySpanExporter
) -> None:
    body = {"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with http.post(f"{genai_proxy}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: {")]
    last = json.loads(events[-1])
    (server,) = by_kind(exporter.get_finished_spans(), SpanKind.SERVER)
    assert server.attributes is not None
    assert server.attributes["gen_ai.response.id"] == last["id"]
    assert server.attributes["gen_ai.usage.output_tokens"] == last["usage"]["completion_tokens"]


def _points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        metric.name: list(metric.data.data_points)
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }


async def test_the_genai_metrics_count_the_tokens_and_times_of_each_answer(
    http: aiohttp.ClientSession, genai_proxy: str, metric_reader: InMemoryMetricReader
) -> None:
    body = {"model": "tiny-chat", "messages": MESSAGES, "n": 3, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with http.post(f"{genai_proxy}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: {")]
    (usage,) = [e["usage"] for e in map(json.loads, events) if e.get("usage")]
    points = _points(metric_reader)
    by_type = {p.attributes["gen_ai.token.type"]: p for p in points["gen_ai.client.token.usage"]}
    assert by_type["input"].sum == usage["prompt_tokens"]
    assert by_type["output"].sum == usage["completion_tokens"]
    for point in by_type.values():
        assert point.attributes["gen_ai.provider.name"] == "vllm"
        assert point.attributes["gen_ai.request.model"] == "tiny-chat"
        assert point.attributes["gen_ai.operation.name"] == "chat"
    for name in (
        "gen_ai.client.operation.duration",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
    ):
        (point,) = points[name]
        assert point.count == 1
