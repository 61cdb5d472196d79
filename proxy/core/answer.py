"""What a passed-through answer says of itself, read from its last bytes: its usage, id and model
(docs/operating.md#tokens). Pure, and never raises: bytes it cannot read say nothing.

A pass-through relays its answer as it came, so what the proxy has of it is what it relayed
last: the whole body of a small JSON answer, or the tail of a stream or of a large body. A stream
carries its usage in its last chunks (``stream_options.include_usage``, or a server that sends it
unasked); a JSON body carries it near its end.
"""

from __future__ import annotations

import re
from typing import Any, Final, final

import orjson

# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_json_loads: Final = orjson.loads

# The tail read for an answer's usage: a usage chunk and ``[DONE]`` are a few hundred bytes.
TAIL_BYTES = 16 * 1024
_MAX_LINES = 64  # SSE lines looked at from the end, at most
_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')


@final
class AnswerFacts:
    """A compiled value, not a ``NamedTuple``: one is made for each answer, and a
    ``NamedTuple``'s ``__new__`` is Python code, ten times the cost."""

    __slots__ = ("id", "model", "usage")

    def __init__(
        self,
        usage: dict[str, Any] | None = None,
        id: str | None = None,
        model: str | None = None,
    ) -> None:
        self.usage = usage
        self.id = id
        self.model = model

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AnswerFacts):
            return NotImplemented
        return (self.usage, self.id, self.model) == (other.usage, other.id, other.model)

    def __repr__(self) -> str:
        return f"AnswerFacts(usage={self.usage!r}, id={self.id!r}, model={self.model!r})"


NOTHING = AnswerFacts()


def answer_facts(data: bytes) -> AnswerFacts:
    """The usage, id and model that ``data`` (a whole JSON body, or the last bytes of a stream or
    of a body) holds; each None where it holds none."""
    if data[:1] == b"{" or data.lstrip()[:1] == b"{":
        try:
            body = _json_loads(data)
        except orjson.JSONDecodeError:
            body = None
        if isinstance(body, dict):
            return body_facts(body)
    # find, not `in`: with a bytes operand, `in` first raises and clears a TypeError
    facts = _stream_facts(data) if data.find(b"data:") >= 0 else NOTHING
    if facts.usage is None:
        return AnswerFacts(_usage_object(data), facts.id, facts.model)
    return facts


def body_facts(body: dict[str, Any]) -> AnswerFacts:
    """The usage, id and model of one answer's JSON object (a body, or an SSE event's)."""
    usage = body.get("usage")
    ident = body.get("id", body.get("request_id"))  # vLLM's generate endpoint: request_id
    model = body.get("model")
    return AnswerFacts(
        usage if isinstance(usage, dict) and usage else None,
        ident if isinstance(ident, str) else None,
        model if isinstance(model, str) else None,
    )


def _stream_facts(data: bytes) -> AnswerFacts:
    """From the last events back: the last usage sent, and the last id and model named. A line
    cut by the start of the tail, or by chunked framing, does not parse and is passed over."""
    usage: dict[str, Any] | None = None
    ident = model = None
    for line in data.splitlines()[::-1][:_MAX_LINES]:
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload.startswith(b"{"):
            continue
        try:
            event = _json_loads(payload)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(event, dict):
            continue
        facts = body_facts(event)
        usage = usage or facts.usage
        ident = ident or facts.id
        model = model or facts.model
        if usage is not None and ident is not None and model is not None:
            break
    return AnswerFacts(usage, ident, model)


def _usage_object(data: bytes) -> dict[str, Any] | None:
    """The last ``"usage": {...}`` object whole in ``data``: the end of a JSON body too large to
    be held whole (a usage object holds no string with a brace in it)."""
    starts = [match.end() - 1 for match in _USAGE_KEY.finditer(data)]
    if not starts:
        return None
    start = starts[-1]
    end = data.find(b"}", start)
    while end != -1:
        try:
            usage = _json_loads(data[start : end + 1])
        except orjson.JSONDecodeError:
            end = data.find(b"}", end + 1)
            continue
        return usage if isinstance(usage, dict) and usage else None
    return None
