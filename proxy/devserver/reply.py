"""OpenAI response shapes: pure builders of vLLM-shaped bodies, stream chunks and usage."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.devserver.model import Generation, Token, top_tokens
from proxy.devserver.request import Job

Json = dict[str, Any]
SYSTEM_FINGERPRINT = "fp_devserver"


@dataclass(frozen=True)
class Answer:
    job: Job
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, completion_counts: Sequence[int]) -> Json:
        prompt = self.job.prompt_tokens
        completion = sum(completion_counts)
        usage: Json = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": prompt // 2},
        }
        if self.job.chat:
            reasoning = sum(count // 4 for count in completion_counts)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def body(self, gens: Sequence[Generation]) -> Json:
        choices = []
        for index, gen in enumerate(gens):
            text = "".join(token.text for token in gen.tokens)
            message = {"role": "assistant", "content": text}
            content = {"message": message} if self.job.chat else {"text": text}
            logprobs = self._logprobs(gen, range(len(gen.tokens)))
            choice = {"index": index, **content, "logprobs": logprobs}
            choice.update(finish_reason=gen.finish_reason, stop_reason=None)
            choices.append(choice)
        usage = self.usage([len(gen.tokens) for gen in gens])
        obj = "chat.completion" if self.job.chat else "text_completion"
        return {**self._envelope(obj), "choices": choices, "usage": usage}

    def opening_chunks(self, gens: Sequence[Generation]) -> Iterator[Json]:
        for index, gen in enumerate(gens):
            if self.job.chat:
                yield self._chunk(index, {"delta": {"role": "assistant", "content": ""}}, None, 0)
            if not gen.tokens:
                yield self._finish_chunk(index, gen)

    def step_chunks(self, gens: Sequence[Generation], step: int) -> Iterator[Json]:
        """The chunks of token number `step` of every choice still generating, interleaved."""
        for index, gen in enumerate(gens):
            if step >= len(gen.tokens):
                continue
            text = gen.tokens[step].text
            content = {"delta": {"content": text}} if self.job.chat else {"text": text}
            logprobs = self._logprobs(gen, range(step, step + 1))
            yield self._chunk(index, content, logprobs, step + 1)
            if step == len(gen.tokens) - 1:
                yield self._finish_chunk(index, gen)

    def usage_chunk(self, gens: Sequence[Generation]) -> Json:
        usage = self.usage([len(gen.tokens) for gen in gens])
        return {**self._envelope(self._chunk_object), "choices": [], "usage": usage}

    @property
    def _chunk_object(self) -> str:
        # vLLM uses "text_completion" for completion chunks too.
        return "chat.completion.chunk" if self.job.chat else "text_completion"

    def _envelope(self, obj: str) -> Json:
        prefix = "chatcmpl" if self.job.chat else "cmpl"
        envelope: Json = {
            "id": f"{prefix}-{self.job.rid}",
            "object": obj,
            "created": self.created,
            "model": self.job.model,
        }
        if self.job.chat:
            envelope["system_fingerprint"] = SYSTEM_FINGERPRINT
        return envelope

    def _finish_chunk(self, index: int, gen: Generation) -> Json:
        content: Json = {"delta": {}} if self.job.chat else {"text": ""}
        return self._chunk(index, content, None, len(gen.tokens), gen.finish_reason)

    def _chunk(
        self, index: int, content: Json, logprobs: Json | None, done: int, finish: str | None = None
    ) -> Json:
        choice = {"index": index, **content, "logprobs": logprobs, "finish_reason": finish}
        chunk = {**self._envelope(self._chunk_object), "choices": [choice]}
        if self.job.continuous_usage:
            chunk["usage"] = self.usage([done])
        return chunk

    def _logprobs(self, gen: Generation, positions: range) -> Json | None:
        k = self.job.top_logprobs
        if k is None:
            return None
        if self.job.chat:
            return {"content": [_chat_logprob(gen, p, k) for p in positions]}
        return {
            "tokens": [gen.tokens[p].text for p in positions],
            "token_logprobs": [gen.tokens[p].logprob for p in positions],
            # vLLM always lists at least the sampled token.
            "top_logprobs": [
                {t.text: t.logprob for t in top_tokens(gen, p, max(k, 1))} for p in positions
            ],
            "text_offset": [gen.offsets[p] for p in positions],
        }


def _logprob_entry(token: Token) -> Json:
    return {"token": token.text, "logprob": token.logprob, "bytes": list(token.text.encode())}


def _chat_logprob(gen: Generation, position: int, k: int) -> Json:
    top = [_logprob_entry(t) for t in top_tokens(gen, position, k)]
    return {**_logprob_entry(gen.tokens[position]), "top_logprobs": top}
