"""Response shapes: pure builders of vLLM-shaped bodies, stream chunks and usage, for the OpenAI
routes (``Answer``) and for vLLM's token-in/token-out generate (``TokensAnswer``)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.devserver.model import WORD_TOKENS, Generation, Token, top_tokens
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


# The demo model's token ids: a word's place in its vocabulary; any other token (the
# huge_line fault's) is one id past it.
TOKEN_IDS = {text: i for i, text in enumerate(WORD_TOKENS)}
UNKNOWN_TOKEN = len(WORD_TOKENS)


@dataclass(frozen=True)
class TokensAnswer:
    """vLLM's ``/inference/v1/generate`` answers, as its Python frontend sends them: token ids,
    ``request_id`` ``generate-tokens-{X-Request-Id}``, one token a stream chunk, the finish
    on the last token's chunk."""

    job: Job
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def request_id(self) -> str:
        return f"generate-tokens-{self.job.rid}"

    def usage(self, completion_counts: Sequence[int]) -> Json:
        return Answer(self.job).usage(completion_counts)

    def body(self, gens: Sequence[Generation]) -> Json:
        choices = []
        for index, gen in enumerate(gens):
            choice = self._choice(index, gen, range(len(gen.tokens)), gen.finish_reason)
            choices.append(choice)
        return {
            "request_id": self.request_id,
            "model": self.job.model,
            "created": self.created,
            "usage": self.usage([len(gen.tokens) for gen in gens]),
            "prompt_logprobs": None,
            "kv_transfer_params": None,
            "metrics": None,
            "output_mode": "tokens",
            "choices": choices,
        }

    def opening_chunks(self, gens: Sequence[Generation]) -> Iterator[Json]:
        """No opening: only a choice with no token to send its finish on has a chunk here."""
        for index, gen in enumerate(gens):
            if not gen.tokens:
                yield self._chunk(index, gen, range(0), gen.finish_reason, 0)

    def step_chunks(self, gens: Sequence[Generation], step: int) -> Iterator[Json]:
        for index, gen in enumerate(gens):
            if step < len(gen.tokens):
                last = step == len(gen.tokens) - 1
                finish = gen.finish_reason if last else None
                yield self._chunk(index, gen, range(step, step + 1), finish, step + 1)

    def usage_chunk(self, gens: Sequence[Generation]) -> Json:
        usage = self.usage([len(gen.tokens) for gen in gens])
        return {"request_id": self.request_id, "usage": usage, "output_mode": "tokens",
                "choices": []}  # fmt: skip

    def _chunk(
        self, index: int, gen: Generation, positions: range, finish: str | None, done: int
    ) -> Json:
        usage = self.usage([done]) if self.job.continuous_usage else None
        choice = self._choice(index, gen, positions, finish)
        return {"request_id": self.request_id, "usage": usage, "output_mode": "tokens",
                "choices": [choice]}  # fmt: skip

    def _choice(self, index: int, gen: Generation, positions: range, finish: str | None) -> Json:
        texts = [gen.tokens[p].text for p in positions]
        unknown = [text for text in texts if text not in TOKEN_IDS]
        return {
            "index": index,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": [TOKEN_IDS.get(text, UNKNOWN_TOKEN) for text in texts],
            # vLLM's field for big per-token data (expert routing, base64): the huge_line
            # fault's word rides here, so that fault makes a generate line huge too.
            "routed_experts": "".join(unknown) if unknown else None,
            "logprobs": self._logprobs(gen, positions),
        }

    def _logprobs(self, gen: Generation, positions: range) -> Json | None:
        k = self.job.top_logprobs
        if k is None:
            return None
        return {"content": [_token_logprob(gen, p, k) for p in positions]}


def _token_logprob(gen: Generation, position: int, k: int) -> Json:
    def entry(token: Token, rank: int) -> Json:
        return {"token_id": TOKEN_IDS.get(token.text, UNKNOWN_TOKEN), "logprob": token.logprob,
                "rank": rank}  # fmt: skip

    top = [entry(t, rank) for rank, t in enumerate(top_tokens(gen, position, k), 1)]
    return {**entry(gen.tokens[position], 1), "top_logprobs": top}
