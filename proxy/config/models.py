"""The proxy's configuration: frozen pydantic models, validated once at load, with a JSON Schema.

Every error is one line naming the YAML key (``upstreams[1].url: not a URL``), however pydantic
words it inside; ``${ENV}`` placeholders in URLs and header values are expanded at load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from proxy.config.errors import first_error, keyed
from proxy.config.fields import (
    HeaderValue,
    RetryCondition,
    Seconds,
    Url,
    UrlPath,
    ranged,
)
from proxy.core import check_url, endpoint_of

MAX_N_CEILING = 128  # the OpenAI API's own bound on n
DEFAULT_FANOUT_PATHS = ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate")
MiB = 1024 * 1024


class ConfigError(ValueError):
    pass


# Schema descriptions of the limits --workers N divides (proxy.server.workers.worker_config).
_SHARED = " The proxy's total: with --workers N each worker enforces its share (they add up to it)."
_DIVIDED = _SHARED + " Every worker needs at least 1, so N may not exceed it."
_CONCURRENCY = "Upstream requests in flight; children are admitted one at a time." + _DIVIDED
_QUEUE = "Children waiting for a slot; a request arriving past it gets 429." + _SHARED
_CONNECTIONS = "Open client connections; past it new ones are closed at accept." + _DIVIDED


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Listen(_Section):
    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Annotated[int, ranged(0, 65535)] = 8080


class Timeouts(_Section):
    """Upstream clocks: to connect, to the response headers, and of silence mid-body."""

    connect: Seconds = 5.0
    first_byte: Seconds = 600.0  # prefill can be slow
    idle: Seconds = 120.0  # no total cap: streams may run for long


class ClientTimeouts(_Section):
    """How long a client may take to send its request's headers, and its body (nginx: 60 s)."""

    headers: Seconds = 60.0
    body: Seconds = 60.0


class Eject(_Section):
    """Passive health: ``failures`` in a row take a replica out for ``seconds`` (0: never)."""

    failures: Annotated[int, ranged(0, 1000)] = 3
    seconds: Seconds = 10.0


class Discovery(_Section):
    """With ``dns``, each URL host's every address is a replica, resolved anew each interval."""

    dns: Annotated[bool, Field(strict=True)] = False
    interval: Seconds = 10.0


class Backoff(_Section):
    """The wait before retry ``r``: a random time between half and all of
    ``min(cap, base * 2 ** (r - 1))`` seconds, or the retried answer's ``Retry-After`` when
    longer; an answer asking for more than ``retry_after_cap`` is not retried."""

    base: Seconds = 0.05
    cap: Seconds = 2.0
    retry_after_cap: Annotated[float, Field(strict=True, ge=0)] = 10.0

    @model_validator(mode="after")
    def _cap_not_below_base(self) -> Backoff:
        if self.cap < self.base:
            raise ValueError(f"cap ({self.cap}) must be at least base ({self.base})")
        return self


class RetryBudget(_Section):
    """Retries (of tries a server saw: not ``connect``) allowed per ``window`` seconds: ``percent``
    of the requests in it, and at least ``min_per_second`` a second (as Envoy's retry budget)."""

    percent: Annotated[float, Field(strict=True, ge=0, le=1000)] = 20.0
    min_per_second: Annotated[float, Field(strict=True, ge=0)] = 3.0
    window: Seconds = 10.0


def _pack(value: object) -> int | Literal["all"]:
    if value == "all":
        return "all"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError("must be an integer of at least 1, or all")


class Placement(_Section):
    """Where a request's children go: ``pack`` of them per replica (``all``: one replica per
    request), each group to the next replica in turn (``round_robin``) or to the less busy of
    two (``least_outstanding``). Or a preset's name: ``spread`` (round_robin, 1), ``pack``
    (round_robin, all), ``least_outstanding`` (least_outstanding, 1)."""

    choose: Literal["round_robin", "least_outstanding"] = "least_outstanding"
    pack: Annotated[
        int | Literal["all"],
        PlainValidator(_pack),
        WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1}, {"const": "all"}]}),
    ] = 1


_PLACEMENTS: dict[str, dict[str, Any]] = {
    "spread": {"choose": "round_robin"},  # spread and pack keep the meaning they always had
    "pack": {"choose": "round_robin", "pack": "all"},
    "least_outstanding": {},
}


def _placement(value: object) -> object:
    if isinstance(value, str):
        if value not in _PLACEMENTS:
            raise ValueError(f"must be one of {', '.join(_PLACEMENTS)}, or {{choose, pack}}")
        return _PLACEMENTS[value]
    return value


def _upstream_schema(schema: dict[str, Any]) -> None:
    """The schema says what the loader takes: ``url: X`` or ``urls: [X, ...]``, exactly one;
    ``placement`` as a preset's name or a mapping."""
    properties = schema["properties"]
    properties["url"] = {"type": "string", "format": "uri", "title": "Url"}
    schema["required"] = [r for r in schema["required"] if r != "urls"]
    schema["oneOf"] = [{"required": ["url"]}, {"required": ["urls"]}]
    mapping = {k: v for k, v in properties["placement"].items() if k != "default"}
    properties["placement"] = {"anyOf": [{"enum": list(_PLACEMENTS)}, mapping], "default": "spread"}


class Clients(_Section):
    """How clients are told apart (docs/operating.md#clients), for fair admission and their cap:
    by ``Authorization`` (its HMAC; the peer address when a request has none), by the peer
    address, or by ``header``, which the load balancer in front sets (trusted as it comes)."""

    identify: Literal["authorization", "peer", "header"] = "authorization"
    header: Annotated[str, Field(pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")] | None = None
    # Children one client may have queued or running at once over every upstream; 0: no cap.
    max_children: Annotated[int, ranged(0, 1_000_000)] = 0

    @model_validator(mode="after")
    def _header_names_the_header(self) -> Clients:
        if self.identify == "header" and self.header is None:
            raise keyed("clients.header", "required with identify: header")
        if self.identify != "header" and self.header is not None:
            raise keyed("clients.header", "only with identify: header")
        return self


class Upstream(_Section):
    model_config = ConfigDict(json_schema_extra=_upstream_schema)

    name: Annotated[str, Field(min_length=1)]
    urls: Annotated[tuple[Url, ...], Field(min_length=1)]
    native_n: Annotated[bool, Field(strict=True)] = False
    max_concurrency: Annotated[int, ranged(1, 1_000_000, _CONCURRENCY)] = 4096
    max_queue: Annotated[int, ranged(0, 1_000_000, _QUEUE)] = 4096
    # fair: a freed slot goes to each client in turn; fifo: to the oldest waiting child.
    admission: Literal["fair", "fifo"] = "fair"
    # fair only: a slot a client gives back holding fewer than every waiting client is kept this
    # long for its next request (docs/behaviour.md#admission); 0: never kept.
    return_grace: Annotated[float, Field(ge=0, le=10)] = 0.05
    placement: Annotated[Placement, BeforeValidator(_placement)] = Placement(choose="round_robin")
    headers: dict[str, HeaderValue] = Field(default_factory=dict)
    timeouts: Timeouts = Timeouts()
    health_path: UrlPath = "/health"
    health_interval: Seconds = 5.0
    # gen_ai.provider.name on its spans and GenAI metrics (docs/operating.md#tracing): the
    # OpenAI API it speaks, unless named (vllm, llama.cpp, ...).
    provider: Annotated[str, Field(min_length=1, max_length=100)] = "openai"
    # X-Request-Id on children: vLLM's "{i}_{parent}", a fresh UUID (servers that insist on
    # one, such as llama-cpp-python), or none at all.
    child_request_id: Literal["prefixed", "uuid", "omit"] = "prefixed"
    retries: Annotated[int, ranged(0, 10)] = 2
    retry_on: tuple[RetryCondition, ...] = ("connect",)
    backoff: Backoff = Backoff()
    retry_budget: RetryBudget = RetryBudget()
    # Another upstream's name: tried once every try here failed in a way retry_on lists.
    fallback: str | None = None
    eject: Eject = Eject()
    discovery: Discovery = Discovery()
    # /readyz: with any upstream "required", the proxy is ready when every required one passed
    # its last health check; with none (the default), when any upstream did.
    readiness: Literal["required", "optional"] = "optional"

    @model_validator(mode="before")
    @classmethod
    def _one_url_or_many(cls, data: Any) -> Any:
        """``url: X`` is short for ``urls: [X]``; exactly one of the two."""
        if isinstance(data, dict) and ("url" in data or "urls" not in data):
            if ("url" in data) == ("urls" in data):
                raise ValueError("give exactly one of url or urls")
            data = {
                ("urls" if k == "url" else k): ([v] if k == "url" else v) for k, v in data.items()
            }
        return data


class Route(_Section):
    upstream: str
    model: str | None = None  # a glob on the body's "model", case-sensitive
    path_prefix: UrlPath | None = None

    @model_validator(mode="after")
    def _matches_something(self) -> Route:
        if self.model is None and self.path_prefix is None:
            raise ValueError("give model or path_prefix")
        return self


class Config(_Section):
    upstreams: Annotated[tuple[Upstream, ...], Field(min_length=1)]
    listen: Listen = Listen()
    admin: Listen | None = None
    max_n: Annotated[int, ranged(1, MAX_N_CEILING)] = 10
    max_body_bytes: Annotated[int, ranged(1, 1 << 31)] = 16 * MiB
    max_children: Annotated[int, ranged(1, 1_000_000)] = 2048  # prompts x n (or best_of)
    max_response_bytes: Annotated[int, ranged(1, 1 << 40)] = 64 * MiB
    max_connections: Annotated[int, ranged(1, 10_000_000, _CONNECTIONS)] = 10_000
    client_timeouts: ClientTimeouts = ClientTimeouts()
    clients: Clients = Clients()
    stream_start: Literal["first", "all"] = "first"
    sse_keepalive_seconds: Annotated[float, Field(strict=True, ge=0)] = 15.0
    drain_seconds: Seconds = 25.0
    drain_grace_seconds: Seconds = 3.0
    log_format: Literal["json", "text"] = "json"
    log_level: Literal["debug", "info", "warning", "error"] = "info"  # info: a line per request
    routes: tuple[Route, ...] = ()
    default_upstream: str = ""  # "" before validation: the first upstream
    fanout_paths: tuple[UrlPath, ...] = DEFAULT_FANOUT_PATHS
    # GET /v1/models when routes name several upstreams: how long each is waited for.
    model_list_timeout: Seconds = 5.0

    @model_validator(mode="before")
    @classmethod
    def _default_upstream_is_the_first(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("default_upstream"):
            upstreams = data.get("upstreams")
            if isinstance(upstreams, list | tuple) and upstreams:
                first = upstreams[0]
                name = first.name if isinstance(first, Upstream) else None
                if isinstance(first, dict):
                    name = first.get("name")
                if isinstance(name, str):
                    data = {**data, "default_upstream": name}
        return data

    @model_validator(mode="after")
    def _names_resolve(self) -> Config:
        names = [u.name for u in self.upstreams]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise keyed(f"upstreams[{i}].name", f"duplicate name {name!r}")
        for i, upstream in enumerate(self.upstreams):
            fallback = upstream.fallback
            if fallback is None:
                continue
            key = f"upstreams[{i}].fallback"
            if fallback not in names:
                raise keyed(key, f"no upstream named {fallback!r}")
            if fallback == upstream.name:
                raise keyed(key, "must name another upstream")
            if self.upstream(fallback).fallback is not None:
                # One hop: no chains, and no two upstreams each holding slots the other waits on.
                raise keyed(key, f"{fallback!r} has a fallback of its own")
            if upstream.native_n and not self.upstream(fallback).native_n:
                raise keyed(key, f"{fallback!r} must be native_n too: n reaches it unsplit")
        for i, route in enumerate(self.routes):
            if route.upstream not in names:
                raise keyed(f"routes[{i}].upstream", f"no upstream named {route.upstream!r}")
        if self.default_upstream not in names:
            raise keyed("default_upstream", f"no upstream named {self.default_upstream!r}")
        for i, path in enumerate(self.fanout_paths):
            if endpoint_of(path) is None:
                raise keyed(
                    f"fanout_paths[{i}]",
                    f"{path!r} is neither a chat completions, a completions nor a generate path:"
                    " n is fanned out only where the proxy knows how to stitch the answers",
                )
        return self

    def upstream(self, name: str) -> Upstream:
        for upstream in self.upstreams:
            if upstream.name == name:
                return upstream
        raise KeyError(name)


def single_upstream_config(url: str, **overrides: Any) -> Config:
    """The local-dev shape: one upstream, everything else default."""
    try:
        upstream = Upstream(name="default", urls=(check_url(url),))
    except ValueError as exc:
        raise ConfigError(f"--upstream: {exc}") from None
    return Config(upstreams=(upstream,), default_upstream="default").model_copy(update=overrides)


def load_config(source: str | Path, env: Mapping[str, str] | None = None) -> Config:
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: cannot read: not UTF-8 (byte {exc.start})") from None
    return parse_config(text, env if env is not None else os.environ)


def parse_config(text: str, env: Mapping[str, str]) -> Config:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError("config: must be a mapping")
    try:
        return Config.model_validate(raw, context={"env": env})
    except ValidationError as exc:
        raise ConfigError(first_error(exc, raw, Config)) from None


def config_schema() -> dict[str, Any]:
    """The JSON Schema of the YAML file, for editors (``n-proxy config-schema``)."""
    schema = Config.model_json_schema()
    schema["title"] = "n-proxy configuration"
    return schema
