"""Stitching children's answers into the one a native-n server sends (docs/behaviour.md#json,
#streaming, #best-of, #generate). Pure.

``stitch_json`` merges whole bodies; ``StreamStitcher`` opens a chat stream by announcing every
choice in index order, rewrites SSE chunks one at a time, holds back each child's usage chunk and
``[DONE]``, and writes the single merged tail. The children's usage is merged by
``proxy.core.usage``; a child's plain token chunks are stitched from learned bytes by
``proxy.core.template``: the same bytes as the full path, sooner.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import orjson

from proxy.core.errors import error_body
from proxy.core.plan import Child, Plan, is_number
from proxy.core.template import Learner, Template
from proxy.core.usage import merge_usage

# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_json_loads: Final = orjson.loads
_json_dumps: Final = orjson.dumps

DONE = b"data: [DONE]\n\n"


class StreamError(Exception):
    """A child's stream failed after the 200 was sent (docs/behaviour.md#errors)."""

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


def _index(choice: dict[str, Any]) -> int:
    return int(choice["index"])


def _ascending(choices: list[dict[str, Any]]) -> bool:
    """Whether the choices' indices (ints: the plan's) already rise one after another."""
    return all(choices[pos - 1]["index"] < choices[pos]["index"] for pos in range(1, len(choices)))


def stitch_json(plan: Plan, bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(bodies[0])
    if plan.endpoint != "generate":
        merged["id"] = parent_response_id(merged.get("id"), plan.children[0], plan.parent_id)
    elif "request_id" in merged:  # vLLM's generate names its answer by request_id, not id
        merged["request_id"] = parent_response_id(
            merged["request_id"], plan.children[0], plan.parent_id
        )
    choices = [
        {**choice, "index": child.index}
        for child, body in zip(plan.children, bodies, strict=True)
        for choice in _choices(body)
    ]
    if plan.best_of is not None:
        choices = _best(plan, choices)
    # Children are most often planned in index order: a sort by a key function costs 3,700
    # instructions a fan-out of four.
    merged["choices"] = choices if _ascending(choices) else sorted(choices, key=_index)
    usage = merge_usage([b.get("usage") for b in bodies], prompt_heads(plan))
    if usage is not None:
        merged["usage"] = usage
    if merged.get("metrics") is not None:
        merged["metrics"] = None  # one sequence's timings are not the request's (vLLM, n > 1)
    return merged


def finish_reasons(stitched: dict[str, Any]) -> tuple[str | None, ...]:
    """The finish_reason of each choice of a stitched answer, in index order."""
    return tuple(
        None if (reason := c.get("finish_reason")) is None else str(reason)
        for c in _choices(stitched)
    )


def _choices(body: dict[str, Any]) -> list[dict[str, Any]]:
    choices = body.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _best(plan: Plan, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep each prompt's ``n`` choices with the highest mean token logprob
    (docs/behaviour.md#best-of)."""
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
    numbers = [float(v) for v in values if is_number(v)]
    return math.fsum(numbers) / len(numbers) if numbers else -math.inf


class _Stream:
    """What the stitcher keeps of one child's stream."""

    __slots__ = ("child", "finish_reason", "finished", "learner", "template", "usage")

    def __init__(self, child: Child) -> None:
        self.child = child
        self.template: Template | None = None  # once learned, its plain chunks skip the full path
        self.learner = Learner()
        self.usage: dict[str, Any] | None = None  # its last usage, for the merged tail
        self.finished = False  # a finish_reason or [DONE] seen
        self.finish_reason: str | None = None  # the last finish_reason seen (for the record)


class StreamStitcher:
    """Rewrites the children's SSE ``data`` payloads into one native-n stream.

    Every payload can take the full path: parse, rewrite the keys the proxy owns, serialize.
    Most of a token stream is plain chunks that differ from the child's previous one in a
    single value (the token's text); once a child has shown that, its chunks are stitched
    from a learned byte template instead (``Template``), with the same bytes.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._streams = [_Stream(child) for child in plan.children]
        self._shared: dict[str, Any] | None = None  # id, created, model of the first chunk
        self._usage_chunk: dict[str, Any] | None = None
        # Usage on every choice chunk: asked for, or sent unasked (vLLM's
        # --enable-force-include-usage), as an unfinished first choice chunk with usage shows.
        self._continuous = plan.continuous_usage
        self.chunks = 0
        self.rewrites = 0  # events that took the full path (the rest a template stitched)
        self._tail_usage: dict[str, Any] | None = None  # the merged usage, once ``tail`` made it
        self._tailed = False
        # vLLM's generate chunks carry a request_id and no id, created or model, and its native
        # n sends no opening (docs/behaviour.md#generate).
        self._generate = plan.endpoint == "generate"
        self._prompt_told = False  # generate: the prompt's fields went out on the first chunk

    def chunk(self, pos: int, data: bytes, event: str = "message") -> bytes | None:
        """The SSE bytes to send for one child event, or None when it is held back."""
        template = self._streams[pos].template
        if template is not None and event == "message":
            out = template.fill(data)
            if out is not None:
                self.chunks += 1
                return out
        return self._rewrite(pos, data, event)

    def _rewrite(self, pos: int, data: bytes, event: str) -> bytes | None:
        """The full path: the reference the templates are learned from and tested against."""
        self.rewrites += 1
        stream = self._streams[pos]
        if data == b"[DONE]":
            stream.finished = True
            return None
        payload = _payload(stream.child, data, event)
        lesson = stream.learner.study(data, payload)
        usage = payload.get("usage")
        if isinstance(usage, dict):
            stream.usage = usage
        choices = payload.get("choices")
        if not choices or not isinstance(choices, list):
            self._hold_usage_chunk(stream.child, payload)
            return None
        opening = self._open(stream.child, payload) if self._shared is None else b""
        self._share_envelope(payload)
        if self._restate_choices(stream, choices) and _only_announces(payload):
            return opening or None
        if usage is not None and not self._continuous:
            # A per-choice usage (llama.cpp puts one on its last chunk) must not pass for the total.
            payload["usage"] = None
        if lesson is not None and (template := lesson.template(payload)) is not None:
            stream.template = template
        self.chunks += 1
        return opening + b"data: " + _json_dumps(payload) + b"\n\n"

    def _hold_usage_chunk(self, child: Child, payload: dict[str, Any]) -> None:
        """A chunk without choices: the first one with usage shapes the merged tail
        (docs/behaviour.md#chunks-as-they-arrive)."""
        if self._usage_chunk is None and isinstance(payload.get("usage"), dict):
            key = "request_id" if self._generate else "id"
            if key in payload or not self._generate:
                payload[key] = parent_response_id(payload.get(key), child, self.plan.parent_id)
            self._usage_chunk = payload

    def _open(self, child: Child, first: dict[str, Any]) -> bytes:
        """The first chunk with choices sets every chunk's id, created and model, and opens a
        chat stream; a completions stream has no opening (neither vLLM frontend sends one)."""
        self._continuous = self._continuous or (
            isinstance(first.get("usage"), dict) and not _finishes(first["choices"])
        )
        if self._generate:
            request_id = parent_response_id(first.get("request_id"), child, self.plan.parent_id)
            self._shared = {"request_id": request_id}
            return b""
        self._shared = {
            "id": parent_response_id(first.get("id"), child, self.plan.parent_id),
            "created": first.get("created"),
            "model": first.get("model"),
            "object": first.get("object"),
        }
        return self._opening(first) if self.plan.endpoint == "chat" else b""

    def _share_envelope(self, payload: dict[str, Any]) -> None:
        shared = self._shared or {}
        if self._generate:
            if "request_id" in payload:
                payload["request_id"] = shared.get("request_id")
            if self._prompt_told:
                # vLLM's native n sends the prompt's token ids on the stream's first chunk only;
                # each child sends them on its own first.
                for key in _GENERATE_PROMPT_FIELDS:
                    payload.pop(key, None)
            self._prompt_told = True
            return
        payload["id"] = shared.get("id")
        payload["created"] = shared.get("created")
        payload["model"] = shared.get("model")

    @staticmethod
    def _restate_choices(stream: _Stream, choices: list[Any]) -> bool:
        """Each choice gets the child's index; a finish is noted; a role is dropped, since the
        opening announced it (docs/behaviour.md#opening). True when a role was dropped."""
        announced = False
        for choice in choices:
            if isinstance(choice, dict):
                choice["index"] = stream.child.index
                reason = choice.get("finish_reason")
                if reason is not None:
                    stream.finished = True
                    stream.finish_reason = str(reason)
                delta = choice.get("delta")
                if isinstance(delta, dict) and "role" in delta:
                    del delta["role"]
                    announced = True
        return announced

    def _opening(self, first: dict[str, Any]) -> bytes:
        """One role chunk per choice in index order 0..n-1, before any other chunk of a chat
        stream (docs/behaviour.md#opening).

        The openai SDK's stream helper finds a choice by its list position, so choice i must
        first appear after choices 0..i-1; vLLM's native n opens chat streams this way.
        """
        envelope = {k: first[k] for k in _ENVELOPE if k in first}
        envelope.update(self._shared or {})
        choices = first["choices"]
        sample = choices[0] if isinstance(choices[0], dict) else {}
        delta = sample.get("delta")
        role = delta.get("role") if isinstance(delta, dict) else None
        body = {"delta": {"role": role if isinstance(role, str) else "assistant", "content": ""}}
        if isinstance(delta, dict) and "role" in delta:
            # vLLM's role chunk carries the prompt (null unless asked for): the same for every
            # choice, so each opening chunk carries it, as vLLM's own opening does.
            envelope.update({k: first[k] for k in _PROMPT_FIELDS if k in first})
        usage = first.get("usage")
        if self._continuous and isinstance(usage, dict):
            # vLLM's continuous usage on a role chunk: the prompt, nothing generated yet.
            if usage.get("completion_tokens") == 0:
                envelope["usage"] = usage  # a role chunk's own: exactly what vLLM sends
            else:
                prompt = usage.get("prompt_tokens")
                envelope["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt,
                                     "completion_tokens": 0}  # fmt: skip
        out = []
        for index in sorted(c.index for c in self.plan.children):
            choice = {"index": index, **body, "logprobs": None, "finish_reason": None}
            out.append(b"data: " + _json_dumps({**envelope, "choices": [choice]}) + b"\n\n")
        self.chunks += len(out)
        return b"".join(out)

    def finished(self, pos: int) -> bool:
        return self._streams[pos].finished

    def answered(self) -> tuple[str | None, str | None]:
        """The stream's id and model as every chunk carries them; None before the first chunk
        (and a generate stream names no model)."""
        shared = self._shared or {}
        ident = shared.get("request_id" if self._generate else "id")
        model = shared.get("model")
        return (
            ident if isinstance(ident, str) else None,
            model if isinstance(model, str) else None,
        )

    def finish_reasons(self) -> tuple[str | None, ...]:
        """Each child's finish_reason, in child order (None where it never finished). Noted on
        the full path only: a finishing chunk never fits a template, so no chunk pays for it."""
        return tuple(s.finish_reason for s in self._streams)

    def usage(self) -> dict[str, Any] | None:
        """The children's usage merged (docs/behaviour.md#usage), None when none sent any; merged
        once only when the tail was written (nothing changes after it)."""
        if self._tailed:
            return self._tail_usage
        return merge_usage([s.usage for s in self._streams], prompt_heads(self.plan))

    def tail(self) -> bytes:
        """The merged usage chunk (when asked for, or sent unasked) and the one ``[DONE]``."""
        usage = self._tail_usage = self.usage()
        self._tailed = True
        # A child's usage chunk the client did not ask for: the server sends usage on every
        # stream (vLLM's --enable-force-include-usage), so the merged stream does too.
        if usage is None or not (self.plan.include_usage or self._usage_chunk is not None):
            return DONE
        shared = self._shared or {}
        chunk = dict(self._usage_chunk or {})
        if self._generate:
            # vLLM's own: the request_id, the usage, the output mode, no choices.
            if "request_id" in shared:
                chunk["request_id"] = shared["request_id"]
            chunk.update({"choices": [], "usage": usage})
        else:
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
        chunk.pop("metrics", None)  # one child's timings, not the request's: vLLM sends none
        return b"data: " + _json_dumps(chunk) + b"\n\n" + DONE


_ENVELOPE = ("id", "object", "created", "model", "system_fingerprint")
_PROMPT_FIELDS = ("prompt_token_ids", "prompt_text")  # on vLLM's chat role chunk
_GENERATE_PROMPT_FIELDS = ("prompt_token_ids", "mm_placeholders")  # its generate's first chunk
_ANNOUNCING = frozenset({*_ENVELOPE, "choices", "usage"})  # what a role chunk is made of


def _payload(child: Child, data: bytes, event: str) -> dict[str, Any]:
    """A child's event as a JSON object, or the StreamError it is (docs/behaviour.md#errors)."""
    payload = _loads(data)
    if payload is None:
        raise StreamError(child.index, "upstream sent a data line that is not JSON")
    if not isinstance(payload, dict):
        raise StreamError(child.index, "upstream sent a data line that is not a JSON object")
    if event == "error" or "error" in payload:
        raise StreamError(child.index, f"upstream error: {_message(payload)}")
    return payload


def _loads(data: bytes) -> Any:
    """The payload, or None when it is not JSON; undecodable bytes read as U+FFFD (WHATWG)."""
    try:
        return _json_loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return _json_loads(data.decode("utf-8", "replace"))
    except orjson.JSONDecodeError:
        return None


def _finishes(choices: list[Any]) -> bool:
    """A last chunk: llama.cpp puts a child's usage there, which says nothing of the others."""
    return any(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices)


def _only_announces(payload: dict[str, Any]) -> bool:
    """A chunk that, once its role is gone, says nothing: a child's own role announcement.

    Its prompt fields went out on the opening chunks, and a null says nothing either; any other
    vendor field keeps the chunk.
    """
    if any(
        value is not None and key not in _ANNOUNCING and key not in _PROMPT_FIELDS
        for key, value in payload.items()
    ):
        return False
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
    """One error event, then the one ``[DONE]`` (docs/behaviour.md#errors; vLLM's mid-stream
    error shape)."""
    return b"data: " + _json_dumps(error_body(str(error), "server_error")) + b"\n\n" + DONE


def _message(payload: dict[str, Any]) -> str:
    error = payload.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return str(error)[:200]
