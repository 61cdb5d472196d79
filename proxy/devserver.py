"""A deterministic OpenAI-compatible n=1-only backend, shaped like vLLM's server.

It serves the README demo, the test suite and the benchmarks, and can inject faults per request.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import hashlib
import random
import secrets
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from itertools import accumulate
from typing import Any, Literal

import orjson
from aiohttp import web

WORDS = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
    "juliett", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
    "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu",
)  # fmt: skip
WORD_TOKENS = tuple(" " + word for word in WORDS)
DEFAULT_MAX_TOKENS = 16
# Early stops only for long generations, so short test answers always have a known length.
STOP_MIN_MAX_TOKENS = 32
STOP_PROBABILITY = 1 / 8
MAX_TOP_LOGPROBS = 20
FAULT_CAP_SECONDS = 600.0
HUGE_WORD = " " + "x" * (1 << 20)
SYSTEM_FINGERPRINT = "fp_devserver"
STATUS_FAULTS = {"status_400": 400, "status_429": 429, "status_500": 500}
ERROR_TYPES = {400: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}
FAULTS = frozenset(
    {*STATUS_FAULTS, "reset_before_headers", "reset_mid_stream", "error_event", "bad_json"}
    | {"idle_forever", "no_headers", "huge_line", "crlf", "cr", "ping", "gzip", "abort"}
)
# Faults that fire once `after_tokens` tokens have been produced.
MID_STREAM_FAULTS = frozenset({"reset_mid_stream", "error_event", "bad_json", "idle_forever"})
ERROR_EVENT = orjson.dumps(
    {"error": {"message": "Injected error event", "type": "server_error", "code": 500}}
)

Json = dict[str, Any]
Outcome = Literal["finished", "aborted", "faulted"]
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(frozen=True)
class DevConfig:
    token_delay: float = 0.0
    # Benchmark baseline only: answer n>1 natively, as a server with native n would.
    native_n: bool = False
    model: str = "demo-model"


HISTORY = 10_000  # past requests kept per list: enough for any test, flat for a long demo


class DevState:
    """Live bookkeeping of generation requests, for tests to synchronise on.

    Request ids are assumed unique among requests in flight at the same time. Each history
    list keeps the last HISTORY entries, so a long-running demo or benchmark stays flat.
    """

    def __init__(self) -> None:
        self.active: dict[str, Json] = {}
        self.finished: list[str] = []
        self.aborted: list[str] = []
        # Requests the server broke on purpose (x_demo faults), neither finished nor aborted.
        self.faulted: list[str] = []
        self.seen: list[tuple[str, Json, dict[str, str]]] = []
        self._outcomes = {
            "finished": self.finished,
            "aborted": self.aborted,
            "faulted": self.faulted,
        }
        # A fresh event per change: changes happen in sync code (even while a handler is being
        # cancelled), where an asyncio.Condition could not be notified without awaiting its lock.
        self._changed = asyncio.Event()

    def record(self, rid: str, body: Json, headers: dict[str, str]) -> None:
        self.seen.append((rid, body, headers))
        _trim(self.seen)
        self._notify()

    def begin(self, rid: str, body: Json) -> None:
        self.active[rid] = body
        self._notify()

    def end(self, rid: str, outcome: Outcome) -> None:
        """Move `rid` out of `active`; a no-op when it already ended."""
        if rid not in self.active:
            return
        del self.active[rid]
        history = self._outcomes[outcome]
        history.append(rid)
        _trim(history)
        self._notify()

    async def wait_for(self, predicate: Callable[[DevState], bool], timeout: float = 5.0) -> None:
        """Return once `predicate(self)` holds; raise TimeoutError after `timeout` seconds."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                await self._changed.wait()

    def snapshot(self) -> Json:
        return {"active": list(self.active), **self._outcomes}

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def _trim(history: list[Any]) -> None:
    if len(history) > 2 * HISTORY:
        del history[:-HISTORY]  # amortised: one cut per HISTORY appends


DEV_STATE = web.AppKey("dev_state", DevState)
_CONFIG = web.AppKey("dev_config", DevConfig)


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# --- generation: a pure function of (prompt, seed) ---------------------------------------------


@dataclass(frozen=True)
class Token:
    text: str
    logprob: float


@dataclass(frozen=True)
class Generation:
    tokens: tuple[Token, ...]
    finish_reason: str
    key: int  # the PRNG seed; also seeds the top-logprob alternatives

    @cached_property
    def offsets(self) -> list[int]:
        return list(accumulate((len(t.text) for t in self.tokens), initial=0))


def generate(prompt: str, seed: int | None, max_tokens: int, may_stop: bool) -> Generation:
    """Words drawn from a PRNG seeded by sha256(prompt, seed); no seed or -1 is fresh randomness.

    Every position draws the same numbers whatever happens, so a shorter answer is a prefix of a
    longer one.
    """
    if seed is None or seed == -1:
        key = secrets.randbits(64)
    else:
        digest = hashlib.sha256(f"{prompt}\x00{seed}".encode()).digest()
        key = int.from_bytes(digest[:8], "big")
    rng = random.Random(key)
    tokens: list[Token] = []
    finish_reason = "length"
    for position in range(max_tokens):
        text = rng.choice(WORD_TOKENS)
        logprob = -round(0.01 + 2.99 * rng.random(), 4)
        if rng.random() < STOP_PROBABILITY and may_stop and position >= 1:
            finish_reason = "stop"
            break
        tokens.append(Token(text, logprob))
    return Generation(tuple(tokens), finish_reason, key)


def top_tokens(gen: Generation, position: int, k: int) -> list[Token]:
    """The k most likely tokens at `position`: the sampled one, then lower-ranked words."""
    if k <= 0:
        return []
    chosen = gen.tokens[position]
    rng = random.Random(f"{gen.key}:{position}")
    others = rng.sample([w for w in WORD_TOKENS if w != chosen.text], min(k, len(WORDS)) - 1)
    tops = [chosen]
    for text in others:
        tops.append(Token(text, round(tops[-1].logprob - 0.05 - rng.random(), 4)))
    return tops


# --- requests ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    """The `x_demo` vendor field: per-request delay and fault injection."""

    fault: str | None = None
    after_tokens: int = 1
    token_delay: float | None = None


@dataclass(frozen=True)
class Job:
    rid: str
    chat: bool
    model: str
    prompt: str
    seeds: tuple[int | None, ...]  # choice i is generated as the n=1 request with seed + i
    max_tokens: int
    may_stop: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    top_logprobs: int | None  # None: no logprobs asked for
    knobs: Knobs
    token_delay: float

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.split()) + 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if not _is_int(value) or not low <= value <= high:
        raise RequestError(f"{key} must be an integer between {low} and {high}", key)
    return int(value)


def _chat_prompt(messages: object) -> str:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    texts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return "\n".join(str(text) for text in texts)


def _token_ids(value: object) -> str | None:
    """Token ids rendered as text, or None when `value` is not a list of ids."""
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        return " ".join(str(v) for v in value)
    return None


def _completion_prompt(prompt: object) -> str:
    if isinstance(prompt, list) and _token_ids(prompt) is None:
        if len(prompt) > 1:
            # Splitting a list of prompts is the proxy's job (SPEC section 3).
            raise RequestError("only one prompt per request", "prompt")
        prompt = prompt[0] if prompt else None
    if isinstance(prompt, str):
        return prompt
    if (ids := _token_ids(prompt)) is not None:
        return ids
    raise RequestError("prompt must be a string, a list of one string or token ids", "prompt")


def _parse_n(value: object, native_n: bool) -> int:
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RequestError("n must be a positive integer", "n")
    if value > 1 and not native_n:
        raise RequestError("Only n=1 is supported", "n")
    return value


def _parse_knobs(body: Mapping[str, Any]) -> Knobs:
    demo = body.get("x_demo")
    if demo is None:
        return Knobs()
    if not isinstance(demo, dict):
        raise RequestError("x_demo must be an object", "x_demo")
    fault = demo.get("fault")
    if fault is not None and fault not in FAULTS:
        raise RequestError(f"unknown x_demo fault {fault!r}", "x_demo")
    after = _optional_int(demo, "after_tokens", 1, 0, 1 << 30)
    delay = demo.get("token_delay")
    if delay is not None and (not isinstance(delay, int | float) or delay < 0):
        raise RequestError("x_demo.token_delay must be a non-negative number", "x_demo")
    if "only_seed" in demo and demo["only_seed"] != body.get("seed"):
        return Knobs()
    return Knobs(fault, after, None if delay is None else float(delay))


def parse_job(body: object, chat: bool, rid: str, config: DevConfig) -> Job:
    if not isinstance(body, dict):
        raise RequestError("The request body must be a valid JSON object")
    n = _parse_n(body.get("n"), config.native_n)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError("seed must be an integer", "seed")
    prompt = _chat_prompt(body.get("messages")) if chat else _completion_prompt(body.get("prompt"))
    limit_key = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        limit_key = "max_completion_tokens"
    max_tokens = _optional_int(body, limit_key, DEFAULT_MAX_TOKENS, 0, 1 << 20)
    if chat:
        k = _optional_int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        top_logprobs = k if body.get("logprobs") is True else None
    else:
        k = _optional_int(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS)
        top_logprobs = None if body.get("logprobs") is None else k
    stream = body.get("stream") is True
    options = body.get("stream_options") if stream else None
    options = options if isinstance(options, dict) else {}
    knobs = _parse_knobs(body)
    model = body.get("model")
    return Job(
        rid=rid,
        chat=chat,
        model=model if isinstance(model, str) else config.model,
        prompt=prompt,
        # -1 is the "random" sentinel, sent unchanged to every child (SPEC section 3).
        seeds=tuple(seed if seed in (None, -1) else seed + i for i in range(n)),
        max_tokens=max_tokens,
        may_stop=max_tokens >= STOP_MIN_MAX_TOKENS and body.get("ignore_eos") is not True,
        stream=stream,
        include_usage=options.get("include_usage") is True,
        continuous_usage=options.get("continuous_usage_stats") is True,
        top_logprobs=top_logprobs,
        knobs=knobs,
        token_delay=config.token_delay if knobs.token_delay is None else knobs.token_delay,
    )


def shape_generation(gen: Generation, knobs: Knobs) -> Generation:
    """Apply the faults that change what is generated rather than how it is sent."""
    if knobs.fault == "abort":
        return Generation(gen.tokens[: knobs.after_tokens], "abort", gen.key)
    if knobs.fault == "huge_line" and gen.tokens:
        tokens = list(gen.tokens)
        at = min(knobs.after_tokens, len(tokens) - 1)
        tokens[at] = Token(HUGE_WORD, tokens[at].logprob)
        return Generation(tuple(tokens), gen.finish_reason, gen.key)
    return gen


# --- responses: pure builders of vLLM-shaped bodies and chunks ---------------------------------


@dataclass(frozen=True)
class Reply:
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


# --- HTTP ----------------------------------------------------------------------------------------


def _json_response(
    payload: object, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(payload), status=status, content_type="application/json", headers=headers
    )


def _error_response(
    status: int, message: str, rid: str | None = None, param: str | None = None
) -> web.Response:
    error_type = ERROR_TYPES.get(status, "server_error")
    code = None if status == 400 else status
    payload = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return _json_response(payload, status, {"X-Request-Id": rid} if rid else None)


def _header_dict(request: web.BaseRequest) -> dict[str, str]:
    """All request headers, names lower-cased, repeated ones joined as HTTP allows."""
    headers: dict[str, str] = {}
    for name, value in request.headers.items():
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return headers


def _decode_json(raw: bytes) -> object:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _reset(request: web.BaseRequest) -> None:
    """Abort the connection; aiohttp's attempt to write the handler's response then fails."""
    if request.transport is not None:
        request.transport.abort()


async def _sleep_tokens(delay: float, count: int) -> None:
    if delay > 0:
        for _ in range(count):
            await asyncio.sleep(delay)


async def _handle_generation(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[DEV_STATE]
    body = _decode_json(await request.read())
    fields = body if isinstance(body, dict) else {}
    body_rid = fields.get("request_id")
    rid = request.headers.get("X-Request-Id") or (
        body_rid if isinstance(body_rid, str) and body_rid else secrets.token_hex(16)
    )
    state.record(rid, fields, _header_dict(request))
    try:
        job = parse_job(body, chat, rid, request.app[_CONFIG])
    except RequestError as exc:
        return _error_response(400, exc.message, rid, exc.param)
    state.begin(rid, fields)
    try:
        response = await _answer(request, job, state)
    except asyncio.CancelledError:
        state.end(rid, "aborted")
        raise
    state.end(rid, "finished")
    return response


async def _answer(request: web.Request, job: Job, state: DevState) -> web.StreamResponse:
    fault = job.knobs.fault or ""
    if fault in STATUS_FAULTS:
        state.end(job.rid, "faulted")
        return _error_response(STATUS_FAULTS[fault], f"Injected fault {fault}", job.rid)
    if fault == "no_headers":
        await asyncio.sleep(FAULT_CAP_SECONDS)
    if fault in ("reset_before_headers", "no_headers"):
        state.end(job.rid, "faulted")
        _reset(request)
        return web.Response()
    gens = [
        shape_generation(generate(job.prompt, seed, job.max_tokens, job.may_stop), job.knobs)
        for seed in job.seeds
    ]
    if job.stream:
        return await _stream(request, job, gens, state)
    return await _complete(request, job, gens, state)


async def _complete(
    request: web.Request, job: Job, gens: Sequence[Generation], state: DevState
) -> web.Response:
    fault = job.knobs.fault
    steps = max(len(gen.tokens) for gen in gens)
    if fault in ("reset_mid_stream", "idle_forever"):
        await _sleep_tokens(job.token_delay, min(job.knobs.after_tokens, steps))
        if fault == "idle_forever":
            await asyncio.sleep(FAULT_CAP_SECONDS)
        state.end(job.rid, "faulted")
        _reset(request)
        return web.Response()
    # Choices of a native n generate side by side, so one delay per step.
    await _sleep_tokens(job.token_delay, steps)
    headers = {"X-Request-Id": job.rid}
    if fault == "error_event":
        state.end(job.rid, "faulted")
        return _error_response(500, "Injected error event", job.rid)
    if fault == "bad_json":
        return web.Response(body=b"not json", content_type="application/json", headers=headers)
    payload = orjson.dumps(Reply(job).body(gens))
    if fault == "gzip":
        payload = gzip.compress(payload)
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=payload, content_type="application/json", headers=headers)


async def _stream(
    request: web.Request, job: Job, gens: Sequence[Generation], state: DevState
) -> web.StreamResponse:
    reply = Reply(job)
    fault = job.knobs.fault or ""
    eol = {"crlf": b"\r\n", "cr": b"\r"}.get(fault, b"\n")
    ping = b": ping" + eol if fault == "ping" else b""
    steps = max(len(gen.tokens) for gen in gens)
    fault_step = min(job.knobs.after_tokens, steps) if fault in MID_STREAM_FAULTS else -1
    headers = {**SSE_HEADERS, "X-Request-Id": job.rid}
    # gzip on a stream: each event is flushed at once, so compression never delays a token.
    encoder = zlib.compressobj(wbits=31) if fault == "gzip" else None
    if encoder is not None:
        headers["Content-Encoding"] = "gzip"
    response = web.StreamResponse(headers=headers)

    async def send(data: bytes) -> None:
        frame = ping + b"data: " + data + eol + eol
        if encoder is not None:
            frame = encoder.compress(frame) + encoder.flush(zlib.Z_SYNC_FLUSH)
        await response.write(frame)

    async def inject() -> bool:
        """Fire the mid-stream fault; True when the stream goes on afterwards."""
        if fault == "bad_json":
            await send(b"not json")
            return True
        if fault == "idle_forever":
            await asyncio.sleep(FAULT_CAP_SECONDS)
        state.end(job.rid, "faulted")
        if fault == "reset_mid_stream":
            _reset(request)
        elif fault == "error_event":
            await send(ERROR_EVENT)
        return False

    try:
        await response.prepare(request)
        for chunk in reply.opening_chunks(gens):
            await send(orjson.dumps(chunk))
        for step in range(steps):
            if step == fault_step and not await inject():
                return response
            await _sleep_tokens(job.token_delay, 1)
            for chunk in reply.step_chunks(gens, step):
                await send(orjson.dumps(chunk))
        if fault_step == steps and not await inject():
            return response
        if job.include_usage:
            await send(orjson.dumps(reply.usage_chunk(gens)))
        # Ended before [DONE] goes out, so a client that has read [DONE] sees it finished.
        state.end(job.rid, "finished")
        await send(b"[DONE]")
        if encoder is not None:
            await response.write(encoder.flush())
    except ConnectionError:
        state.end(job.rid, "aborted")
    return response


async def _models(request: web.Request) -> web.Response:
    model = request.app[_CONFIG].model
    card = {"id": model, "object": "model", "created": 0, "owned_by": "n-proxy-devserver"}
    return _json_response({"object": "list", "data": [card]})


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[DEV_STATE]
    text = "".join(
        f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name} {value}\n"
        for name, kind, help_text, value in [
            ("devserver_requests_total", "counter", "Generation requests.", len(state.seen)),
            ("devserver_requests_running", "gauge", "Requests generating.", len(state.active)),
        ]
    )
    content_type = "text/plain; version=0.0.4; charset=utf-8"
    return web.Response(body=text.encode(), headers={"Content-Type": content_type})


def _embed(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round((byte - 127.5) / 127.5, 6) for byte in digest[:8]]


async def _embeddings(request: web.Request) -> web.Response:
    body = _decode_json(await request.read())
    fields = body if isinstance(body, dict) else {}
    raw = fields.get("input")
    if raw is None or raw == []:
        return _error_response(400, "input is required", None, "input")
    # A string or a flat list of token ids is one input; any other list holds several.
    items = raw if isinstance(raw, list) and _token_ids(raw) is None else [raw]
    texts = [item if isinstance(item, str) else orjson.dumps(item).decode() for item in items]
    data = [
        {"object": "embedding", "index": i, "embedding": _embed(t)} for i, t in enumerate(texts)
    ]
    tokens = sum(len(text.split()) + 1 for text in texts)
    model = fields.get("model") or request.app[_CONFIG].model
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return _json_response({"object": "list", "data": data, "model": model, "usage": usage})


async def _echo(request: web.Request) -> web.Response:
    status = request.query.get("status", "200")
    if not status.isdigit() or not 200 <= int(status) <= 599:
        return _error_response(400, "status must be an HTTP status code", None, "status")
    echo = {
        "method": request.method,
        "path": request.path,
        "query_string": request.query_string,
        "headers": _header_dict(request),
        "body": (await request.read()).decode("utf-8", "replace"),
    }
    return _json_response(echo, int(status))


async def _debug_state(request: web.Request) -> web.Response:
    return _json_response(request.app[DEV_STATE].snapshot())


def build_app(config: DevConfig = DevConfig()) -> web.Application:
    # Large bodies must reach /echo intact when the proxy's own limit is what is under test.
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[_CONFIG] = config
    app[DEV_STATE] = DevState()
    app.router.add_post("/v1/chat/completions", partial(_handle_generation, chat=True))
    app.router.add_post("/v1/completions", partial(_handle_generation, chat=False))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_get("/debug/state", _debug_state)
    app.router.add_route("*", "/echo/{tail:.*}", _echo)
    return app


async def start_devserver(
    config: DevConfig = DevConfig(), host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int, DevState]:
    """Serve on `host` (a free port when `port` is 0); the caller owns `runner.cleanup()`."""
    app = build_app(config)
    # A short shutdown grace: cleanup must not wait on deliberately endless fault handlers.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, int(runner.addresses[0][1]), app[DEV_STATE]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="n-proxy-devserver", description="A deterministic OpenAI-compatible n=1 backend."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds per token")
    parser.add_argument("--native-n", action="store_true", help="answer n>1 natively")
    parser.add_argument("--model", default="demo-model")
    args = parser.parse_args(argv)
    config = DevConfig(token_delay=args.token_delay, native_n=args.native_n, model=args.model)
    app = build_app(config)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, shutdown_timeout=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
