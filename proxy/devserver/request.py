"""Request parsing: an OpenAI chat or completions body, or vLLM's token-in/token-out generate
body, with its `x_demo` knobs, into a Job."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from proxy.core import is_int
from proxy.devserver.config import DevConfig
from proxy.devserver.faults import FAULTS, Knobs
from proxy.devserver.model import STOP_MIN_MAX_TOKENS

DEFAULT_MAX_TOKENS = 16
MAX_TOP_LOGPROBS = 20
Kind = Literal["chat", "completions", "generate"]


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Job:
    rid: str
    kind: Kind
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
    def chat(self) -> bool:
        return self.kind == "chat"

    @property
    def prompt_tokens(self) -> int:
        words = len(self.prompt.split())
        return words if self.kind == "generate" else words + 1  # generate: the token ids


def _optional_int(body: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if not is_int(value) or not low <= value <= high:
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


def token_ids(value: object) -> str | None:
    """Token ids rendered as text, or None when `value` is not a list of ids."""
    if isinstance(value, list) and value and all(is_int(v) for v in value):
        return " ".join(str(v) for v in value)
    return None


def _completion_prompt(prompt: object) -> str:
    if isinstance(prompt, list) and token_ids(prompt) is None:
        if len(prompt) > 1:
            # Splitting a list of prompts is the proxy's job (docs/behaviour.md#children).
            raise RequestError("only one prompt per request", "prompt")
        prompt = prompt[0] if prompt else None
    if isinstance(prompt, str):
        return prompt
    if (ids := token_ids(prompt)) is not None:
        return ids
    raise RequestError("prompt must be a string, a list of one string or token ids", "prompt")


def _parse_n(value: object, native_n: bool, refusal: str = "Only n=1 is supported") -> int:
    if value is None:
        return 1
    if not is_int(value) or value < 1:
        raise RequestError("n must be a positive integer", "n")
    if value > 1 and not native_n:
        raise RequestError(refusal, "n")
    return value


def _parse_seed(value: object) -> int | None:
    if value is not None and not is_int(value):
        raise RequestError("seed must be an integer", "seed")
    return value


def _seeds(seed: int | None, n: int) -> tuple[int | None, ...]:
    # -1 is the "random" sentinel, sent unchanged to every child (docs/behaviour.md#children).
    return tuple(seed if seed in (None, -1) else seed + i for i in range(n))


def _parse_knobs(body: Mapping[str, Any], seed: int | None) -> Knobs:
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
    headers_delay = demo.get("headers_delay", 0.0)
    if not isinstance(headers_delay, int | float) or not 0 <= headers_delay <= 600:
        raise RequestError("x_demo.headers_delay must be a number of seconds in 0..600", "x_demo")
    if "only_seed" in demo and demo["only_seed"] != seed:
        return Knobs()
    return Knobs(fault, after, None if delay is None else float(delay), float(headers_delay))


def parse_job(body: object, chat: bool, rid: str, config: DevConfig) -> Job:
    if not isinstance(body, dict):
        raise RequestError("The request body must be a valid JSON object")
    n = _parse_n(body.get("n"), config.native_n)
    seed = _parse_seed(body.get("seed"))
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
    return _job(body, config, rid, "chat" if chat else "completions", prompt, seed, n,
                max_tokens, body.get("ignore_eos") is True, top_logprobs)  # fmt: skip


def parse_generate_job(body: object, rid: str, config: DevConfig) -> Job:
    """vLLM's ``/inference/v1/generate`` body: token ids in, n, seed, max_tokens and logprobs in
    ``sampling_params``. ``n > 1`` is refused as vLLM's Rust frontend refuses it."""
    if not isinstance(body, dict):
        raise RequestError("The request body must be a valid JSON object")
    prompt = token_ids(body.get("token_ids"))
    if prompt is None or any(t < 0 for t in body["token_ids"]):
        raise RequestError("token_ids must be a non-empty list of token ids", "token_ids")
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise RequestError("sampling_params must be an object", "sampling_params")
    n = _parse_n(params.get("n"), config.native_n, "Only n=1 is supported.")
    seed = _parse_seed(params.get("seed"))
    max_tokens = _optional_int(params, "max_tokens", DEFAULT_MAX_TOKENS, 0, 1 << 20)
    logprobs = params.get("logprobs")
    k = _optional_int(params, "logprobs", 0, 0, MAX_TOP_LOGPROBS)
    top_logprobs = None if logprobs is None else k
    return _job(body, config, rid, "generate", prompt, seed, n, max_tokens,
                params.get("ignore_eos") is True, top_logprobs)  # fmt: skip


def _job(
    body: dict[str, Any],
    config: DevConfig,
    rid: str,
    kind: Kind,
    prompt: str,
    seed: int | None,
    n: int,
    max_tokens: int,
    ignore_eos: bool,
    top_logprobs: int | None,
) -> Job:
    """The job of any kind, once its own fields are read: streaming, usage options, the demo
    knobs and the model name are read alike from every body."""
    stream = body.get("stream") is True
    options = body.get("stream_options") if stream else None
    options = options if isinstance(options, dict) else {}
    knobs = _parse_knobs(body, seed)
    model = body.get("model")
    return Job(
        rid=rid,
        kind=kind,
        model=model if isinstance(model, str) and not config.model_override else config.model,
        prompt=prompt,
        seeds=_seeds(seed, n),
        max_tokens=max_tokens,
        may_stop=max_tokens >= STOP_MIN_MAX_TOKENS and not ignore_eos,
        stream=stream,
        include_usage=options.get("include_usage") is True,
        continuous_usage=options.get("continuous_usage_stats") is True,
        top_logprobs=top_logprobs,
        knobs=knobs,
        token_delay=config.token_delay if knobs.token_delay is None else knobs.token_delay,
    )
