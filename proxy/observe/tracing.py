"""Optional OpenTelemetry tracing (the ``otel`` extra): a server span per request and a client
span per upstream request or child, each child sent with its own ``traceparent``; an observer of
the request's record (``proxy.observe.record``), which holds the spans. On a fan-out path the
spans follow the GenAI semantic conventions (``proxy.observe.genai``: their names, the
``gen_ai.*`` attributes), and the GenAI metrics are exported beside them.

Off unless the standard ``OTEL_*`` variables ask for traces (``wanted``). When off, nothing
here imports opentelemetry and no step of a request calls into this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from proxy.observe.genai import GenAIMetrics, answered, asked, operation, span_name
from proxy.observe.log import log_event
from proxy.observe.record import ChildRecord, Observer, RequestRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

_HOP_TRACE_HEADERS = ("traceparent", "tracestate")


def wanted(environ: Mapping[str, str]) -> bool:
    """Traces are asked for by ``OTEL_TRACES_EXPORTER`` (other than ``none``), else by an OTLP
    endpoint; ``OTEL_SDK_DISABLED=true`` turns them off whatever else is set."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER")
    if exporter is not None:
        return exporter.strip().lower() not in ("", "none")
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def tracing_from_env(environ: Mapping[str, str] = os.environ) -> Tracing | None:
    if not wanted(environ):
        return None
    try:
        provider = _provider_from_env(environ)
        return Tracing(provider, _meters_from_env(environ, provider))
    except ImportError as exc:
        log_event(
            "tracing is asked for by OTEL_* but opentelemetry is missing: "
            "pip install 'n-proxy[otel]'; running without traces",
            error=str(exc),
        )
        return None


def _exporters(environ: Mapping[str, str], signal: str) -> list[str]:
    """The exporters ``OTEL_{signal}_EXPORTER`` names (otlp by default), lower-cased."""
    listed = environ.get(f"OTEL_{signal}_EXPORTER", "otlp")
    return [name.strip().lower() for name in listed.split(",")]


def _grpc(environ: Mapping[str, str], signal: str) -> bool:
    """Whether the signal's OTLP exporter speaks gRPC (else http/protobuf, the SDK's default):
    its own ``OTEL_EXPORTER_OTLP_{signal}_PROTOCOL``, else the shared one."""
    shared = environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    return environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", shared) == "grpc"


def _provider_from_env(environ: Mapping[str, str]) -> TracerProvider:
    """The SDK configured by its own ``OTEL_*`` variables (sampler, resource, OTLP endpoint,
    headers, protocol); spans leave in batches from the SDK's thread, off the event loop."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {"service.name": "n-proxy"}
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in _exporters(environ, "TRACES"):
        exporter: SpanExporter
        if name == "console":
            exporter = ConsoleSpanExporter()
        elif name == "otlp":
            if _grpc(environ, "TRACES"):
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                    OTLPSpanExporter as GrpcExporter,
                )

                exporter = GrpcExporter()
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                exporter = OTLPSpanExporter()
        else:
            raise ImportError(f"no span exporter named {name!r} here (otlp or console)")
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _meters_from_env(environ: Mapping[str, str], traces: TracerProvider) -> MeterProvider | None:
    """Where tracing is on, the GenAI metrics beside the spans, to the same collector, unless
    ``OTEL_METRICS_EXPORTER`` is ``none`` (the SDK reads its own ``OTEL_*`` variables: the
    endpoint, headers, export interval)."""
    names = _exporters(environ, "METRICS")
    if names == ["none"]:
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        MetricExporter,
        PeriodicExportingMetricReader,
    )

    readers = []
    for name in names:
        exporter: MetricExporter
        if name == "console":
            exporter = ConsoleMetricExporter()
        elif name == "otlp":
            if _grpc(environ, "METRICS"):
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (  # type: ignore[import-not-found]
                    OTLPMetricExporter as GrpcMetricExporter,
                )

                exporter = GrpcMetricExporter()
            else:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                    OTLPMetricExporter,
                )

                exporter = OTLPMetricExporter()
        else:
            raise ImportError(f"no metric exporter named {name!r} here (otlp or console)")
        readers.append(PeriodicExportingMetricReader(exporter))
    # Shut down by ``Tracing.close`` within the drain's bound, never at interpreter exit: there,
    # a collector that never answers would hold the process for the SDK's own timeouts.
    return MeterProvider(metric_readers=readers, resource=traces.resource, shutdown_on_exit=False)


class Tracing(Observer):
    """Spans for one proxy instance, from ``provider`` (tests pass one with an in-memory
    exporter): each request's server span from its ``begun`` to its ``ended``, each upstream
    request's client span from its first try (``sent``) to its end; with ``meters``, the GenAI
    metrics of each request on a fan-out path (``proxy.observe.genai``)."""

    def __init__(self, provider: TracerProvider, meters: MeterProvider | None = None) -> None:
        from opentelemetry import propagate, trace

        self._provider = provider
        self._meters = meters
        self._tracer = provider.get_tracer("n-proxy")
        self._propagate = propagate
        self._trace = trace
        self._genai = GenAIMetrics(meters.get_meter("n-proxy")) if meters is not None else None

    def begun(self, record: RequestRecord) -> None:
        """The request's span, a child of the client's ``traceparent`` when it sent one."""
        method = record.method
        span = record.span = self._tracer.start_span(
            method,
            context=self._propagate.extract(record.headers),
            kind=self._trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": record.path},
        )
        record.trace_id = f"{span.get_span_context().trace_id:032x}"

    def sent(self, child: ChildRecord, headers: MutableMapping[str, str]) -> None:
        """The child's span; its ``headers`` (not sent yet) carry the span's own ``traceparent``
        instead of the client's: a fan-out child is its own hop."""
        record = child.record
        parent = record.span
        if parent is None:
            return
        method = record.method
        genai = operation(record)
        span = child.span = self._tracer.start_span(
            span_name(genai, record) if genai is not None else f"{method} {record.upstream}",
            context=self._trace.set_span_in_context(parent),
            kind=self._trace.SpanKind.CLIENT,
            attributes={"http.request.method": method, "n_proxy.upstream": record.upstream,
                        "n_proxy.replica": child.replica or ""},
        )  # fmt: skip
        if genai is not None:
            span.set_attributes(asked(record, genai))
        if child.replica is not None:
            span.set_attributes(_server_address(child.replica))
        if child.index is not None:
            span.set_attribute("n_proxy.child_index", child.index)
        for name in _HOP_TRACE_HEADERS:
            if name in headers:
                del headers[name]
        self._propagate.inject(headers, context=self._trace.set_span_in_context(span))

    def child_ended(self, child: ChildRecord, failure: BaseException | None) -> None:
        span = child.span
        if span is None:
            return
        status = child.status
        error = _failure(failure) if failure is not None else None
        attributes: dict[str, Any] = {"n_proxy.retries": child.retries}
        if child.replica is not None:  # a retry may have gone to another replica
            attributes["n_proxy.replica"] = child.replica
            attributes.update(_server_address(child.replica))
        if status:
            attributes["http.response.status_code"] = status
        if error is not None:
            attributes["error.type"] = type(error).__name__
            span.record_exception(error)
        span.set_attributes(attributes)
        if error is not None or status >= 500:
            span.set_status(self._trace.StatusCode.ERROR)
        span.end()

    def ended(self, record: RequestRecord) -> None:
        span = record.span
        if span is None:
            return
        route, status = record.route, record.status
        genai = operation(record)
        if genai is not None:  # GenAI's conventions: "{operation} {model}"
            span.update_name(span_name(genai, record))
            span.set_attributes({**asked(record, genai), **answered(record)})
        if route != "other":
            span.set_attribute("http.route", route)
        span.set_attributes(
            {
                "http.response.status_code": status,
                "n_proxy.upstream": record.upstream,
                "n_proxy.n": record.n,
                "n_proxy.children": len(record.children) if record.fanned_out else 0,
            }
        )
        if status >= 500:
            span.set_status(self._trace.StatusCode.ERROR)
        span.end()
        if self._genai is not None:
            self._genai.ended(record)

    async def close(self, within: float) -> bool:
        """Send what is batched (at shutdown), for ``within`` seconds at most; False when that
        was not enough and the spans left are dropped.

        The SDK's shutdown waits for as long as a collector that accepts and never answers
        takes to time out (each batch's export, retried, up to 30 s in all), past a pod's grace
        period; so it runs in a daemon thread that, past the bound, ends with the process."""
        loop = asyncio.get_running_loop()
        providers: list[TracerProvider | MeterProvider] = [self._provider]
        if self._meters is not None:
            providers.append(self._meters)
        left = [len(providers)]
        done = asyncio.Event()

        def one_done() -> None:
            left[0] -= 1
            if not left[0]:
                done.set()

        def shut_down(provider: TracerProvider | MeterProvider) -> None:
            try:
                provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    loop.call_soon_threadsafe(one_done)

        for provider in providers:  # side by side: each may wait on the collector
            threading.Thread(
                target=shut_down, args=(provider,), name="n-proxy-tracing-close", daemon=True
            ).start()
        try:
            async with asyncio.timeout(within):
                await done.wait()
        except TimeoutError:
            log_event("spans not sent at shutdown: dropped", within_s=round(within, 1))
            return False
        return True


def _server_address(url: str) -> dict[str, Any]:
    """``server.address`` and ``server.port`` of a replica's URL (its scheme's port if none)."""
    parts = urlsplit(url)
    attributes: dict[str, Any] = {}
    if parts.hostname:
        attributes["server.address"] = parts.hostname
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    if port is not None:
        attributes["server.port"] = port
    return attributes


def _failure(exc: BaseException) -> BaseException | None:
    """A cancelled child (a sibling failed, the client left) is not the upstream's error."""
    return None if isinstance(exc, asyncio.CancelledError | GeneratorExit) else exc
