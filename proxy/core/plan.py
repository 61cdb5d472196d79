"""Validating a fan-out request and planning its children (docs/behaviour.md#validation,
#children, #best-of, #generate), with the JSON value rules the body policy rests on (``is_int``:
JSON's ``true`` is not a number). Pure: no I/O.

``plan_request`` returns ``None`` when the request passes through untouched (n missing, null or 1),
otherwise a ``Plan`` with one ``Child`` per (prompt, choice).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeGuard

import orjson

from proxy.core.errors import InvalidRequest

# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_json_loads: Final = orjson.loads
_json_dumps: Final = orjson.dumps

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
RANDOM_SEED = -1  # llama.cpp's and vLLM's "random" sentinel: sent unchanged to every child

# The kinds of answer the proxy stitches: OpenAI chat and completions, and vLLM's token-in/token-out
# generate, whose n and seed sit in ``sampling_params`` (docs/behaviour.md#generate).
Endpoint = Literal["chat", "completions", "generate"]


# JSON numbers as the OpenAI API means them: Python's ``bool`` is an ``int``, JSON's ``true`` is
# not a number.
def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def endpoint_of(path: str) -> Endpoint | None:
    """The kind of a fan-out path, decided once from its last segments (docs/behaviour.md#fan-out):
    a prefix such as ``/openai/v1`` may stand in front; any other path has no kind the proxy can
    stitch."""
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completions"
    if path.endswith("/generate"):
        return "generate"
    return None


# Not frozen, though nothing changes a plan once made: mypyc builds a frozen dataclass through
# the interpreted __init__ dataclasses writes, 7,000 to 14,000 instructions each, and a fan-out
# of four made six (docs/architecture.md#working-on-a-compiled-module).
@dataclass(slots=True)
class Child:
    index: int  # the choice index the client sees (p * n + i)
    prompt: int  # which prompt of a list this child answers
    body: bytes  # the child's JSON body, ready to send
    request_id: str  # the child's X-Request-Id


@dataclass(slots=True)
class Plan:
    parent_id: str
    endpoint: Endpoint
    n: int  # choices per prompt the client sees
    stream: bool
    include_usage: bool
    continuous_usage: bool
    children: tuple[Child, ...]
    best_of: int | None = None  # children per prompt when ranking (docs/behaviour.md#best-of)
    keep_logprobs: bool = True  # False: strip the logprobs that best_of asked for on our behalf

    @property
    def prompts(self) -> int:
        return len(self.children) // (self.best_of or self.n)


# A run of 19 digits may not fit in 64 bits. Looked for as 19 zeros in the body with every digit
# made a zero: a substring search, a tenth of what the regex ``\d{19}`` costs on every body.
_DIGITS_AS_ZERO: Final = bytes.maketrans(b"123456789", b"000000000")
_HUGE_INT: Final = b"0" * 19


def parse_body(raw: bytes) -> dict[str, Any]:
    """The one JSON policy for request bodies (docs/behaviour.md#validation): a JSON object,
    strictly RFC 8259.

    ``orjson`` judges every body, so ``NaN``, ``Infinity``, ``1e400``, a leading BOM, lone
    surrogates and invalid UTF-8 are 400 whatever else the body holds. It reads integers past
    64 bits as floats, though, and children must get them unchanged: a body that may hold one
    is read again, already validated, by ``json``, which keeps every integer exact.
    """
    try:
        body = _json_loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    # find, not in: CPython's bytes ``in`` first tries its operand as an int, and formats and
    # drops a TypeError (2,400 instructions a request).
    if raw.translate(_DIGITS_AS_ZERO).find(_HUGE_INT) != -1:
        try:
            body = json.loads(raw.decode("utf-8"))
        except RecursionError:
            raise InvalidRequest("request body is nested too deeply") from None
    return body  # type: ignore[no-any-return]


def plan_request(
    body: dict[str, Any],
    parent_id: str | Callable[[], str],
    max_n: int,
    *,
    endpoint: Endpoint,
    max_children: int = 2048,
) -> Plan | None:
    completions = endpoint == "completions"
    generate = endpoint == "generate"
    # Where n and seed are read: vLLM's generate holds them in its sampling_params; a body
    # without that object asks for no n the proxy could split, so it passes through.
    params = _sampling_params(body) if generate else body
    n = _requested_n(params, max_n)
    best_of = _requested_best_of(body, n, max_n) if completions else None
    stream = body.get("stream") is True
    if best_of is not None and stream:
        raise InvalidRequest("best_of cannot be used with stream", param="best_of")
    per_prompt = best_of or n
    if per_prompt == 1:
        return None
    if callable(parent_id):  # made only for a request that fans out
        parent_id = parent_id()
    seed = params.get("seed")
    # orjson reads integer literals beyond 64 bits as floats: those are out of range too.
    out_of_range = isinstance(seed, float) and abs(seed) >= 2**63
    if out_of_range or (is_int(seed) and not INT64_MIN <= seed <= INT64_MAX - (per_prompt - 1)):
        raise InvalidRequest(
            f"seed must satisfy {INT64_MIN} <= seed and seed + {per_prompt - 1} <= {INT64_MAX}",
            param="seed",
        )
    options = body.get("stream_options")
    options = options if isinstance(options, dict) else {}
    prompts = _split_prompts(body.get("prompt")) if completions else None
    batch = len(prompts) if prompts else 1
    if batch * per_prompt > max_children:
        # Checked before a single child body is built: a huge batch costs one len() here.
        raise InvalidRequest(
            f"this request needs {batch * per_prompt} upstream requests ({batch} prompts"
            f" x {per_prompt}); at most {max_children} are allowed",
            param="prompt" if prompts else ("best_of" if best_of else "n"),
        )
    shape = _Shape(
        body, parent_id, per_prompt, prompts is not None, best_of is not None, completions, generate
    )
    children = tuple(
        _child(shape, p, i, prompt)
        for p, prompt in enumerate(prompts or [None])
        for i in range(per_prompt)
    )
    client_logprobs = body.get("logprobs")
    return Plan(
        parent_id=parent_id,
        endpoint=endpoint,
        n=n,
        stream=stream,
        include_usage=stream and options.get("include_usage") is True,
        continuous_usage=stream and options.get("continuous_usage_stats") is True,
        children=children,
        best_of=best_of,
        keep_logprobs=client_logprobs is not None and client_logprobs is not False,
    )


def _requested_n(body: dict[str, Any], max_n: int) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not is_int(n):
        raise InvalidRequest("n must be an integer", param="n")
    if not 1 <= n <= max_n:
        raise InvalidRequest(f"n must be between 1 and {max_n}, got {n}", param="n")
    return int(n)


def _sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    params = body.get("sampling_params")
    return params if isinstance(params, dict) else {}


def _requested_best_of(body: dict[str, Any], n: int, max_n: int) -> int | None:
    """``best_of > n`` is ranked by the proxy; ``best_of == n`` is plain n
    (docs/behaviour.md#best-of)."""
    best_of = body.get("best_of")
    if best_of is None:
        return None
    if not is_int(best_of):
        raise InvalidRequest("best_of must be an integer", param="best_of")
    if best_of < n:
        raise InvalidRequest(f"best_of must be >= n ({n}), got {best_of}", param="best_of")
    if best_of > max_n:
        raise InvalidRequest(f"best_of must be at most {max_n}, got {best_of}", param="best_of")
    return int(best_of) if best_of > n else None


def _split_prompts(prompt: object) -> list[Any] | None:
    """A list of strings or of token-id lists is a batch; a flat list of ints is ONE prompt."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return prompt
    return None


@dataclass(slots=True)
class _Shape:
    """What every child of one request shares."""

    body: dict[str, Any]
    parent_id: str
    per_prompt: int
    batched: bool  # a completions list of prompts: one child per (prompt, choice)
    ranking: bool  # best_of > n: ask for logprobs to rank by
    completions: bool
    generate: bool  # n and seed in sampling_params; kv_transfer_params is one object, kept


def _seeded(body: dict[str, Any], i: int) -> dict[str, Any]:
    """``body`` without its ``n``, its integer seed moved on by ``i`` (-1 stays -1)."""
    body = dict(body)
    body.pop("n", None)
    seed = body.get("seed")
    if is_int(seed) and seed != RANDOM_SEED:
        body["seed"] = seed + i
    return body


def _child(shape: _Shape, p: int, i: int, prompt: object) -> Child:
    if shape.generate:
        child = dict(shape.body)
        child["sampling_params"] = _seeded(child["sampling_params"], i)
    else:
        child = _seeded(shape.body, i)
    suffix = f"-{p}" if shape.batched else ""
    if shape.batched:
        child["prompt"] = prompt
    request_id = child.get("request_id")
    if isinstance(request_id, str):
        child["request_id"] = f"{i}_{request_id}{suffix}"
    kv = child.get("kv_transfer_params")
    if isinstance(kv, list) and len(kv) == shape.per_prompt and not shape.generate:
        child["kv_transfer_params"] = kv[i]
    if shape.completions:
        # best_of == n is plain n; best_of > n is ranked here, so no child carries it either.
        child.pop("best_of", None)
    if shape.ranking:
        logprobs = child.get("logprobs")
        child["logprobs"] = max(logprobs, 1) if is_int(logprobs) else 1
    return Child(
        index=p * shape.per_prompt + i,
        prompt=p,
        body=_dumps(child),
        request_id=f"{i}_{shape.parent_id}{suffix}",
    )


def _dumps(body: dict[str, Any]) -> bytes:
    try:
        return _json_dumps(body)
    except orjson.JSONEncodeError:
        pass  # integers past 64 bits, or nesting deeper than orjson writes
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    except (ValueError, RecursionError):
        raise InvalidRequest("request body is nested too deeply") from None
