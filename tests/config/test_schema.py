"""The published JSON Schema: it is what ``n-proxy config-schema`` prints, and every shipped config
(the examples and each rendered Kubernetes ConfigMap) passes both the schema and the loader."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from proxy.cli import main
from proxy.config.models import config_schema, parse_config
from tests.meta.test_deploy import TREES, rendered

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_FILE = ROOT / "config" / "n-proxy.schema.json"
EXAMPLES = sorted((ROOT / "config").glob("*.yaml"))


def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(config_schema())


def _fake_env(text: str) -> dict[str, str]:
    return {name: "x" for name in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", text)}


def test_config_schema_command_prints_the_committed_schema(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config-schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(printed)
    assert printed == json.loads(SCHEMA_FILE.read_text(encoding="utf-8")), (
        "config/n-proxy.schema.json is stale: n-proxy config-schema > config/n-proxy.schema.json"
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_names_the_schema_and_passes_schema_and_loader(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# yaml-language-server: $schema=n-proxy.schema.json\n")
    _validator().validate(yaml.safe_load(text))
    parse_config(text, _fake_env(text))


@pytest.mark.parametrize("tree", TREES)
def test_rendered_configmap_passes_schema_and_loader(tree: str) -> None:
    configmaps = [o for o in rendered(tree) if o["kind"] == "ConfigMap"]
    assert configmaps
    for configmap in configmaps:
        text = configmap["data"]["config.yaml"]
        _validator().validate(yaml.safe_load(text))
        parse_config(text, {})


BAD: list[tuple[str, Any]] = [
    ("unknown-top-level-key", {"upstreams": [{"name": "a", "url": "http://x:1"}], "colour": 1}),
    ("both-url-and-urls", {"upstreams": [{"name": "a", "url": "http://x", "urls": ["http://y"]}]}),
    ("neither-url-nor-urls", {"upstreams": [{"name": "a"}]}),
    ("max-n-too-big", {"upstreams": [{"name": "a", "url": "http://x:1"}], "max_n": 129}),
    ("retry-on-200", {"upstreams": [{"name": "a", "url": "http://x:1", "retry_on": [200]}]}),
    ("stream-start-bad", {"upstreams": [{"name": "a", "url": "http://x:1"}], "stream_start": "x"}),
]


@pytest.mark.parametrize(("name", "document"), BAD, ids=[b[0] for b in BAD])
def test_schema_and_loader_both_reject_a_bad_config(name: str, document: Any) -> None:
    assert not _validator().is_valid(document)
    from proxy.config.models import ConfigError

    with pytest.raises(ConfigError):
        parse_config(yaml.safe_dump(document), {})
