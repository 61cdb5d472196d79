"""What the tests send llama.cpp's server (bench/backends/llamacpp.py runs it): its paths, a
message and a prompt, and a body for either path."""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletionMessageParam

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "say something"}]
PROMPT = "hello world"


def request_body(path: str, **fields: Any) -> dict[str, Any]:
    """A body for ``path``: ``MESSAGES`` for chat, ``PROMPT`` for completions, then ``fields``."""
    base: dict[str, Any] = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
    return {**base, **fields}
