"""Which upstream a request goes to: configuration alone decides (never the request's Host or an
absolute URI), the first matching route or else the default upstream."""

from __future__ import annotations

import pytest

from proxy.config.models import Upstream, parse_config
from proxy.observe.metrics import Metrics
from proxy.upstream.service import Upstreams


def route(config: str, path: str, model: str | None) -> Upstream:
    return Upstreams(parse_config(config, {}), Metrics()).route(path, model)


ROUTED = """\
default_upstream: fallback
upstreams:
  - {name: fallback, url: http://fallback:1}
  - {name: llama, url: http://llama:1}
  - {name: openai, url: http://openai:1}
  - {name: qwen-v1, url: http://qwen:1}
routes:
  - {model: "llama-*", upstream: llama}
  - {path_prefix: /openai/, upstream: openai}
  - {model: "qwen?", path_prefix: /v1/, upstream: qwen-v1}
"""


@pytest.mark.parametrize(
    ("path", "model", "expected"),
    [
        pytest.param("/v1/chat/completions", "llama-3-8b", "llama", id="model-glob"),
        pytest.param("/openai/v1/chat/completions", "llama-3", "llama", id="first-route-wins"),
        pytest.param("/openai/v1/completions", "gpt", "openai", id="path-prefix"),
        pytest.param("/openai/v1/models", None, "openai", id="path-prefix-without-model"),
        pytest.param("/v1/completions", "qwen2", "qwen-v1", id="model-and-prefix"),
        pytest.param("/v2/completions", "qwen2", "fallback", id="model-right-prefix-wrong"),
        pytest.param("/v1/completions", "qwen25", "fallback", id="glob-question-mark-one-char"),
        pytest.param("/v1/chat/completions", "Llama-3", "fallback", id="glob-is-case-sensitive"),
        pytest.param("/v1/chat/completions", "mistral", "fallback", id="no-match-falls-back"),
        pytest.param("/v1/models", None, "fallback", id="no-model-falls-back"),
    ],
)
def test_the_first_matching_route_picks_the_upstream(
    path: str, model: str | None, expected: str
) -> None:
    assert route(ROUTED, path, model).name == expected


def test_with_no_routes_every_request_goes_to_the_default_upstream() -> None:
    config = "upstreams: [{name: one, url: http://a:1}, {name: two, url: http://b:1}]"
    assert route(config, "/v1/chat/completions", "m").name == "one"
    assert not Upstreams(parse_config(config, {}), Metrics()).routes_by_model


def test_only_a_model_route_makes_the_proxy_read_a_pass_through_body_for_its_model() -> None:
    by_path = "upstreams: [{name: a, url: http://a:1}]\nroutes: [{path_prefix: /x/, upstream: a}]"
    assert not Upstreams(parse_config(by_path, {}), Metrics()).routes_by_model
    assert Upstreams(parse_config(ROUTED, {}), Metrics()).routes_by_model
