"""The request bodies every scenario sends, and what a correct answer to them looks like."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

CHAT_PATH = "/v1/chat/completions"
MODEL = "demo-model"
SEED = 1000
# Every contender gets the same headers. LiteLLM's proxy refuses to start without a master key,
# so it has this one; it guards nothing but a server on 127.0.0.1 for the length of a run.
BENCH_KEY = "sk-bench-loopback-only"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {BENCH_KEY}"}


@dataclass(frozen=True)
class Request:
    path: str
    body: bytes  # a JSON body, POSTed


def chat_body(
    n: int = 1,
    *,
    stream: bool = False,
    max_tokens: int = 16,
    seed: int | None = SEED,
    x_demo: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A chat request; ``ignore_eos`` makes every choice exactly ``max_tokens`` long."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Benchmark the proxy, please."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if n != 1:
        body["n"] = n
    if stream:
        body["stream"] = True
    if seed is not None:
        body["seed"] = seed
    if x_demo is not None:
        body["x_demo"] = x_demo
    return body


def chat_request(n: int = 1, **options: Any) -> Request:
    return Request(CHAT_PATH, orjson.dumps(chat_body(n, **options)))


def stream_events(n: int, max_tokens: int) -> int:
    """SSE data events in a chat stream from the demo backend, ``[DONE]`` included.

    Each choice opens with a role chunk, sends one chunk per token and one with its
    finish_reason; the stitched stream has the same events and one ``[DONE]``.
    """
    return n * (max_tokens + 2) + 1
