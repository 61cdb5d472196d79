"""The per-request log line, built from the request's record (its fields are listed in
docs/operating.md#logs); compiled, as every request pays for it. Writing it is
``proxy.observe.log``'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from itertools import count
from typing import Any

from proxy.observe.log import log_request, logger
from proxy.observe.record import Observer, RequestRecord

_INFO = logging.INFO


class RequestLine(Observer):
    """The request's line at its end, from its record: ids, where it went, sizes, times, tokens
    (fields in the README, Operating)."""

    def ended(self, record: RequestRecord) -> None:
        if not logger.isEnabledFor(_INFO):
            return
        log_request(request_fields(record))


def request_fields(record: RequestRecord) -> dict[str, Any]:
    usage = record.usage
    first_chunk = record.first_chunk
    headers = record.headers
    return {
        "request_id": record.request_id or logged_id(headers),
        "trace_id": record.trace_id or _incoming_trace_id(headers),
        "client": record.client,
        "method": record.method,
        "path": record.path,
        "route": record.route,
        "model": record.model,
        "upstream": record.upstream,
        "replica": record.replicas(),
        "n": record.n,
        "children": len(record.children) if record.fanned_out else 0,
        "children_aborted": record.aborted,
        "retries": record.retries,
        "status": record.status,
        "bytes_in": record.bytes_in,
        "bytes_out": record.bytes_out,
        "duration_ms": ms(record.ended_at - record.started),
        "ttft_ms": ms(first_chunk) if first_chunk is not None else None,
        "prompt_tokens": usage.get("prompt_tokens") if usage else None,
        "completion_tokens": usage.get("completion_tokens") if usage else None,
    }  # fmt: skip


def ms(seconds: float) -> float:
    """Milliseconds to the microsecond: ``round(seconds * 1000, 3)`` at a third of its cost
    (a float rounded to digits goes through its decimal string)."""
    return round(seconds * 1e6) / 1000


# The line's request id when the client sent none: unique per process, cheap per request.
_ID_PREFIX = os.urandom(6).hex()
_ids = count(1)


def logged_id(headers: Mapping[str, str]) -> str:
    """The client's id, else one of the proxy's own (never sent upstream: a pass-through sends
    exactly the client's request)."""
    incoming = headers.get("X-Request-Id")
    return incoming[:200] if incoming is not None else f"{_ID_PREFIX}-{next(_ids):x}"


def _incoming_trace_id(headers: Mapping[str, str]) -> str | None:
    """The client's W3C trace id, logged even with tracing off, for finding the request."""
    parent = headers.get("traceparent")
    if parent is None or len(parent) < 55 or parent[2] != "-":
        return None
    return parent[3:35]
