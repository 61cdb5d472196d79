"""Fault injection: the `x_demo` faults a request may ask for, the ones that reshape a
generation, and the connection reset; the rest fire where `generation` sends the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from aiohttp import web

from proxy.devserver.model import Generation, Token

FAULT_CAP_SECONDS = 600.0
HUGE_WORD = " " + "x" * (1 << 20)
STATUS_FAULTS = {"status_400": 400, "status_429": 429, "status_500": 500}
FAULTS = frozenset(
    {*STATUS_FAULTS, "reset_before_headers", "reset_mid_stream", "error_event", "bad_json"}
    | {"idle_forever", "no_headers", "huge_line", "crlf", "cr", "ping", "gzip", "abort"}
)
# Faults that fire once `after_tokens` tokens have been produced.
MID_STREAM_FAULTS = frozenset({"reset_mid_stream", "error_event", "bad_json", "idle_forever"})
ERROR_EVENT = orjson.dumps(
    {"error": {"message": "Injected error event", "type": "server_error", "code": 500}}
)


@dataclass(frozen=True)
class Knobs:
    """The `x_demo` vendor field: per-request delay and fault injection."""

    fault: str | None = None
    after_tokens: int = 1
    token_delay: float | None = None
    headers_delay: float = 0.0  # seconds before the status line: a child slow to start


def shape_generation(gen: Generation, knobs: Knobs) -> Generation:
    """Apply the faults that change what is generated rather than how it is sent."""
    if knobs.fault == "abort":
        return Generation(gen.tokens[: knobs.after_tokens], "abort", gen.key)
    if knobs.fault == "huge_line" and gen.tokens:
        tokens = list(gen.tokens)
        at = min(knobs.after_tokens, len(tokens) - 1)
        tokens[at] = Token(HUGE_WORD, tokens[at].logprob)
        return Generation(tuple(tokens), gen.finish_reason, gen.key)
    return gen


def reset_connection(request: web.BaseRequest) -> None:
    """Abort the connection; aiohttp's attempt to write the handler's response then fails."""
    if request.transport is not None:
        request.transport.abort()
