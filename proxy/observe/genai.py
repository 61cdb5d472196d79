"""OpenTelemetry's GenAI semantic conventions, from the request's record: the span name
(``{operation} {model}``), the attributes of what was asked (the operation, the provider, the
model, the sampling parameters) and of what was answered (id, model, finish reasons, tokens),
and, where tracing is on, the GenAI metrics (``GenAIMetrics``: token usage, operation duration,
time to first token and per output token). docs/operating.md#tracing lists them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from proxy.core import endpoint_of, is_int, is_number, token_counts
from proxy.observe.record import Observer, RequestRecord

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter

# gen_ai.operation.name of each fan-out endpoint.
_OPERATIONS = {"chat": "chat", "completions": "text_completion", "generate": "text_completion"}
# The request's sampling parameters and their attribute names.
_NUMBERS = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
}
_MAX_STOPS = 16  # stop sequences named on a span, at most
# gen_ai.client.token.usage's buckets, as the conventions give them.
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)


def operation(record: RequestRecord) -> str | None:
    """The GenAI operation of a request on a fan-out path; None elsewhere."""
    endpoint = endpoint_of(record.route) if record.route != "other" else None
    return _OPERATIONS[endpoint] if endpoint is not None else None


def span_name(operation: str, record: RequestRecord) -> str:
    """``{operation} {model}``, or the operation alone when the request named no model."""
    return f"{operation} {record.model}" if record.model else operation


def asked(record: RequestRecord, operation: str) -> dict[str, Any]:
    """What the request asked of the model: the operation, the provider, the model, and the
    sampling parameters its body gave (a generate request's are in ``sampling_params``)."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": record.provider,
    }
    if record.model is not None:
        attributes["gen_ai.request.model"] = record.model
    if record.fanned_out:
        attributes["gen_ai.request.choice.count"] = record.n
    body = record.body
    if body is None:
        return attributes
    params = body.get("sampling_params")
    fields: Mapping[str, Any] = params if isinstance(params, dict) else body
    for key, name in _NUMBERS.items():
        value = fields.get(key)
        if is_number(value):
            attributes[name] = value
    limit = fields.get("max_completion_tokens", fields.get("max_tokens"))
    if is_int(limit):
        attributes["gen_ai.request.max_tokens"] = limit
    seed = fields.get("seed")
    if is_int(seed):
        attributes["gen_ai.request.seed"] = seed
    stop = fields.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    named = [s[:200] for s in stops[:_MAX_STOPS] if isinstance(s, str)]
    if named:
        attributes["gen_ai.request.stop_sequences"] = named
    return attributes


def answered(record: RequestRecord) -> dict[str, Any]:
    """What the answer said: its id, its model, each choice's finish reason, its tokens."""
    attributes: dict[str, Any] = {}
    if record.response_id is not None:
        attributes["gen_ai.response.id"] = record.response_id
    if record.response_model is not None:
        attributes["gen_ai.response.model"] = record.response_model
    reasons = [r for r in record.finish_reasons if r is not None]
    if reasons:
        attributes["gen_ai.response.finish_reasons"] = reasons
    if record.usage is not None:
        tokens = token_counts(record.usage)
        attributes["gen_ai.usage.input_tokens"] = tokens.prompt
        attributes["gen_ai.usage.output_tokens"] = tokens.completion
    return attributes


class GenAIMetrics(Observer):
    """The GenAI metrics of each request on a fan-out path, where tracing is on: the tokens it
    used (``gen_ai.client.token.usage``, input and output), how long it took
    (``gen_ai.client.operation.duration``, with ``error.type`` when it failed), and, for a
    stream, the time to its first token and per output token after it
    (``gen_ai.server.time_to_first_token``, ``gen_ai.server.time_per_output_token``)."""

    def __init__(self, meter: Meter) -> None:
        self._tokens = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}",
            description="Measures number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=list(TOKEN_BUCKETS),
        )  # fmt: skip
        self._duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s", description="GenAI operation duration."
        )
        self._first_token = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="Time to generate first token for successful responses.",
        )  # fmt: skip
        self._per_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token generated after the first token for successful "
            "responses.",
        )  # fmt: skip

    def ended(self, record: RequestRecord) -> None:
        name = operation(record)
        if name is None:
            return
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": name,
            "gen_ai.provider.name": record.provider,
        }
        if record.model is not None:
            attributes["gen_ai.request.model"] = record.model
        if record.response_model is not None:
            attributes["gen_ai.response.model"] = record.response_model
        ok = 200 <= record.status < 300
        self._duration.record(
            record.seconds, attributes if ok else {**attributes, "error.type": str(record.status)}
        )
        if not ok:
            return
        usage = record.usage
        tokens = token_counts(usage) if usage is not None else None
        if tokens is not None:
            self._tokens.record(tokens.prompt, {**attributes, "gen_ai.token.type": "input"})
            self._tokens.record(tokens.completion, {**attributes, "gen_ai.token.type": "output"})
        first = record.first_chunk
        if first is None:
            return
        self._first_token.record(first, attributes)
        choices = len(record.children) if record.fanned_out else 1
        if tokens is not None and tokens.completion > choices and record.first_chunk_at is not None:
            after = max(record.ended_at - record.first_chunk_at, 0.0)
            self._per_token.record(after / (tokens.completion / choices - 1), attributes)
