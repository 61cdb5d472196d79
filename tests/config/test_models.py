"""Tests for proxy.config.models: literal YAML in, frozen Config out, or an error naming the YAML
key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from proxy.config import models
from proxy.config.models import (
    Backoff,
    Config,
    ConfigError,
    Listen,
    Placement,
    RetryBudget,
    Route,
    Timeouts,
    Upstream,
    load_config,
    parse_config,
    single_upstream_config,
)
from proxy.server.app import GENERATIONS
from tests.support.servers import Backend, Servers

ROOT = Path(__file__).resolve().parents[2]

FULL = """\
listen: {host: 0.0.0.0, port: 9000}
admin: {host: 127.0.0.1, port: 9001}
max_n: 32
max_body_bytes: 1048576
drain_seconds: 12.5
log_format: text
default_upstream: llama
fanout_paths: [/openai/v1/chat/completions, /openai/v1/completions]
upstreams:
  - name: vllm
    url: http://vllm.local:8000/
    native_n: true
    max_concurrency: 8
    max_queue: 0
    placement: pack
    headers:
      Authorization: Bearer ${TOKEN}
      X-Tenant: 7
    timeouts: {connect: 1.5, first_byte: 30, idle: 10}
  - name: llama
    urls: [http://10.0.0.1:8080, "https://${LLAMA_HOST}:8443/base/"]
routes:
  - model: "llama-*"
    upstream: llama
  - path_prefix: /openai
    upstream: vllm
  - model: "qwen*"
    path_prefix: /v1
    upstream: vllm
"""

ENV = {"TOKEN": "s3cret", "LLAMA_HOST": "llama.local"}

MINIMAL = "upstreams: [{name: a, url: http://x:1}]"


def test_full_config_with_every_key_parses() -> None:
    assert parse_config(FULL, ENV) == Config(
        upstreams=(
            Upstream(
                name="vllm",
                urls=("http://vllm.local:8000",),
                native_n=True,
                max_concurrency=8,
                max_queue=0,
                placement=Placement(choose="round_robin", pack="all"),
                headers={"Authorization": "Bearer s3cret", "X-Tenant": "7"},
                timeouts=Timeouts(connect=1.5, first_byte=30.0, idle=10.0),
            ),
            Upstream(
                name="llama",
                urls=("http://10.0.0.1:8080", "https://llama.local:8443/base"),
            ),
        ),
        listen=Listen(host="0.0.0.0", port=9000),
        admin=Listen(host="127.0.0.1", port=9001),
        max_n=32,
        max_body_bytes=1048576,
        drain_seconds=12.5,
        log_format="text",
        routes=(
            Route(upstream="llama", model="llama-*"),
            Route(upstream="vllm", path_prefix="/openai"),
            Route(upstream="vllm", model="qwen*", path_prefix="/v1"),
        ),
        default_upstream="llama",
        fanout_paths=("/openai/v1/chat/completions", "/openai/v1/completions"),
    )


def test_minimal_config_takes_the_defaults() -> None:
    config = parse_config(MINIMAL, {})
    assert config == Config(
        upstreams=(Upstream(name="a", urls=("http://x:1",)),),
        default_upstream="a",
    )
    assert config.max_n == 10
    assert config.max_body_bytes == 16 * 1024 * 1024
    assert config.fanout_paths == (
        "/v1/chat/completions",
        "/v1/completions",
        "/inference/v1/generate",
    )
    assert config.listen == Listen(host="127.0.0.1", port=8080)
    assert config.admin is None
    assert config.routes == ()


def _sections(value: object, path: str) -> Iterator[tuple[str, BaseModel]]:
    """Every model reachable from ``value``, with where it sits (``upstreams[0].timeouts``)."""
    if isinstance(value, BaseModel):
        yield path, value
        for name in type(value).model_fields:
            yield from _sections(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, tuple):
        for at, item in enumerate(value):
            yield from _sections(item, f"{path}[{at}]")


# The one container a section holds that can change in place: the headers dict, which the proxy
# reads per request. A new mutable field fails the test below; so does making this one immutable.
MUTABLE_IN_PLACE = {"Upstream.headers"}


async def test_no_section_of_a_running_proxys_config_can_be_changed(
    servers: Servers, backend: Backend
) -> None:
    """Every section of the config a proxy runs on (the full example: every section there is)
    refuses to have any field reassigned, and holds its sequences as tuples."""
    full = load_config(ROOT / "config" / "full.yaml", {"CHAT_API_KEY": "k"})
    at_backend = tuple(u.model_copy(update={"urls": (backend.url,)}) for u in full.upstreams)
    proxy = await servers.proxy(full.model_copy(update={"upstreams": at_backend}))
    config = proxy.app[GENERATIONS].upstreams.config
    sections = list(_sections(config, "config"))
    every_kind = {
        kind
        for kind in vars(models).values()
        if isinstance(kind, type)
        and issubclass(kind, BaseModel)
        and kind.__module__ == models.__name__
        and kind.model_fields  # the sections' shared base has none
    }
    assert {type(section) for _, section in sections} == every_kind
    mutable = set()
    for where, section in sections:
        for name in type(section).model_fields:
            with pytest.raises(ValidationError, match="frozen"):
                setattr(section, name, getattr(section, name))
            value = getattr(section, name)
            assert not isinstance(value, list | set | bytearray), f"{where}.{name}"
            if isinstance(value, dict):
                mutable.add(f"{type(section).__name__}.{name}")
    assert mutable == MUTABLE_IN_PLACE


@pytest.mark.parametrize("max_n", [1, 10, 128])
def test_max_n_within_1_to_128_is_accepted(max_n: int) -> None:
    assert parse_config(f"max_n: {max_n}\n{MINIMAL}", {}).max_n == max_n


@pytest.mark.parametrize(
    ("text", "key", "says"),
    [
        pytest.param("", "config", "mapping", id="empty-file"),
        pytest.param("- a\n- b", "config", "mapping", id="top-level-list"),
        pytest.param(f"colour: blue\n{MINIMAL}", "colour", "unknown", id="unknown-top-level-key"),
        pytest.param("max_n: 2", "upstreams", "required", id="no-upstreams"),
        pytest.param("upstreams: []", "upstreams", "list", id="empty-upstreams"),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, colour: blue}]",
            "upstreams[0].colour",
            "unknown",
            id="unknown-upstream-key",
        ),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1}, {name: b, url: 'not a url'}]",
            "upstreams[1].url",
            "not a URL",
            id="url-not-a-url",
        ),
        pytest.param(
            "upstreams: [{name: a, url: 'ftp://x:1'}]",
            "upstreams[0].url",
            "not a URL",
            id="url-not-http",
        ),
        pytest.param(
            "upstreams: [{name: a, url: 'http://'}]",
            "upstreams[0].url",
            "not a URL",
            id="url-without-host",
        ),
        pytest.param(
            "upstreams: [{name: a, url: 8080}]", "upstreams[0].url", "not a URL", id="url-number"
        ),
        pytest.param(
            "upstreams: [{name: a, urls: [http://x:1, 'x:2']}]",
            "upstreams[0].urls[1]",
            "not a URL",
            id="urls-entry-not-a-url",
        ),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, urls: [http://y:1]}]",
            "upstreams[0]",
            "url",
            id="both-url-and-urls",
        ),
        pytest.param("upstreams: [{name: a}]", "upstreams[0]", "url", id="neither-url-nor-urls"),
        pytest.param(
            "upstreams: [{name: a, urls: []}]", "upstreams[0].urls", "list", id="empty-urls"
        ),
        pytest.param("upstreams: [{url: http://x:1}]", "upstreams[0].name", "", id="no-name"),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1}, {name: a, url: http://y:1}]",
            "upstreams[1].name",
            "duplicate",
            id="duplicate-names",
        ),
        pytest.param(
            f"routes: [{{model: m, upstream: nowhere}}]\n{MINIMAL}",
            "routes[0].upstream",
            "nowhere",
            id="route-to-unknown-upstream",
        ),
        pytest.param(
            f"routes: [{{upstream: a}}]\n{MINIMAL}", "routes[0]", "", id="route-matches-nothing"
        ),
        pytest.param(
            f"routes: [{{model: m, upstream: a, colour: blue}}]\n{MINIMAL}",
            "routes[0].colour",
            "unknown",
            id="unknown-route-key",
        ),
        pytest.param(
            f"default_upstream: nowhere\n{MINIMAL}",
            "default_upstream",
            "nowhere",
            id="default-upstream-unknown",
        ),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, placement: random}]",
            "upstreams[0].placement",
            "",
            id="placement-bad",
        ),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, native_n: 'yes please'}]",
            "upstreams[0].native_n",
            "",
            id="native-n-not-bool",
        ),
        pytest.param(f"max_n: 0\n{MINIMAL}", "max_n", "128", id="max-n-zero"),
        pytest.param(f"max_n: 129\n{MINIMAL}", "max_n", "128", id="max-n-above-openai-bound"),
        pytest.param(f"max_n: true\n{MINIMAL}", "max_n", "integer", id="max-n-boolean"),
        pytest.param(f"max_n: 2.5\n{MINIMAL}", "max_n", "integer", id="max-n-float"),
        pytest.param(f"max_n: '4'\n{MINIMAL}", "max_n", "integer", id="max-n-string"),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, timeouts: {connect: -1}}]",
            "upstreams[0].timeouts.connect",
            "positive",
            id="timeout-connect-negative",
        ),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, timeouts: {idle: -0.5}}]",
            "upstreams[0].timeouts.idle",
            "positive",
            id="timeout-idle-negative",
        ),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, timeouts: {first_byte: soon}}]",
            "upstreams[0].timeouts.first_byte",
            "",
            id="timeout-not-a-number",
        ),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, timeouts: {total: 3}}]",
            "upstreams[0].timeouts.total",
            "unknown",
            id="unknown-timeout-key",
        ),
        pytest.param(f"drain_seconds: -3\n{MINIMAL}", "drain_seconds", "", id="drain-negative"),
        pytest.param(f"log_format: xml\n{MINIMAL}", "log_format", "", id="log-format-bad"),
        pytest.param(f"listen: {{port: 70000}}\n{MINIMAL}", "listen.port", "", id="port-too-big"),
        pytest.param(
            f"listen: {{host: h, port: 1, ssl: true}}\n{MINIMAL}",
            "listen.ssl",
            "unknown",
            id="unknown-listen-key",
        ),
        pytest.param(
            f"fanout_paths: [v1/chat/completions]\n{MINIMAL}",
            "fanout_paths[0]",
            "/",
            id="fanout-path-without-slash",
        ),
        pytest.param(
            f"fanout_paths: [/v1/chat/completions, /v1/responses]\n{MINIMAL}",
            "fanout_paths[1]",
            "neither a chat completions, a completions nor a generate path",
            id="fanout-path-of-unknown-kind",
        ),
        pytest.param(
            f"max_body_bytes: 0\n{MINIMAL}", "max_body_bytes", "", id="max-body-bytes-zero"
        ),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, max_concurrency: 0}]",
            "upstreams[0].max_concurrency",
            "",
            id="max-concurrency-zero",
        ),
        pytest.param(
            'upstreams: [{name: a, url: http://x:1, headers: {X-Bad: "a\\r\\nEvil: 1"}}]',
            "upstreams[0].headers.X-Bad",
            "",
            id="header-with-line-break",
        ),
    ],
)
def test_bad_config_error_names_the_key(text: str, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, {})
    message = str(info.value)
    assert message.startswith(f"{key}: "), message
    assert says in message


def test_invalid_yaml_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        parse_config("upstreams: [{name: a, url: http://x:1", {})


@pytest.mark.parametrize(
    ("text", "env", "expected_url", "expected_headers"),
    [
        pytest.param(
            "upstreams: [{name: a, url: 'http://${HOST}:${PORT}/v'}]",
            {"HOST": "backend", "PORT": "8000"},
            "http://backend:8000/v",
            {},
            id="url",
        ),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, headers: {Authorization: 'Bearer ${K}'}}]",
            {"K": "abc123"},
            "http://x:1",
            {"Authorization": "Bearer abc123"},
            id="header",
        ),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, headers: {X-Price: '$5 or ${'}}]",
            {},
            "http://x:1",
            {"X-Price": "$5 or ${"},
            id="no-placeholder",
        ),
    ],
)
def test_env_placeholders_are_expanded(
    text: str, env: dict[str, str], expected_url: str, expected_headers: dict[str, str]
) -> None:
    [upstream] = parse_config(text, env).upstreams
    assert upstream.urls == (expected_url,)
    assert upstream.headers == expected_headers


@pytest.mark.parametrize(
    ("text", "key"),
    [
        pytest.param(
            "upstreams: [{name: a, url: 'http://${HOST}:1'}]", "upstreams[0].url", id="url"
        ),
        pytest.param(
            "upstreams: [{name: a, urls: [http://x:1, 'http://${HOST}:1']}]",
            "upstreams[0].urls[1]",
            id="urls-entry",
        ),
        pytest.param(
            "upstreams: [{name: a, url: http://x:1, headers: {Authorization: 'Bearer ${HOST}'}}]",
            "upstreams[0].headers.Authorization",
            id="header",
        ),
    ],
)
def test_missing_env_variable_is_an_error_naming_the_key_and_variable(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, {"OTHER": "x"})
    message = str(info.value)
    assert message.startswith(f"{key}: "), message
    assert "HOST" in message


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text(FULL, encoding="utf-8")
    assert load_config(path, ENV) == parse_config(FULL, ENV)
    assert load_config(str(path), ENV) == parse_config(FULL, ENV)


def test_load_config_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.yaml", {})
    assert "absent.yaml" in str(info.value)


def test_single_upstream_config_is_one_default_upstream() -> None:
    assert single_upstream_config("http://127.0.0.1:8000/") == Config(
        upstreams=(Upstream(name="default", urls=("http://127.0.0.1:8000",)),),
        default_upstream="default",
    )


def test_single_upstream_config_applies_overrides() -> None:
    config = single_upstream_config("http://127.0.0.1:8000", max_n=64, log_format="text")
    assert (config.max_n, config.log_format) == (64, "text")
    assert config.upstream(config.default_upstream).urls == ("http://127.0.0.1:8000",)


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://h:1", "http://", "not a url"])
def test_single_upstream_config_rejects_a_bad_url(url: str) -> None:
    with pytest.raises(ConfigError):
        single_upstream_config(url)


def test_default_upstream_defaults_to_the_first() -> None:
    config = parse_config(
        "upstreams: [{name: one, url: http://a:1}, {name: two, url: http://b:1}]", {}
    )
    assert config.default_upstream == "one"


# --- replicas and failover (docs/behaviour.md#failover) -----------------------------------------

FAILOVER = "upstreams: [{{name: a, urls: [http://x:1, http://y:1], {}}}]"


def test_failover_keys_parse_as_written_in_the_issue() -> None:
    text = FAILOVER.format(
        "retries: 3, retry_on: [connect, reset, 503, 429], eject: {failures: 5, seconds: 2.5}, "
        "discovery: {dns: true, interval: 30}, health_interval: 1"
    )
    (upstream,) = parse_config(text, {}).upstreams
    assert (upstream.retries, upstream.retry_on) == (3, ("connect", "reset", 503, 429))
    assert (upstream.eject.failures, upstream.eject.seconds) == (5, 2.5)
    assert (upstream.discovery.dns, upstream.discovery.interval) == (True, 30.0)
    assert upstream.health_interval == 1.0


def test_failover_defaults() -> None:
    (upstream,) = parse_config(MINIMAL, {}).upstreams
    assert (upstream.retries, upstream.retry_on) == (2, ("connect",))
    assert (upstream.eject.failures, upstream.eject.seconds) == (3, 10.0)
    assert (upstream.discovery.dns, upstream.discovery.interval) == (False, 10.0)
    assert upstream.health_interval == 5.0


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        pytest.param("retries: -1", "retries", id="retries-negative"),
        pytest.param("retries: 11", "retries", id="retries-above-10"),
        pytest.param("retries: 1.5", "retries", id="retries-float"),
        pytest.param("retries: true", "retries", id="retries-boolean"),
        pytest.param("retry_on: connect", "retry_on", id="retry-on-not-a-list"),
        pytest.param("retry_on: [timeout]", "retry_on[0]", id="retry-on-unknown-word"),
        pytest.param("retry_on: [connect, 200]", "retry_on[1]", id="retry-on-2xx-status"),
        pytest.param("retry_on: [600]", "retry_on[0]", id="retry-on-status-above-599"),
        pytest.param("retry_on: ['503']", "retry_on[0]", id="retry-on-status-as-string"),
        pytest.param("retry_on: [true]", "retry_on[0]", id="retry-on-boolean"),
        pytest.param("eject: {failures: -1}", "eject.failures", id="eject-failures-negative"),
        pytest.param("eject: {failures: 2.5}", "eject.failures", id="eject-failures-float"),
        pytest.param("eject: {seconds: 0}", "eject.seconds", id="eject-seconds-zero"),
        pytest.param("eject: {seconds: soon}", "eject.seconds", id="eject-seconds-word"),
        pytest.param("eject: {after: 3}", "eject.after", id="eject-unknown-key"),
        pytest.param("eject: 3", "eject", id="eject-not-a-mapping"),
        pytest.param("discovery: {dns: 'yes'}", "discovery.dns", id="discovery-dns-string"),
        pytest.param("discovery: {interval: -1}", "discovery.interval", id="discovery-interval"),
        pytest.param("discovery: {srv: true}", "discovery.srv", id="discovery-unknown-key"),
        pytest.param("health_interval: 0", "health_interval", id="health-interval-zero"),
        pytest.param("health_interval: fast", "health_interval", id="health-interval-word"),
        pytest.param("backoff: {base: 0}", "backoff.base", id="backoff-base-zero"),
        pytest.param("backoff: {base: 2, cap: 1}", "backoff", id="backoff-cap-below-base"),
        pytest.param("backoff: {retry_after_cap: -1}", "backoff.retry_after_cap", id="ra-cap"),
        pytest.param("backoff: {jitter: 0.5}", "backoff.jitter", id="backoff-unknown-key"),
        pytest.param("retry_budget: {percent: -5}", "retry_budget.percent", id="budget-percent"),
        pytest.param("retry_budget: {window: 0}", "retry_budget.window", id="budget-window"),
        pytest.param("retry_budget: 20", "retry_budget", id="budget-not-a-mapping"),
        pytest.param("placement: random", "placement", id="placement-unknown-preset"),
        pytest.param("placement: {pack: 0}", "placement.pack", id="pack-zero"),
        pytest.param("placement: {pack: true}", "placement.pack", id="pack-boolean"),
        pytest.param("placement: {pack: some}", "placement.pack", id="pack-word"),
        pytest.param("placement: {choose: random}", "placement.choose", id="choose-unknown"),
        pytest.param("fallback: a", "fallback", id="fallback-itself"),
        pytest.param("fallback: nowhere", "fallback", id="fallback-unknown"),
    ],
)
def test_bad_failover_value_error_names_the_key(fields: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(FAILOVER.format(fields), {})
    message = str(info.value)
    assert message.startswith(f"upstreams[0].{key}: "), message


def test_retry_timing_keys_parse_and_default() -> None:
    text = FAILOVER.format(
        "backoff: {base: 0.1, cap: 5, retry_after_cap: 30}, "
        "retry_budget: {percent: 50, min_per_second: 1, window: 5}"
    )
    (upstream,) = parse_config(text, {}).upstreams
    assert upstream.backoff == Backoff(base=0.1, cap=5.0, retry_after_cap=30.0)
    assert upstream.retry_budget == RetryBudget(percent=50.0, min_per_second=1.0, window=5.0)
    (default,) = parse_config(MINIMAL, {}).upstreams
    assert default.backoff == Backoff(base=0.05, cap=2.0, retry_after_cap=10.0)
    assert default.retry_budget == RetryBudget(percent=20.0, min_per_second=3.0, window=10.0)
    assert default.fallback is None


@pytest.mark.parametrize(
    ("written", "placement"),
    [
        ("", Placement(choose="round_robin", pack=1)),  # as before: spread
        ("placement: spread", Placement(choose="round_robin", pack=1)),
        ("placement: pack", Placement(choose="round_robin", pack="all")),
        ("placement: least_outstanding", Placement(choose="least_outstanding", pack=1)),
        ("placement: {pack: 4}", Placement(choose="least_outstanding", pack=4)),
        ("placement: {pack: all}", Placement(choose="least_outstanding", pack="all")),
        ("placement: {choose: round_robin, pack: 2}", Placement(choose="round_robin", pack=2)),
    ],
)
def test_placement_is_a_preset_or_a_mapping_and_old_configs_keep_their_meaning(
    written: str, placement: Placement
) -> None:
    text = f"upstreams: [{{name: a, url: http://x:1{', ' if written else ''}{written}}}]"
    (upstream,) = parse_config(text, {}).upstreams
    assert upstream.placement == placement


def test_a_fallback_names_another_upstream() -> None:
    text = "upstreams: [{name: a, url: http://x:1, fallback: b}, {name: b, url: http://y:1}]"
    assert parse_config(text, {}).upstreams[0].fallback == "b"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "upstreams: [{name: a, url: http://x:1, fallback: b},"
            " {name: b, url: http://y:1, fallback: a}]",
            "upstreams[0].fallback: 'b' has a fallback of its own",
        ),
        (
            "upstreams: [{name: a, url: http://x:1, native_n: true, fallback: b},"
            " {name: b, url: http://y:1}]",
            "'b' must be native_n too",
        ),
    ],
)
def test_a_fallback_is_one_hop_and_serves_n_as_the_upstream_does(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, {})
    assert str(info.value).startswith("upstreams[")
    assert says in str(info.value)


def test_clients_and_admission_default_to_fair_by_authorization_with_no_cap() -> None:
    config = parse_config(MINIMAL, {})
    assert (config.clients.identify, config.clients.header, config.clients.max_children) == (
        "authorization", None, 0,
    )  # fmt: skip
    assert config.upstreams[0].admission == "fair"
    text = (
        "clients: {identify: header, header: X-Forwarded-For, max_children: 64}\n"
        "upstreams: [{name: a, url: http://x:1, admission: fifo}]"
    )
    config = parse_config(text, {})
    assert (config.clients.identify, config.clients.header, config.clients.max_children) == (
        "header", "X-Forwarded-For", 64,
    )  # fmt: skip
    assert config.upstreams[0].admission == "fifo"


@pytest.mark.parametrize(
    ("clients", "key", "says"),
    [
        ("{identify: header}", "clients.header", "required with identify: header"),
        ("{header: X-Forwarded-For}", "clients.header", "only with identify: header"),
        ("{identify: header, header: 'X Bad'}", "clients.header", ""),
        ("{identify: cookie}", "clients.identify", ""),
        ("{max_children: -1}", "clients.max_children", "0 to 1000000"),
        ("{max_children: true}", "clients.max_children", "integer"),
        ("{colour: blue}", "clients.colour", "unknown"),
    ],
)
def test_a_bad_clients_section_names_the_key(clients: str, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(f"clients: {clients}\n{MINIMAL}", {})
    message = str(info.value)
    assert message.startswith(f"{key}: "), message
    assert says in message


def test_admission_is_fair_or_fifo() -> None:
    with pytest.raises(ConfigError, match=r"^upstreams\[0\]\.admission: "):
        parse_config("upstreams: [{name: a, url: http://x:1, admission: lifo}]", {})
