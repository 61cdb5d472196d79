"""Comparing answers choice by choice: one request's answer read whole (a stream as its payloads),
and what a client ends up with of one choice's chunks, for the opt-in vLLM suites."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from proxy.core.sse import SSEDecoder


@dataclass
class Answer:
    status: int
    body: Any  # the JSON body, or the stream's payloads ("[DONE]" stays a string)
    headers: CIMultiDict[str] = field(default_factory=CIMultiDict)


async def ask(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], headers: dict[str, str]
) -> Answer:
    async with http.post(url + path, json=body, headers=headers) as response:
        raw = await response.read()
        status = response.status
        head = response.headers.copy()
    if status != 200 or not body.get("stream"):
        return Answer(status, orjson.loads(raw), head)
    decoder = SSEDecoder()
    events = decoder.feed(raw) + decoder.close()
    payloads = [e.data if e.data == "[DONE]" else orjson.loads(e.data) for e in events]
    return Answer(status, payloads, head)


def without(payload: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in payload.items() if k not in keys}


def per_choice(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    by_index: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_index.setdefault(choice["index"], []).append(without(chunk, "id", "created"))
    return by_index


def accumulate(into: dict[str, Any], chunk: dict[str, Any]) -> None:
    """What a client holds after this chunk: text joined, lists extended, the rest replaced."""
    for key, value in chunk.items():
        if value is None:
            into.setdefault(key, None)
        elif isinstance(value, str) and isinstance(into.get(key), str):
            into[key] += value
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] = [*into[key], *value]
        elif isinstance(value, dict):
            nested = into.get(key)
            into[key] = nested = dict(nested) if isinstance(nested, dict) else {}
            accumulate(nested, value)
        else:
            into[key] = value


def received(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """One choice's whole answer, the last chunk's usage (continuous usage) included."""
    choice: dict[str, Any] = {}
    for chunk in chunks:
        accumulate(choice, chunk["choices"][0])
    return {"choice": choice, "usage": chunks[-1].get("usage")}


def cuts(chunks: list[dict[str, Any]]) -> list[tuple[int, ...]]:
    """Where a choice's stream was cut: text, tokens and logprobs in each chunk."""
    cuts: list[tuple[int, ...]] = []
    for chunk in chunks:
        choice = chunk["choices"][0]
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        usage = chunk.get("usage") or {}
        logprobs = choice.get("logprobs") or {}
        entries = logprobs.get("content") or logprobs.get("tokens") or []
        cuts.append((len(text), int(usage.get("completion_tokens", -1)),
                     len(choice.get("token_ids") or []), len(entries)))  # fmt: skip
    return cuts


def shapes(chunks: list[dict[str, Any]]) -> list[tuple[tuple[str, ...], ...]]:
    """The keys of each chunk, its choice, delta and logprobs, repeats collapsed."""
    shapes: list[tuple[tuple[str, ...], ...]] = []
    for chunk in chunks:
        choice = chunk["choices"][0]
        parts = [chunk, choice, choice.get("delta"), choice.get("logprobs")]
        shape = tuple(tuple(sorted(p)) if isinstance(p, dict) else () for p in parts)
        if not shapes or shapes[-1] != shape:
            shapes.append(shape)
    return shapes
