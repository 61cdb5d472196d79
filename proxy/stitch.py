"""Stitching children's answers into the one a native-n server sends (SPEC §4, §5, §8). Pure.

``stitch_json`` merges whole bodies; ``StreamStitcher`` opens the stream by announcing every
choice in index order, rewrites SSE chunks one at a time, holds back each child's usage chunk and
``[DONE]``, and writes the single merged tail.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson

from proxy.plan import Child, Plan
from proxy.usage import merge_usage

DONE = b"data: [DONE]\n\n"


class StreamError(Exception):
    """A child's stream failed after the 200 was sent (SPEC §7)."""

    def __init__(self, choice: int | None, reason: str) -> None:
        super().__init__(reason if choice is None else f"choice {choice} failed: {reason}")
        self.choice = choice  # None: the whole stream was cut (a drain ran out of time)
        self.reason = reason


def parent_response_id(child_id: object, child: Child, parent_id: str) -> object:
    """``chatcmpl-0_abc`` -> ``chatcmpl-abc``: the child marker removed, as with native n."""
    if isinstance(child_id, str) and child.request_id in child_id:
        return child_id.replace(child.request_id, parent_id, 1)
    return child_id


def prompt_heads(plan: Plan) -> list[int]:
    per_prompt = plan.best_of or plan.n
    return [pos for pos, child in enumerate(plan.children) if child.index % per_prompt == 0]


def stitch_json(plan: Plan, bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(bodies[0])
    merged["id"] = parent_response_id(merged.get("id"), plan.children[0], plan.parent_id)
    choices = [
        {**choice, "index": child.index}
        for child, body in zip(plan.children, bodies, strict=True)
        for choice in _choices(body)
    ]
    if plan.best_of is not None:
        choices = _best(plan, choices)
    merged["choices"] = sorted(choices, key=lambda c: int(c["index"]))
    usage = merge_usage([b.get("usage") for b in bodies], prompt_heads(plan))
    if usage is not None:
        merged["usage"] = usage
    return merged


def _choices(body: dict[str, Any]) -> list[dict[str, Any]]:
    choices = body.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _best(plan: Plan, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep each prompt's ``n`` choices with the highest mean token logprob (SPEC §8)."""
    best_of = plan.best_of or plan.n
    kept = []
    for p in range(plan.prompts):
        group = [c for c in choices if int(c["index"]) // best_of == p]
        group.sort(key=lambda c: (-mean_logprob(c), int(c["index"])))
        for j, choice in enumerate(group[: plan.n]):
            choice = {**choice, "index": p * plan.n + j}
            if not plan.keep_logprobs:
                choice["logprobs"] = None
            kept.append(choice)
    return kept


def mean_logprob(choice: dict[str, Any]) -> float:
    """Mean over the sampled tokens' logprobs, completions or chat shape; -inf when absent."""
    logprobs = choice.get("logprobs")
    values: list[object] = []
    if isinstance(logprobs, dict):
        if isinstance(logprobs.get("token_logprobs"), list):
            values = logprobs["token_logprobs"]
        elif isinstance(logprobs.get("content"), list):
            values = [t.get("logprob") for t in logprobs["content"] if isinstance(t, dict)]
    numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return math.fsum(numbers) / len(numbers) if numbers else -math.inf


class StreamStitcher:
    """Rewrites the children's SSE ``data`` payloads into one native-n stream.

    Every payload can take the full path: parse, rewrite the keys the proxy owns, serialize.
    Most of a token stream is plain chunks that differ from the child's previous one in a
    single value (the token's text); once a child has shown that, its chunks are stitched
    from a learned byte template instead (``_Template``), with the same result.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._shared: dict[str, Any] | None = None  # id, created, model of the first chunk
        self._usage: list[dict[str, Any] | None] = [None] * len(plan.children)
        self._usage_chunk: dict[str, Any] | None = None
        self._finished = [False] * len(plan.children)
        self.chunks = 0
        count = len(plan.children)
        self._templates: list[_Template | None] = [None] * count
        self._previous: list[bytes | None] = [None] * count  # the last plain chunk, to learn from
        self._lessons = [LESSONS] * count

    def chunk(self, pos: int, data: bytes, event: str = "message") -> bytes | None:
        """The SSE bytes to send for one child event, or None when it is held back."""
        template = self._templates[pos]
        if template is not None and event == "message":
            out = template.fill(data)
            if out is not None:
                self.chunks += 1
                return out
        return self._rewrite(pos, data, event)

    def _rewrite(self, pos: int, data: bytes, event: str) -> bytes | None:
        """The full path: the reference the templates are learned from and tested against."""
        child = self.plan.children[pos]
        if data == b"[DONE]":
            self._finished[pos] = True
            return None
        payload = _loads(data)
        if payload is None:
            raise StreamError(child.index, "upstream sent a data line that is not JSON")
        if not isinstance(payload, dict):
            raise StreamError(child.index, "upstream sent a data line that is not a JSON object")
        if event == "error" or "error" in payload:
            raise StreamError(child.index, f"upstream error: {_message(payload)}")
        lesson = (
            self._lesson(pos, data, payload) if self._lessons[pos] and _plain(payload) else None
        )
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self._usage[pos] = usage
        choices = payload.get("choices")
        if not choices or not isinstance(choices, list):
            if self._usage_chunk is None and isinstance(usage, dict):
                payload["id"] = parent_response_id(payload.get("id"), child, self.plan.parent_id)
                self._usage_chunk = payload
            return None
        opening = b""
        shared = self._shared
        if shared is None:
            shared = self._shared = {
                "id": parent_response_id(payload.get("id"), child, self.plan.parent_id),
                "created": payload.get("created"),
                "model": payload.get("model"),
                "object": payload.get("object"),
            }
            opening = self._opening(payload)
        payload["id"] = shared["id"]
        payload["created"] = shared["created"]
        payload["model"] = shared["model"]
        announced = False
        for choice in choices:
            if isinstance(choice, dict):
                choice["index"] = child.index
                if choice.get("finish_reason") is not None:
                    self._finished[pos] = True
                delta = choice.get("delta")
                if isinstance(delta, dict) and "role" in delta:
                    del delta["role"]  # the opening announced it (SPEC §5)
                    announced = True
        if announced and _only_announces(payload):
            return opening or None
        if usage is not None and not self.plan.continuous_usage:
            # A per-choice usage (llama.cpp puts one on its last chunk) must not pass for the total.
            payload["usage"] = None
        if lesson is not None:
            slot, child_head, child_tail = lesson
            parent = _split_at(payload, slot)
            if parent is not None:
                head, tail = parent
                self._templates[pos] = _Template(
                    child_head, child_tail, b"data: " + head, tail + b"\n\n"
                )
        self.chunks += 1
        return opening + b"data: " + orjson.dumps(payload) + b"\n\n"

    def _lesson(
        self, pos: int, data: bytes, payload: dict[str, Any]
    ) -> tuple[tuple[str | int, ...], bytes, bytes] | None:
        """For a plain chunk (not yet rewritten): the one value it changed since the child's
        previous plain chunk, and the bytes around that value, when ``data`` is exactly them."""
        previous = self._previous[pos]
        self._previous[pos] = data
        if previous is None:
            return None
        self._lessons[pos] -= 1
        if self._lessons[pos] == 0:
            self._previous[pos] = None
        found: list[tuple[str | int, ...]] = []
        if not _differences(_loads(previous), payload, (), found) or len(found) != 1:
            return None
        slot = found[0]
        if slot[:1] in _NOT_SLOTS or (slot[:1] == ("choices",) and slot[2:3] == ("index",)):
            return None  # a value the stitcher rewrites, or that decides how it rewrites
        leaf = _leaf(payload, slot)
        if not isinstance(leaf, str | int | float) or isinstance(leaf, bool):
            return None
        child = _split_at(payload, slot)
        if child is None:
            return None
        if _value_between(data, *child) is None:
            self._lessons[pos] = 0  # not serialized as orjson would: no template will match
            self._previous[pos] = None
            return None
        return slot, child[0], child[1]

    def _opening(self, first: dict[str, Any]) -> bytes:
        """One empty chunk per choice in index order 0..n-1, before any other (SPEC §5).

        The openai SDK's stream helper finds a choice by its list position, so choice i must
        first appear after choices 0..i-1; vLLM's native n opens chat streams this way. For
        completions the empty ``text`` does the same at no cost to any client.
        """
        choices = first["choices"]
        sample = choices[0] if isinstance(choices[0], dict) else {}
        delta = sample.get("delta")
        if isinstance(delta, dict):
            role = delta.get("role")
            body: dict[str, Any] = {
                "delta": {"role": role if isinstance(role, str) else "assistant", "content": ""}
            }
        elif "text" in sample:
            body = {"text": ""}
        else:
            return b""  # an unknown chunk shape: nothing to announce with
        envelope = {k: first[k] for k in _ENVELOPE if k in first}
        envelope.update(self._shared or {})
        usage = first.get("usage")
        if self.plan.continuous_usage and isinstance(usage, dict):
            # vLLM's continuous usage on a role chunk: the prompt, nothing generated yet.
            prompt = usage.get("prompt_tokens")
            envelope["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt,
                                 "completion_tokens": 0}  # fmt: skip
        out = []
        for index in sorted(c.index for c in self.plan.children):
            choice = {"index": index, **body, "logprobs": None, "finish_reason": None}
            out.append(b"data: " + orjson.dumps({**envelope, "choices": [choice]}) + b"\n\n")
        self.chunks += len(out)
        return b"".join(out)

    def finished(self, pos: int) -> bool:
        return self._finished[pos]

    def usage(self) -> dict[str, Any] | None:
        """The children's usage merged (SPEC §6), None when none sent any."""
        return merge_usage(self._usage, prompt_heads(self.plan))

    def tail(self) -> bytes:
        """The merged usage chunk (when asked for) and the one ``[DONE]``."""
        usage = self.usage()
        if not self.plan.include_usage or usage is None:
            return DONE
        shared = self._shared or {}
        chunk = dict(self._usage_chunk or {})
        chunk.update(
            {
                "id": shared.get("id", chunk.get("id")),
                "object": chunk.get("object", shared.get("object")),
                "created": shared.get("created", chunk.get("created")),
                "model": shared.get("model", chunk.get("model")),
                "choices": [],
                "usage": usage,
            }
        )
        return b"data: " + orjson.dumps(chunk) + b"\n\n" + DONE


_ENVELOPE = ("id", "object", "created", "model", "system_fingerprint")
LESSONS = 8  # template lessons per child: learning parses twice, so it stops after a few
_NOT_SLOTS = frozenset({("id",), ("object",), ("created",), ("model",), ("usage",), ("error",)})
_SLOT = "\x00n-proxy template slot\x00"
_SLOT_JSON = orjson.dumps(_SLOT)
_MAX_DEPTH = 32


class _Template(NamedTuple):
    """A child's plain chunk as ``child_head + <one JSON value> + child_tail``, and the same
    chunk stitched as ``head + <that value> + tail``.

    Learned from a chunk that took the full path, where that value was the only one to
    change since the child's previous plain chunk. Parsing a chunk of this form gives the
    learned payload with only that value replaced, and the full path's rewrite neither
    touches that value nor looks at it, so the stitched chunk equals the full path's
    (JSON-equal: the value keeps the child's own spelling). Anything else takes the full
    path: ``[DONE]``, the finishing chunk, usage, a role, a second changed value.
    """

    child_head: bytes
    child_tail: bytes
    head: bytes
    tail: bytes

    def fill(self, data: bytes) -> bytes | None:
        value = _value_between(data, self.child_head, self.child_tail)
        return None if value is None else self.head + value + self.tail


def _value_between(data: bytes, head: bytes, tail: bytes) -> bytes | None:
    """The bytes of ``data`` between ``head`` and ``tail`` when they are one JSON string or
    number; None for anything else (more than one value, not UTF-8: the full path decides)."""
    end = len(data) - len(tail)
    if end < len(head) or not data.startswith(head) or not data.endswith(tail):
        return None
    value = data[len(head) : end]
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(parsed, (str, int, float)) or isinstance(parsed, bool):
        return None
    return value


def _loads(data: bytes) -> Any:
    """The payload, or None when it is not JSON; undecodable bytes read as U+FFFD (WHATWG)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return orjson.loads(data.decode("utf-8", "replace"))
    except orjson.JSONDecodeError:
        return None


def _plain(payload: dict[str, Any]) -> bool:
    """One choice, no role, not finishing, no usage or error: only its values can vary."""
    if "error" in payload or payload.get("usage") is not None:
        return False
    choices = payload.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta")
    return choice.get("finish_reason") is None and not (isinstance(delta, dict) and "role" in delta)


def _differences(a: Any, b: Any, path: tuple[str | int, ...], found: list[Any]) -> bool:
    """Collect the paths of the scalar values that differ (stopping at two); False when the
    two differ in shape (keys, their order, lengths, a container against a scalar)."""
    if len(path) > _MAX_DEPTH:
        return False
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return False
        return all(_differences(a[k], b[k], (*path, k), found) for k in a)
    if isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            return False
        return all(
            _differences(x, y, (*path, i), found) for i, (x, y) in enumerate(zip(a, b, strict=True))
        )
    if isinstance(b, dict | list):
        return False
    if type(a) is not type(b) or a != b:
        found.append(path)
    return len(found) < 2


def _leaf(payload: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        payload = payload[key]
    return payload


def _split_at(payload: dict[str, Any], path: tuple[str | int, ...]) -> tuple[bytes, bytes] | None:
    """The payload serialized around the value at ``path``: the bytes before and after it."""
    parent = _leaf(payload, path[:-1])
    value = parent[path[-1]]
    parent[path[-1]] = _SLOT
    try:
        raw = orjson.dumps(payload)
    finally:
        parent[path[-1]] = value
    head, found, tail = raw.partition(_SLOT_JSON)
    if not found or _SLOT_JSON in tail:
        return None
    return head, tail


def _only_announces(payload: dict[str, Any]) -> bool:
    """A chunk that, once its role is gone, says nothing: a child's own role announcement."""
    if any(key not in _ENVELOPE and key not in ("choices", "usage") for key in payload):
        return False  # vendor fields ride on it: keep the chunk
    for choice in payload["choices"]:
        if not isinstance(choice, dict):
            return False
        for key, value in choice.items():
            if key == "delta":
                if not isinstance(value, dict) or any(v not in (None, "") for v in value.values()):
                    return False
            elif key != "index" and value is not None:
                return False
    return True


def error_event(error: StreamError) -> bytes:
    """One error event, then the one ``[DONE]`` (SPEC §7; vLLM's mid-stream error shape)."""
    body = {
        "error": {
            "message": str(error),
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    return b"data: " + orjson.dumps(body) + b"\n\n" + DONE


def _message(payload: dict[str, Any]) -> str:
    error = payload.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return str(error)[:200]
