"""The requests the opt-in vLLM suites send both ways (to vLLM with native ``n``, or to its Rust
frontend child by child, and to n-proxy in front): one chat or completions body of ``N`` choices,
with each case's fields and headers over it. The generate suite shares the sizes and options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "say something"}]
N = 3
MAX_TOKENS = 8
USAGE = {"include_usage": True}
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@dataclass(frozen=True)
class Case:
    """A suite's subclass sets ``seed`` (each suite samples its own) and adds what it compares."""

    path: str
    fields: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    seed: ClassVar[int]

    @property
    def body(self) -> dict[str, Any]:
        base: dict[str, Any] = (
            {"messages": MESSAGES} if self.path == CHAT else {"prompt": "hello world"}
        )
        return {"model": "tiny", **base, "n": N, "seed": self.seed, "max_tokens": MAX_TOKENS,
                **self.fields}  # fmt: skip

    @property
    def stream(self) -> bool:
        return self.fields.get("stream") is True
