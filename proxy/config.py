"""The proxy's configuration: frozen dataclasses built from YAML or CLI flags, validated on load.

Every error names the offending YAML key (``upstreams[1].url: not a URL``).
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml

MAX_N_CEILING = 128  # the OpenAI API's own bound on n
DEFAULT_FANOUT_PATHS = ("/v1/chat/completions", "/v1/completions")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"
    port: int = 8080


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0
    first_byte: float = 600.0
    idle: float = 120.0


@dataclass(frozen=True)
class Upstream:
    name: str
    urls: tuple[str, ...]
    native_n: bool = False
    max_concurrency: int = 64
    max_queue: int = 256
    placement: Literal["spread", "pack"] = "spread"
    headers: Mapping[str, str] = field(default_factory=dict)
    timeouts: Timeouts = Timeouts()
    health_path: str = "/health"
    # X-Request-Id on children: vLLM's "{i}_{parent}", a fresh UUID (servers that insist on
    # one, such as llama-cpp-python), or none at all.
    child_request_id: Literal["prefixed", "uuid", "omit"] = "prefixed"


@dataclass(frozen=True)
class Route:
    upstream: str
    model: str | None = None
    path_prefix: str | None = None

    def matches(self, path: str, model: str | None) -> bool:
        if self.path_prefix is not None and not path.startswith(self.path_prefix):
            return False
        if self.model is not None:
            return model is not None and fnmatch.fnmatchcase(model, self.model)
        return True


@dataclass(frozen=True)
class Config:
    upstreams: tuple[Upstream, ...]
    listen: Listen = Listen()
    admin: Listen | None = None
    max_n: int = 10
    max_body_bytes: int = 16 * 1024 * 1024
    drain_seconds: float = 25.0
    drain_grace_seconds: float = 3.0
    log_format: Literal["json", "text"] = "json"
    routes: tuple[Route, ...] = ()
    default_upstream: str = ""
    fanout_paths: tuple[str, ...] = DEFAULT_FANOUT_PATHS

    def upstream(self, name: str) -> Upstream:
        return next(u for u in self.upstreams if u.name == name)

    def choose_upstream(self, path: str, model: str | None) -> Upstream:
        """The destination comes from configuration alone (SPEC §9: never from Host or the URI)."""
        for route in self.routes:
            if route.matches(path, model):
                return self.upstream(route.upstream)
        return self.upstream(self.default_upstream)

    @property
    def routes_by_model(self) -> bool:
        return any(r.model is not None for r in self.routes)


def single_upstream_config(url: str, **overrides: Any) -> Config:
    """The local-dev shape: one upstream, everything else default."""
    _check_url(url, "--upstream")
    upstream = Upstream(name="default", urls=(url.rstrip("/"),))
    return replace(Config(upstreams=(upstream,), default_upstream="default"), **overrides)


def load_config(source: str | Path, env: Mapping[str, str] | None = None) -> Config:
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    return parse_config(text, env if env is not None else os.environ)


def parse_config(text: str, env: Mapping[str, str]) -> Config:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}") from exc
    return _Reader(env).config(raw)


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class _Reader:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def config(self, raw: object) -> Config:
        top = self._mapping(raw, "config")
        self._known(
            top,
            "",
            {
                "listen",
                "admin",
                "max_n",
                "max_body_bytes",
                "drain_seconds",
                "drain_grace_seconds",
                "log_format",
                "upstreams",
                "routes",
                "default_upstream",
                "fanout_paths",
            },
        )
        upstreams = tuple(
            self._upstream(u, f"upstreams[{i}]")
            for i, u in enumerate(self._list(top.get("upstreams"), "upstreams", min_len=1))
        )
        names = [u.name for u in upstreams]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(f"upstreams[{i}].name: duplicate name {name!r}")
        routes = tuple(
            self._route(r, f"routes[{i}]", names)
            for i, r in enumerate(self._list(top.get("routes", []), "routes"))
        )
        default = top.get("default_upstream", names[0])
        if default not in names:
            raise ConfigError(f"default_upstream: no upstream named {default!r}")
        fanout = tuple(
            self._path(p, f"fanout_paths[{i}]")
            for i, p in enumerate(
                self._list(top.get("fanout_paths", list(DEFAULT_FANOUT_PATHS)), "fanout_paths")
            )
        )
        log_format = top.get("log_format", "json")
        if log_format not in ("json", "text"):
            raise ConfigError("log_format: must be json or text")
        admin = top.get("admin")
        return Config(
            upstreams=upstreams,
            listen=self._listen(top.get("listen", {}), "listen"),
            admin=None if admin is None else self._listen(admin, "admin"),
            max_n=self._int(top.get("max_n", 10), "max_n", 1, MAX_N_CEILING),
            max_body_bytes=self._int(
                top.get("max_body_bytes", 16 * 1024 * 1024), "max_body_bytes", 1, 1 << 31
            ),
            drain_seconds=self._number(top.get("drain_seconds", 25), "drain_seconds"),
            drain_grace_seconds=self._number(
                top.get("drain_grace_seconds", 3), "drain_grace_seconds"
            ),
            log_format=log_format,
            routes=routes,
            default_upstream=default,
            fanout_paths=fanout,
        )

    def _upstream(self, raw: object, key: str) -> Upstream:
        m = self._mapping(raw, key)
        self._known(
            m,
            key,
            {
                "name",
                "url",
                "urls",
                "native_n",
                "max_concurrency",
                "max_queue",
                "placement",
                "headers",
                "timeouts",
                "health_path",
                "child_request_id",
            },
        )
        name = m.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key}.name: required, a non-empty string")
        if ("url" in m) == ("urls" in m):
            raise ConfigError(f"{key}: give exactly one of url or urls")
        if "url" in m:
            urls: tuple[str, ...] = (self._url(m["url"], f"{key}.url"),)
        else:
            urls = tuple(
                self._url(u, f"{key}.urls[{i}]")
                for i, u in enumerate(self._list(m["urls"], f"{key}.urls", min_len=1))
            )
        placement = m.get("placement", "spread")
        if placement not in ("spread", "pack"):
            raise ConfigError(f"{key}.placement: must be spread or pack")
        child_request_id = m.get("child_request_id", "prefixed")
        if child_request_id not in ("prefixed", "uuid", "omit"):
            raise ConfigError(f"{key}.child_request_id: must be prefixed, uuid or omit")
        native_n = m.get("native_n", False)
        if not isinstance(native_n, bool):
            raise ConfigError(f"{key}.native_n: must be true or false")
        headers_raw = self._mapping(m.get("headers", {}), f"{key}.headers")
        headers = {}
        for h, v in headers_raw.items():
            if not isinstance(h, str) or not isinstance(v, str | int | float):
                raise ConfigError(f"{key}.headers.{h}: must be a string")
            value = self._expand(str(v), f"{key}.headers.{h}")
            if "\r" in value or "\n" in value:
                raise ConfigError(f"{key}.headers.{h}: contains a line break")
            headers[h] = value
        t = self._mapping(m.get("timeouts", {}), f"{key}.timeouts")
        self._known(t, f"{key}.timeouts", {"connect", "first_byte", "idle"})
        d = Timeouts()
        timeouts = Timeouts(
            connect=self._number(t.get("connect", d.connect), f"{key}.timeouts.connect"),
            first_byte=self._number(
                t.get("first_byte", d.first_byte), f"{key}.timeouts.first_byte"
            ),
            idle=self._number(t.get("idle", d.idle), f"{key}.timeouts.idle"),
        )
        return Upstream(
            name=name,
            urls=urls,
            native_n=native_n,
            max_concurrency=self._int(
                m.get("max_concurrency", 64), f"{key}.max_concurrency", 1, 100_000
            ),
            max_queue=self._int(m.get("max_queue", 256), f"{key}.max_queue", 0, 1_000_000),
            placement=placement,
            headers=headers,
            timeouts=timeouts,
            health_path=self._path(m.get("health_path", "/health"), f"{key}.health_path"),
            child_request_id=child_request_id,
        )

    def _route(self, raw: object, key: str, names: list[str]) -> Route:
        m = self._mapping(raw, key)
        self._known(m, key, {"model", "path_prefix", "upstream"})
        upstream = m.get("upstream")
        if upstream not in names:
            raise ConfigError(f"{key}.upstream: no upstream named {upstream!r}")
        model = m.get("model")
        if model is not None and not isinstance(model, str):
            raise ConfigError(f"{key}.model: must be a string glob")
        prefix = m.get("path_prefix")
        if prefix is not None:
            prefix = self._path(prefix, f"{key}.path_prefix")
        if model is None and prefix is None:
            raise ConfigError(f"{key}: give model or path_prefix")
        return Route(upstream=str(upstream), model=model, path_prefix=prefix)

    def _listen(self, raw: object, key: str) -> Listen:
        m = self._mapping(raw, key)
        self._known(m, key, {"host", "port"})
        host = m.get("host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise ConfigError(f"{key}.host: must be a host name or address")
        return Listen(host=host, port=self._int(m.get("port", 8080), f"{key}.port", 0, 65535))

    def _url(self, raw: object, key: str) -> str:
        if not isinstance(raw, str):
            raise ConfigError(f"{key}: not a URL")
        return _check_url(self._expand(raw, key), key)

    def _expand(self, value: str, key: str) -> str:
        def sub(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in self.env:
                raise ConfigError(f"{key}: environment variable {name} is not set")
            return self.env[name]

        return _ENV.sub(sub, value)

    @staticmethod
    def _path(raw: object, key: str) -> str:
        if not isinstance(raw, str) or not raw.startswith("/"):
            raise ConfigError(f"{key}: must be a path starting with /")
        return raw

    @staticmethod
    def _mapping(raw: object, key: str) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise ConfigError(f"{key}: must be a mapping")
        return raw

    @staticmethod
    def _list(raw: object, key: str, min_len: int = 0) -> list[Any]:
        if not isinstance(raw, list) or len(raw) < min_len:
            raise ConfigError(f"{key}: must be a list" + (" (not empty)" if min_len else ""))
        return raw

    @staticmethod
    def _known(m: Mapping[str, Any], key: str, allowed: set[str]) -> None:
        for name in m:
            if name not in allowed:
                where = f"{key}.{name}" if key else str(name)
                raise ConfigError(f"{where}: unknown key")

    @staticmethod
    def _int(raw: object, key: str, lo: int, hi: int) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int) or not lo <= raw <= hi:
            raise ConfigError(f"{key}: must be an integer from {lo} to {hi}")
        return raw

    @staticmethod
    def _number(raw: object, key: str) -> float:
        if isinstance(raw, bool) or not isinstance(raw, int | float) or raw <= 0:
            raise ConfigError(f"{key}: must be a positive number of seconds")
        return float(raw)


def _check_url(url: str, key: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key}: not a URL")
    if parts.query or parts.fragment:
        raise ConfigError(f"{key}: must not have a query or fragment")
    return url.rstrip("/")
