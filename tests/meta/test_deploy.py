"""Deployment artefacts: renders deploy/kubernetes offline, validates every object against the
Kubernetes schemas of a pinned version, and checks the sidecar invariants and the Dockerfile."""

from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from aiohttp import web
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TREES = {
    "base": DEPLOY / "kubernetes" / "base",
    "vllm": DEPLOY / "kubernetes" / "overlays" / "vllm",
    "llamacpp": DEPLOY / "kubernetes" / "overlays" / "llamacpp",
}
OVERLAYS = ("vllm", "llamacpp")
COMPONENT_DIR = DEPLOY / "kubernetes" / "components" / "n-proxy-sidecar"
# The schemas ship inside the kubernetes-validate wheel, one folder per minor version, so
# validation needs no network and no cluster.
KUBERNETES_VERSION = "1.32"

Manifest = dict[str, Any]


# --- A kustomize renderer for exactly the fields deploy/kubernetes uses --------------------------
#
# Real kustomize is a Go binary that Debian does not package (only kubectl 1.20, whose embedded
# kustomize predates `labels`). These ~100 lines cover resources, configMapGenerator from files,
# strategic-merge patches, labels and the generated ConfigMap's hash suffix; any other field
# raises, so a kustomization that outgrows the renderer fails loudly instead of rendering wrong.
# test_renderer_agrees_with_real_kustomize pins it to the real thing wherever one is installed.

_KUSTOMIZATION_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "configMapGenerator",
    "patches",
    "labels",
}
# patchMergeKey of the pod-spec lists the overlays patch (from the Kubernetes API); any other
# list is replaced whole, which is what strategic merge does for lists that have none.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "ports": "containerPort",
}


@dataclass
class _Build:
    objects: list[Manifest] = field(default_factory=list)
    generated: set[str] = field(default_factory=set)


def render(tree: Path) -> list[Manifest]:
    build = _accumulate(tree)
    # kustomize adds hash suffixes once, after every layer's transformers, then fixes references.
    renames = {}
    for obj in build.objects:
        name = obj["metadata"]["name"]
        if obj["kind"] == "ConfigMap" and name in build.generated:
            renames[name] = obj["metadata"]["name"] = f"{name}-{configmap_hash(obj)}"
    for obj in build.objects:
        for volume in obj.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "configMap" in volume and volume["configMap"]["name"] in renames:
                volume["configMap"]["name"] = renames[volume["configMap"]["name"]]
    return build.objects


def configmap_hash(configmap: Manifest) -> str:
    """kustomize's suffix: sha256 of Go's json.Marshal of {data, kind, name}, first 10 hex digits
    with 0, 1, 3, a, e swapped for g, h, k, m, t.

    kustomize (v5) looks the name up as one key spelt "metadata/name", finds nothing and hashes
    an empty name; the suffix depends on the data alone. Matching that is what counts here.
    """
    encoded = json.dumps(
        {"data": configmap["data"], "kind": "ConfigMap", "name": ""},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    for char in "<>&\u2028\u2029":  # Go escapes these for safe embedding in HTML; Python does not
        encoded = encoded.replace(char, f"\\u{ord(char):04x}")
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _accumulate(directory: Path, build: _Build | None = None) -> _Build:
    """One kustomization's layer; a Component's (``build`` given) works on what it is given."""
    spec = _load_one(directory / "kustomization.yaml")
    _expect_fields(spec, _KUSTOMIZATION_FIELDS, directory)
    component = build is not None
    assert spec["kind"] == ("Component" if component else "Kustomization"), directory
    build = build if build is not None else _Build()
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            layer = _accumulate(path)
            build.objects += layer.objects
            build.generated |= layer.generated
        else:
            build.objects += [d for d in yaml.safe_load_all(path.read_text("utf-8")) if d]
    # kustomize's order within a layer: generators, then the components in the order listed
    # (each its own generators and patches), then patches, then labels.
    for generator in spec.get("configMapGenerator", []):
        _generate(directory, generator, build)
    for entry in spec.get("components", []):
        _accumulate((directory / entry).resolve(), build)
    for patch in spec.get("patches", []):
        _expect_fields(patch, {"path", "target"}, directory)
        patch_doc = yaml.safe_load((directory / patch["path"]).read_text("utf-8"))
        if "target" not in patch:
            name = patch_doc["metadata"]["name"]
            _merge(_find(build.objects, patch_doc["kind"], name), patch_doc)
            continue
        _expect_fields(patch["target"], {"kind"}, directory)
        for obj in [o for o in build.objects if o["kind"] == patch["target"]["kind"]]:
            if isinstance(patch_doc, list):
                _json_patch(obj, patch_doc)
            else:  # strategic merge: the target says which objects, the patch's name is ignored
                _merge(obj, {k: v for k, v in patch_doc.items() if k != "metadata"})
                _merge(
                    obj["metadata"], {k: v for k, v in patch_doc["metadata"].items() if k != "name"}
                )
    for labels in spec.get("labels", []):
        _expect_fields(labels, {"pairs", "includeTemplates"}, directory)
        for obj in build.objects:
            obj["metadata"].setdefault("labels", {}).update(labels["pairs"])
            template = obj.get("spec", {}).get("template")
            if labels.get("includeTemplates") and template is not None:
                template.setdefault("metadata", {}).setdefault("labels", {}).update(labels["pairs"])
    return build


def _generate(directory: Path, generator: Manifest, build: _Build) -> None:
    _expect_fields(generator, {"name", "behavior", "files"}, directory)
    name, behavior = generator["name"], generator.get("behavior", "create")
    data = {}
    for entry in generator["files"]:
        key, _, file = str(entry).rpartition("=")
        data[key or Path(file).name] = (directory / file).read_text("utf-8")
    if behavior == "create":
        assert name not in build.generated, f"{directory}: ConfigMap {name} generated twice"
        configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}
        build.objects.append({**configmap, "data": data})
        build.generated.add(name)
    elif behavior == "replace":
        assert name in build.generated, f"{directory}: no generated ConfigMap {name} to replace"
        _find(build.objects, "ConfigMap", name)["data"] = data
    else:
        raise NotImplementedError(f"{directory}: configMapGenerator behavior {behavior}")


def _merge(target: Manifest, patch: Manifest) -> None:
    for key, value in patch.items():
        if key.startswith("$"):
            raise NotImplementedError(f"strategic-merge directive {key}")
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        elif isinstance(value, list) and key in _MERGE_KEYS and isinstance(target.get(key), list):
            # kustomize's order: the patch's items (merged into their match), then the rest.
            by_key = {item[_MERGE_KEYS[key]]: item for item in target[key]}
            merged = []
            for item in value:
                base = by_key.pop(item[_MERGE_KEYS[key]], {})
                if item.get("$patch") == "delete":  # the one directive used: drop that item
                    assert set(item) == {_MERGE_KEYS[key], "$patch"}, item
                    continue
                _merge(base, item)
                merged.append(base)
            target[key] = merged + list(by_key.values())
        else:
            target[key] = copy.deepcopy(value)


def _json_patch(target: Manifest, operations: list[Manifest]) -> None:
    """RFC 6902, the one operation used: ``add`` (an object member set, or a list item inserted
    at an index or appended with ``-``); its parent must exist, as the RFC has it."""
    for operation in operations:
        _expect_fields(operation, {"op", "path", "value"}, Path(operation["path"]))
        assert operation["op"] == "add", operation
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in operation["path"][1:].split("/")
        ]
        node: Any = target
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        value = copy.deepcopy(operation["value"])
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), value)
        else:
            node[last] = value


def _find(objects: list[Manifest], kind: str, name: str) -> Manifest:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _load_one(path: Path) -> Manifest:
    doc = yaml.safe_load(path.read_text("utf-8"))
    assert isinstance(doc, dict), f"{path}: not a YAML mapping"
    return doc


def _expect_fields(mapping: Manifest, known: set[str], where: Path) -> None:
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise NotImplementedError(f"{where}: the test renderer does not handle {unknown}")


@functools.cache
def rendered(tree: str) -> tuple[Manifest, ...]:
    """Rendered once per run; tests only read the result."""
    return tuple(render(TREES[tree]))


# --- Accessors ----------------------------------------------------------------------------------


def _one(objects: tuple[Manifest, ...], kind: str) -> Manifest:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def _pod(objects: tuple[Manifest, ...]) -> Manifest:
    pod: Manifest = _one(objects, "Deployment")["spec"]["template"]
    return pod


def _container(objects: tuple[Manifest, ...], name: str) -> Manifest:
    (found,) = [c for c in _pod(objects)["spec"]["containers"] if c["name"] == name]
    container: Manifest = found
    return container


def _proxy_config(objects: tuple[Manifest, ...]) -> Manifest:
    config: Manifest = yaml.safe_load(_one(objects, "ConfigMap")["data"]["config.yaml"])
    return config


def _port_number(container: Manifest, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container.get("ports", []) if p["name"] == port]
    return int(number)


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# --- Rendering and schemas ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "suffix"),
    [
        # Expected values from `kubectl kustomize` (kustomize v5.5.0) of a one-file generator.
        ("max_n: 10\n", "744tcfc59h"),
        ("a<b>&c\n", "fg6gcgfg2h"),  # Go's JSON escapes <, > and &
    ],
)
def test_renderer_hash_suffix_matches_kustomize(text: str, suffix: str) -> None:
    configmap = {"metadata": {"name": "n-proxy-config"}, "data": {"config.yaml": text}}
    assert configmap_hash(configmap) == suffix


@pytest.mark.parametrize("tree", TREES)
def test_each_tree_renders_a_configmap_a_deployment_and_a_service(tree: str) -> None:
    objects = rendered(tree)
    assert sorted((o["kind"], o["metadata"]["name"][:14]) for o in objects) == [
        ("ConfigMap", "n-proxy-config"),
        ("Deployment", "n-proxy"),
        ("Service", "n-proxy"),
    ]
    for obj in objects:
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "n-proxy"


@pytest.mark.parametrize("tree", TREES)
def test_every_rendered_object_matches_the_pinned_kubernetes_schema(tree: str) -> None:
    for obj in rendered(tree):
        # strict: unknown fields (a misspelt key, a field of a newer release) are errors.
        assert kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True) == "1.32"


def test_schema_validation_rejects_a_misspelt_field() -> None:
    deployment = copy.deepcopy(_one(rendered("base"), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][1]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@functools.cache
def _real_kustomize() -> list[str] | None:
    """A kustomize v5 to compare against: standalone, or the one built into kubectl. Debian's
    kubectl 1.20 embeds kustomize v2, which predates `labels` and reports no version: skipped."""
    candidates = (
        ("kustomize", ["version"], "build"),
        ("kubectl", ["version", "--client"], "kustomize"),
    )
    for name, version, verb in candidates:
        path = shutil.which(name)
        if path is None:
            continue
        probe = subprocess.run([path, *version], capture_output=True, text=True, timeout=30)
        if re.search(r"(^|Kustomize Version: )v5\.", probe.stdout, re.MULTILINE):
            return [path, verb]
    return None


@pytest.mark.parametrize("tree", TREES)
def test_renderer_agrees_with_real_kustomize(tree: str) -> None:
    command = _real_kustomize()
    if command is None:
        pytest.skip("no kustomize v5 on PATH (standalone or in kubectl)")
    out = subprocess.run(
        [*command, str(TREES[tree])], capture_output=True, text=True, timeout=60, check=True
    ).stdout

    def key(o: Manifest) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(yaml.safe_load_all(out), key=key) == sorted(rendered(tree), key=key)


# --- Pod invariants -----------------------------------------------------------------------------


@pytest.mark.parametrize("tree", TREES)
def test_proxy_probes_hit_the_admin_port_of_the_rendered_config(tree: str) -> None:
    objects = rendered(tree)
    proxy, config = _container(objects, "n-proxy"), _proxy_config(objects)
    ready, live = proxy["readinessProbe"]["httpGet"], proxy["livenessProbe"]["httpGet"]
    assert (ready["path"], live["path"]) == ("/readyz", "/livez")
    assert _port_number(proxy, ready["port"]) == config["admin"]["port"] == 8081
    assert _port_number(proxy, live["port"]) == 8081
    assert _pod(objects)["metadata"]["annotations"]["prometheus.io/port"] == "8081"


@pytest.mark.parametrize("tree", TREES)
def test_proxy_listeners_bind_all_addresses_so_service_and_kubelet_reach_them(tree: str) -> None:
    config = _proxy_config(rendered(tree))
    assert config["listen"] == {"host": "0.0.0.0", "port": 8080}
    assert config["admin"] == {"host": "0.0.0.0", "port": 8081}


def _pre_stop(objects: tuple[Manifest, ...]) -> list[str]:
    command: list[str] = _container(objects, "inference")["lifecycle"]["preStop"]["exec"]["command"]
    return command


def _wait_bound(command: list[str]) -> int:
    """The seconds the inference server's preStop waits for the proxy at most."""
    (bound,) = re.findall(r"(?:\$\(date \+%s\)|time\.monotonic\(\)) \+ (\d+)", command[-1])
    return int(bound)


def _shutdown_timeout(objects: tuple[Manifest, ...]) -> int:
    args = _container(objects, "inference").get("args", [])
    return int(_flag(args, "--shutdown-timeout")) if "--shutdown-timeout" in args else 0


@pytest.mark.parametrize("tree", TREES)
def test_grace_period_holds_the_proxy_drain_then_the_server_shutdown(tree: str) -> None:
    objects = rendered(tree)
    config = _proxy_config(objects)
    drain = config.get("drain_seconds", 25)
    grace = _pod(objects)["spec"]["terminationGracePeriodSeconds"]
    command = _pre_stop(objects)
    # The server waits for the proxy itself (its admin port), not for a fixed time...
    assert f"http://127.0.0.1:{config['admin']['port']}/livez" in command[-1]
    # ...for longer than the proxy may drain, and the server's own drain fits after it.
    bound, shutdown = _wait_bound(command), _shutdown_timeout(objects)
    assert (drain, bound, shutdown, grace) == (25, 30, 10 if tree == "vllm" else 0, 45)
    assert drain < bound
    assert bound + shutdown < grace


def _runnable(command: list[str], admin_port: int, bound: int | None = None) -> list[str]:
    """The preStop command as this machine can run it: our Python, a loopback test port."""
    script = command[-1].replace("127.0.0.1:8081", f"127.0.0.1:{admin_port}")
    if bound is not None:
        script = re.sub(r"(\$\(date \+%s\)|time\.monotonic\(\)) \+ \d+", rf"\1 + {bound}", script)
    program = sys.executable if command[0] == "python3" else command[0]
    if shutil.which(program) is None or (command[0] == "sh" and shutil.which("curl") is None):
        pytest.skip(f"{command[0]} (and curl) needed to run the preStop command")
    return [program, *command[1:-1], script]


async def _pre_stop_beside_a_draining_proxy(
    command: list[str], make_backend: Any, tmp_path: Path
) -> None:
    """SIGTERM to a real proxy, ``command`` (a preStop, given the admin port) started with it:
    the preStop returns not before the proxy let go (it serves new connections for
    drain_grace_seconds, and its admin port until it exits), and within a poll of its exit: no
    fixed sleep."""
    backend = await make_backend()
    admin = free_port()
    path = tmp_path / "config.yaml"
    path.write_text(
        f"upstreams: [{{name: a, url: '{backend.url}'}}]\n"
        f"listen: {{port: 0}}\nadmin: {{port: {admin}}}\ndrain_grace_seconds: 1.5\n"
    )
    proxy = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "--config", str(path), stdout=subprocess.PIPE
    )
    pre_stop: asyncio.subprocess.Process | None = None
    try:
        assert proxy.stdout is not None
        assert "listening" in (await asyncio.wait_for(proxy.stdout.readline(), 20)).decode()
        signalled = time.monotonic()
        proxy.send_signal(signal.SIGTERM)
        pre_stop = await asyncio.create_subprocess_exec(*_runnable(command, admin))
        assert await asyncio.wait_for(proxy.wait(), 20) == 0
        exited = time.monotonic()
        assert await asyncio.wait_for(pre_stop.wait(), 10) == 0
        done = time.monotonic()
        assert done - signalled >= 1.5
        assert done - exited < 5
    finally:
        for process in (proxy, pre_stop):
            if process is not None and process.returncode is None:
                process.kill()
                await process.wait()


@pytest.mark.parametrize("tree", TREES)
async def test_server_pre_stop_returns_when_the_proxy_has_drained_and_exited(
    tree: str, make_backend: Any, tmp_path: Path
) -> None:
    """Both start at the pod's deletion: SIGTERM to the proxy, the preStop in the server."""
    await _pre_stop_beside_a_draining_proxy(_pre_stop(rendered(tree)), make_backend, tmp_path)


@pytest.mark.parametrize("tree", TREES)
async def test_server_pre_stop_gives_up_on_a_proxy_that_never_exits(tree: str) -> None:
    async def livez(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/livez", livez)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    admin = runner.addresses[0][1]
    try:
        started = time.monotonic()
        pre_stop = await asyncio.create_subprocess_exec(
            *_runnable(_pre_stop(rendered(tree)), admin, bound=2)
        )
        try:
            assert await asyncio.wait_for(pre_stop.wait(), 15) == 0
        finally:
            if pre_stop.returncode is None:
                pre_stop.kill()
                await pre_stop.wait()
        # 30 s unpatched. The sh version reads `date +%s`, whole seconds: a bound of 2 ends
        # between 1 and 2 s after it starts, never sooner. Slack above for a loaded machine.
        assert 1 <= time.monotonic() - started < 8
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("tree", TREES)
def test_service_sends_clients_to_the_proxy_port_and_names_the_metrics_port(tree: str) -> None:
    objects = rendered(tree)
    proxy, config = _container(objects, "n-proxy"), _proxy_config(objects)
    service = _one(objects, "Service")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert sorted(ports) == ["http", "metrics"]
    assert _port_number(proxy, ports["http"]["targetPort"]) == config["listen"]["port"] == 8080
    assert _port_number(proxy, ports["metrics"]["targetPort"]) == config["admin"]["port"]
    pod_labels = _pod(objects)["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert _one(objects, "Deployment")["spec"]["selector"]["matchLabels"].items() <= (
        pod_labels.items()
    )


@pytest.mark.parametrize("tree", TREES)
def test_proxy_runs_as_the_image_user_without_root_or_a_writable_root(tree: str) -> None:
    objects = rendered(tree)
    assert _container(objects, "n-proxy")["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert _dockerfile_directive(-1, "USER") == "10001:10001"
    inference = _container(objects, "inference")["securityContext"]
    assert inference == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert _pod(objects)["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("tree", TREES)
def test_proxy_reads_the_generated_configmap_where_it_is_mounted(tree: str) -> None:
    objects = rendered(tree)
    proxy, pod = _container(objects, "n-proxy"), _pod(objects)
    configmap = _one(objects, "ConfigMap")["metadata"]["name"]
    assert re.fullmatch(r"n-proxy-config-[a-z0-9]{10}", configmap)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["config"]["configMap"] == {"name": configmap}
    mounts = {m["name"]: m for m in proxy["volumeMounts"]}
    assert mounts["config"] == {"name": "config", "mountPath": "/etc/n-proxy", "readOnly": True}
    assert proxy["args"] == ["--config", "/etc/n-proxy/config.yaml"]
    assert json.loads(_dockerfile_directive(-1, "CMD")) == proxy["args"]


@pytest.mark.parametrize("tree", OVERLAYS)
def test_overlays_leave_the_proxy_container_as_the_base_has_it(tree: str) -> None:
    assert _container(rendered(tree), "n-proxy") == _container(rendered("base"), "n-proxy")


@pytest.mark.parametrize("tree", OVERLAYS)
def test_inference_server_listens_on_loopback_where_the_config_points(tree: str) -> None:
    objects = rendered(tree)
    inference = _container(objects, "inference")
    assert "ports" not in inference
    host, port = _flag(inference["args"], "--host"), _flag(inference["args"], "--port")
    assert (host, port) == ("127.0.0.1", "8000")
    (upstream,) = _proxy_config(objects)["upstreams"]
    assert upstream["urls"] == ["http://127.0.0.1:8000"]
    assert _proxy_config(objects)["default_upstream"] == upstream["name"] == tree
    # A loopback server is out of the kubelet's reach: its probes must run inside the container.
    for probe in ("startupProbe", "livenessProbe"):
        assert "http://127.0.0.1:8000/health" in " ".join(inference[probe]["exec"]["command"])


def test_vllm_overlay_serves_a_model_on_one_gpu() -> None:
    objects = rendered("vllm")
    inference = _container(objects, "inference")
    assert inference["image"] == "vllm/vllm-openai:v0.32.0"  # has --shutdown-timeout
    assert inference["command"] == ["vllm", "serve"]
    assert inference["args"][0] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert inference["resources"]["limits"]["nvidia.com/gpu"] == 1
    mounts = {m["name"]: m["mountPath"] for m in inference["volumeMounts"]}
    assert mounts == {"cache": "/root/.cache", "dshm": "/dev/shm"}


def test_vllm_overlay_runs_the_rust_frontend_and_the_sidecar_fans_out() -> None:
    """The server n-proxy is for: vLLM's Rust frontend refuses n > 1, so the upstream is not
    native_n and both OpenAI paths fan out."""
    objects = rendered("vllm")
    inference = _container(objects, "inference")
    env = {e["name"]: e.get("value") for e in inference["env"]}
    assert env["VLLM_USE_RUST_FRONTEND"] == "1"
    assert env["VLLM_RUST_FRONTEND_PATH"] == "auto"
    assert inference["command"] == ["vllm", "serve"]  # only `serve` honours the variable
    # Flags the Rust frontend refuses to start with.
    assert not {"--enable-force-include-usage", "--enable-per-request-metrics"} & set(
        inference["args"]
    )
    config = _proxy_config(objects)
    (upstream,) = config["upstreams"]
    assert upstream["native_n"] is False
    assert config["fanout_paths"] == [
        "/v1/chat/completions",
        "/v1/completions",
        "/inference/v1/generate",
    ]


def test_vllm_overlay_shows_a_python_frontend_as_a_valid_native_n_upstream() -> None:
    from proxy.config.models import Upstream

    text = (TREES["vllm"] / "config.yaml").read_text("utf-8")
    start = text.index("  # - name: vllm-python")
    lines = []
    for line in text[start:].splitlines():
        if not line.startswith("  # "):
            break
        lines.append(line.removeprefix("  # "))
    (example,) = yaml.safe_load("\n".join(lines))
    upstream = Upstream.model_validate(example)
    assert upstream.native_n is True
    assert upstream.urls == ("http://127.0.0.1:8001",)


def test_llamacpp_overlay_serves_the_gguf_from_a_read_only_model_volume() -> None:
    objects = rendered("llamacpp")
    inference = _container(objects, "inference")
    assert inference["image"] == "ghcr.io/ggml-org/llama.cpp:server"
    assert inference["args"] == [
        "-m",
        "/models/model.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "-np",
        "4",
    ]
    assert "command" not in inference  # the image's entrypoint is llama-server
    assert inference["volumeMounts"] == [
        {"name": "models", "mountPath": "/models", "readOnly": True}
    ]
    volumes = {v["name"]: v for v in _pod(objects)["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {
        "claimName": "n-proxy-models",
        "readOnly": True,
    }


@pytest.mark.parametrize("tree", TREES)
def test_rendered_config_loads_with_the_proxy_loader(tree: str, tmp_path: Path) -> None:
    from proxy.config.models import load_config

    text = _one(rendered(tree), "ConfigMap")["data"]["config.yaml"]
    assert "${" not in text  # the pod sets no environment for the proxy to expand
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    config = load_config(path)
    assert (config.listen.port, config.drain_seconds) == (8080, 25.0)
    assert config.admin is not None
    assert config.admin.port == 8081
    assert [u.urls for u in config.upstreams] == [("http://127.0.0.1:8000",)]


# --- Dockerfile ---------------------------------------------------------------------------------


def _dockerfile_stages() -> list[list[tuple[str, str]]]:
    """Instructions (keyword, arguments) per stage; stage 0 holds what precedes the first FROM."""
    stages: list[list[tuple[str, str]]] = [[]]
    logical = ""
    for line in (DEPLOY / "Dockerfile").read_text("utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        keyword, _, arguments = (logical + stripped).partition(" ")
        logical = ""
        if keyword.upper() == "FROM":
            stages.append([])
        stages[-1].append((keyword.upper(), arguments.strip()))
    return stages


def _dockerfile_directive(stage: int, keyword: str) -> str:
    (arguments,) = [a for k, a in _dockerfile_stages()[stage] if k == keyword]
    return arguments


def test_dockerfile_builds_wheels_then_installs_them_with_the_fast_and_otel_extras() -> None:
    preamble, build, runtime = _dockerfile_stages()
    assert preamble == [("ARG", "PYTHON_IMAGE=python:3.12-slim-trixie")]
    assert build[0] == ("FROM", "${PYTHON_IMAGE} AS build")
    assert runtime[0] == ("FROM", "${PYTHON_IMAGE} AS runtime")
    wheel = 'pip wheel --wheel-dir /wheels --constraint constraints.txt ".[fast,otel]"'
    assert wheel in _dockerfile_directive(1, "RUN")
    install = _dockerfile_directive(2, "RUN")
    assert "--mount=type=bind,from=build,source=/wheels" in install
    assert 'pip install --no-index --find-links /wheels "n-proxy[fast,otel]"' in install
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    assert project["name"] == "n-proxy"
    assert {"fast", "otel"} <= set(project["optional-dependencies"])


@pytest.mark.parametrize(
    "manifest",
    [DEPLOY / "kubernetes" / "base" / "deployment.yaml", COMPONENT_DIR / "sidecar.yaml"],
    ids=["base", "sidecar"],
)
def test_manifests_show_the_otel_environment_commented_out(manifest: Path) -> None:
    """Tracing is one uncommenting away (the image has the otel extra), and off as shipped."""
    text = manifest.read_text("utf-8")
    commented = [line.strip() for line in text.splitlines() if line.strip().startswith("#")]
    assert "# env:" in commented
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER"):
        assert any(f"{{name: {name}," in line for line in commented), name
    for doc in yaml.safe_load_all(text):
        containers = doc["spec"]["template"]["spec"]["containers"]
        assert all("env" not in c for c in containers if c["name"] == "n-proxy")


def test_final_image_has_no_build_tools_and_a_numeric_non_root_user() -> None:
    runtime = _dockerfile_stages()[-1]
    commands = " ".join(a for k, a in runtime if k == "RUN")
    for tool in ("apt-get", "gcc", "build-essential", "pip wheel"):
        assert tool not in commands
    assert not [a for k, a in runtime if k in {"COPY", "ADD"}]  # only the bind-mounted wheels
    user = _dockerfile_directive(-1, "USER")
    assert re.fullmatch(r"[1-9][0-9]*:[0-9]+", user)


def test_image_exposes_the_config_ports_and_runs_the_console_script() -> None:
    config = _proxy_config(rendered("base"))
    assert _dockerfile_directive(-1, "EXPOSE").split() == [
        str(config["listen"]["port"]),
        str(config["admin"]["port"]),
    ]
    assert json.loads(_dockerfile_directive(-1, "ENTRYPOINT")) == ["n-proxy"]
    assert json.loads(_dockerfile_directive(-1, "CMD")) == ["--config", "/etc/n-proxy/config.yaml"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]["scripts"]
    assert scripts["n-proxy"] == "proxy.cli:main"


def test_build_context_holds_and_lets_in_every_copied_path() -> None:
    allowed = (DEPLOY / "Dockerfile.dockerignore").read_text("utf-8").splitlines()
    copied = [a.split()[:-1] for k, a in _dockerfile_stages()[1] if k == "COPY"]
    sources = [s for group in copied for s in group]
    assert sources == [
        "pyproject.toml", "setup.py", "README.md", "LICENSE", "deploy/constraints.txt", "proxy"
    ]  # fmt: skip
    for source in sources:
        assert (ROOT / source).exists(), f"{source} is missing from the repository"
        assert f"!{source}" in allowed


IMAGE_EXTRAS = ("fast", "otel")  # what the Dockerfile installs beside the runtime dependencies

# The image's Python: markers in the pinned packages' requirements are evaluated for it.
_IMAGE_ENVIRONMENT = {
    "python_version": "3.12",
    "python_full_version": "3.12.1",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (DEPLOY / "constraints.txt").read_text("utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _applies(requirement: Requirement) -> bool:
    marker = requirement.marker
    return marker is None or marker.evaluate(_IMAGE_ENVIRONMENT)


def test_constraints_pin_every_runtime_dependency_within_the_declared_ranges() -> None:
    pins = _pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    direct = [Requirement(r) for r in project["dependencies"]]
    for extra in IMAGE_EXTRAS:
        direct += [Requirement(r) for r in project["optional-dependencies"][extra]]
    for requirement in filter(_applies, direct):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not pinned"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]}: {requirement}"
    assert "n-proxy" not in pins  # the project itself is built from the context


def test_constraints_are_closed_under_the_pinned_packages_requirements() -> None:
    """What pip freeze wrote: every package that a pinned one needs is pinned, and nothing else.
    Read from the installed metadata, which must be of the pinned versions to say anything."""
    pins = _pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    extras = [r for extra in IMAGE_EXTRAS for r in project["optional-dependencies"][extra]]
    todo = [Requirement(r) for r in project["dependencies"] + extras]
    reached: set[str] = set()
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if not _applies(requirement) or name in reached:
            continue
        assert name in pins, f"{name} ({requirement}) is needed but not pinned"
        assert requirement.specifier.contains(pins[name], prereleases=True), requirement
        reached.add(name)
        try:
            installed = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{name} is not installed here: its requirements are unknown")
        if Version(installed.version) != pins[name]:
            pytest.skip(f"{name} {installed.version} is installed here, {pins[name]} is pinned")
        todo += [Requirement(r) for r in installed.requires or []]
    assert reached == set(pins)


def test_base_image_is_pinned_by_digest_or_the_dockerfile_says_how() -> None:
    """Never a made-up digest: either the default names a real-looking sha256 digest, or the
    Dockerfile explains that none was looked up and how to pass one as a build argument."""
    (preamble,) = _dockerfile_stages()[0]
    reference = preamble[1].removeprefix("PYTHON_IMAGE=")
    text = (DEPLOY / "Dockerfile").read_text("utf-8")
    if "@" in reference:
        assert re.fullmatch(r"[\w.:/-]+@sha256:[0-9a-f]{64}", reference)
    else:
        assert "--build-arg PYTHON_IMAGE=" + reference + "@sha256:<that digest>" in text
        assert "could not be looked up" in text
        assert "imagetools inspect " + reference in text


# --- The gateway overlay: n-proxy as its own Deployment in front of a fleet (failover) --------

GATEWAY = DEPLOY / "kubernetes" / "overlays" / "gateway"


@functools.cache
def rendered_gateway() -> tuple[Manifest, ...]:
    return tuple(render(GATEWAY))


def _named(kind: str, name: str) -> Manifest:
    (found,) = [
        o for o in rendered_gateway() if o["kind"] == kind and o["metadata"]["name"] == name
    ]
    return found


def _pod_labels(name: str) -> dict[str, str]:
    labels: dict[str, str] = _named("Deployment", name)["spec"]["template"]["metadata"]["labels"]
    return labels


def _gateway_config() -> Manifest:
    config: Manifest = yaml.safe_load(_one(rendered_gateway(), "ConfigMap")["data"]["config.yaml"])
    return config


def test_gateway_renders_the_proxy_its_autoscaler_the_budgets_and_the_fleet() -> None:
    objects = rendered_gateway()
    assert sorted((o["kind"], o["metadata"]["name"][:14]) for o in objects) == [
        ("ConfigMap", "n-proxy-config"),
        ("Deployment", "inference"),
        ("Deployment", "n-proxy"),
        ("HorizontalPodAutoscaler", "n-proxy"),
        ("NetworkPolicy", "inference"),
        ("PodDisruptionBudget", "inference"),
        ("PodDisruptionBudget", "n-proxy"),
        ("Service", "inference"),
        ("Service", "n-proxy"),
    ]
    for obj in objects:
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "n-proxy"
        # strict: unknown fields (a misspelt key, a field of a newer release) are errors.
        assert kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True) == "1.32"


def test_gateway_renderer_agrees_with_real_kustomize() -> None:
    command = _real_kustomize()
    if command is None:
        pytest.skip("no kustomize v5 on PATH (standalone or in kubectl)")
    out = subprocess.run(
        [*command, str(GATEWAY)], capture_output=True, text=True, timeout=60, check=True
    ).stdout

    def key(o: Manifest) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(yaml.safe_load_all(out), key=key) == sorted(rendered_gateway(), key=key)


def test_gateway_pod_is_the_base_proxy_alone_sized_for_a_gateway() -> None:
    pod = copy.deepcopy(_named("Deployment", "n-proxy")["spec"]["template"])
    (proxy,) = pod["spec"]["containers"]
    base = copy.deepcopy(_container(rendered("base"), "n-proxy"))
    assert proxy.pop("resources") == {
        "requests": {"cpu": "1", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }
    base.pop("resources")
    assert proxy.pop("args") == [*base.pop("args"), "--workers", "auto"]
    assert proxy == base  # probes, ports, user, config mount: as every other tree has them
    assert "replicas" not in _named("Deployment", "n-proxy")["spec"]  # the autoscaler's call


def test_gateway_config_discovers_every_ready_pod_of_the_headless_service(tmp_path: Path) -> None:
    import jsonschema

    from proxy.config.models import Placement, config_schema, load_config

    path = tmp_path / "config.yaml"
    path.write_text(_one(rendered_gateway(), "ConfigMap")["data"]["config.yaml"], "utf-8")
    jsonschema.Draft202012Validator(config_schema()).validate(_gateway_config())
    config = load_config(path)
    (upstream,) = config.upstreams
    assert upstream.discovery.dns
    assert upstream.placement == Placement(choose="round_robin", pack=1)  # spread
    assert "connect" in upstream.retry_on
    service = _named("Service", "inference")
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS answers with each pod's IP
    assert not service["spec"].get("publishNotReadyAddresses", False)
    (url,) = upstream.urls
    (port,) = service["spec"]["ports"]
    assert url == f"http://{service['metadata']['name']}:{port['port']}"
    # The proxies connect to pod IPs, so the port they use is the container's own.
    (server,) = _named("Deployment", "inference")["spec"]["template"]["spec"]["containers"]
    assert _port_number(server, port["targetPort"]) == port["port"]
    assert _flag(server["args"], "--host") == "0.0.0.0"
    assert server["readinessProbe"]["httpGet"]["path"] == upstream.health_path
    assert (config.listen.port, config.admin.port if config.admin else None) == (8080, 8081)


def test_gateway_services_and_budgets_each_select_their_own_fleet() -> None:
    proxies, servers = _pod_labels("n-proxy"), _pod_labels("inference")
    for name, pods, other in (("n-proxy", proxies, servers), ("inference", servers, proxies)):
        selector = _named("Service", name)["spec"]["selector"]
        assert selector.items() <= pods.items()
        assert not selector.items() <= other.items()
        budget = _named("PodDisruptionBudget", name)["spec"]
        assert budget["selector"]["matchLabels"] == selector
        assert budget["maxUnavailable"] == 1


def test_gateway_autoscaler_scales_the_proxy_on_the_cpu_it_requests() -> None:
    hpa = _named("HorizontalPodAutoscaler", "n-proxy")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "n-proxy",
    }
    (metric,) = hpa["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    assert hpa["minReplicas"] >= 2  # with maxUnavailable 1, a drain never leaves zero proxies
    (proxy,) = _named("Deployment", "n-proxy")["spec"]["template"]["spec"]["containers"]
    assert "cpu" in proxy["resources"]["requests"]  # utilization is a share of the request


def test_gateway_pods_outlast_the_proxies_next_lookup_and_their_children() -> None:
    config = _gateway_config()
    (upstream,) = config["upstreams"]
    spec = _named("Deployment", "inference")["spec"]["template"]["spec"]
    (server,) = spec["containers"]
    assert server["image"] == "vllm/vllm-openai:v0.32.0"  # has --shutdown-timeout
    command = server["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    sleep, shutdown = int(command[1]), int(_flag(server["args"], "--shutdown-timeout"))
    # New children stop coming (the proxies' next lookup) before SIGTERM; then vLLM lets the
    # running ones finish, and all of it ends before SIGKILL.
    assert upstream["discovery"]["interval"] < sleep
    assert (sleep, shutdown, spec["terminationGracePeriodSeconds"]) == (15, 40, 60)
    assert sleep + shutdown < spec["terminationGracePeriodSeconds"]
    # vLLM refuses new requests while it drains: a child refused that way goes to another pod.
    assert {"connect", "reset", 503} <= set(upstream["retry_on"])
    proxy_pod = _named("Deployment", "n-proxy")["spec"]["template"]["spec"]
    assert config["drain_seconds"] < proxy_pod["terminationGracePeriodSeconds"]


def test_gateway_inference_pods_take_traffic_from_the_proxies_only() -> None:
    policy = _named("NetworkPolicy", "inference")["spec"]
    servers, proxies = _pod_labels("inference"), _pod_labels("n-proxy")
    assert policy["podSelector"]["matchLabels"].items() <= servers.items()
    assert not policy["podSelector"]["matchLabels"].items() <= proxies.items()
    assert policy["policyTypes"] == ["Ingress"]  # egress (model downloads) stays open
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert set(source) == {"podSelector"}  # no namespaceSelector or ipBlock: this namespace only
    assert source["podSelector"]["matchLabels"].items() <= proxies.items()
    assert not source["podSelector"]["matchLabels"].items() <= servers.items()
    (port,) = rule["ports"]
    (server,) = _named("Deployment", "inference")["spec"]["template"]["spec"]["containers"]
    assert _port_number(server, port["port"]) == 8000
    assert port["protocol"] == "TCP"


def _bytes(quantity: str) -> int:
    found = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert found, quantity
    return int(found[1]) << (20 if found[2] == "Mi" else 30)


def test_gateway_workers_auto_fits_the_memory_limit(tmp_path: Path) -> None:
    from proxy.server.workers import auto_workers

    (proxy,) = _named("Deployment", "n-proxy")["spec"]["template"]["spec"]["containers"]
    assert _flag(proxy["args"], "--workers") == "auto"
    assert "cpu" not in proxy["resources"]["limits"]  # so the CPU count alone is the node's
    (tmp_path / "memory.max").write_text(f"{_bytes(proxy['resources']['limits']['memory'])}\n")
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert auto_workers(tmp_path) == min(3, len(os.sched_getaffinity(0)))


# --- The sidecar Component, on a Deployment that is not the project's -------------------------

COMPONENT = COMPONENT_DIR
FOREIGN = ROOT / "tests" / "meta" / "fixtures" / "sidecar"  # a text-generation server on :3000


@functools.cache
def rendered_sidecar() -> tuple[Manifest, ...]:
    return tuple(render(FOREIGN))


def _foreign(kind: str) -> Manifest:
    return _one(rendered_sidecar(), kind)


def _sidecar_containers() -> dict[str, Manifest]:
    containers = _foreign("Deployment")["spec"]["template"]["spec"]["containers"]
    return {c["name"]: c for c in containers}


def test_sidecar_component_renders_onto_a_foreign_deployment_and_validates() -> None:
    objects = rendered_sidecar()
    assert sorted((o["kind"], o["metadata"]["name"][:14]) for o in objects) == [
        ("ConfigMap", "n-proxy-config"),
        ("Deployment", "textgen"),
        ("Service", "textgen"),
    ]
    for obj in objects:
        # strict: unknown fields (a misspelt key, a field of a newer release) are errors.
        assert kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True) == "1.32"
    # The server is kept as it was, and stays the first container (its preStop is patched by
    # index); the proxy comes beside it.
    original = _load_one(FOREIGN / "deployment.yaml")
    (server,) = original["spec"]["template"]["spec"]["containers"]
    patched = _sidecar_containers()
    assert sorted(patched) == ["n-proxy", "server"]
    assert {k: v for k, v in patched["server"].items() if k != "lifecycle"} == server
    assert _foreign("Deployment")["spec"]["replicas"] == 2


def test_sidecar_renderer_agrees_with_real_kustomize() -> None:
    command = _real_kustomize()
    if command is None:
        pytest.skip("no kustomize v5 on PATH (standalone or in kubectl)")
    out = subprocess.run(
        [*command, str(FOREIGN)], capture_output=True, text=True, timeout=60, check=True
    ).stdout

    def key(o: Manifest) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(yaml.safe_load_all(out), key=key) == sorted(rendered_sidecar(), key=key)


def test_sidecar_proxy_is_the_overlays_proxy_on_its_own_port_names() -> None:
    proxy = copy.deepcopy(_sidecar_containers()["n-proxy"])
    base = copy.deepcopy(_container(rendered("base"), "n-proxy"))
    # Port names unique within any pod (the server may well have an "http" of its own).
    assert [(p["name"], p["containerPort"]) for p in proxy.pop("ports")] == [
        ("nproxy-http", 8080),
        ("nproxy-admin", 8081),
    ]
    base.pop("ports")
    for probe in ("readinessProbe", "livenessProbe"):
        assert proxy[probe]["httpGet"]["port"] == "nproxy-admin"
        base[probe]["httpGet"]["port"] = "nproxy-admin"
    assert [m["name"] for m in proxy["volumeMounts"]] == ["n-proxy-config", "n-proxy-tmp"]
    for mount, name in zip(base["volumeMounts"], ("n-proxy-config", "n-proxy-tmp"), strict=True):
        mount["name"] = name
    assert proxy == base  # image, args, probes, resources, user, mounts: as the overlays have them


def test_sidecar_config_points_at_the_servers_port_and_loads(tmp_path: Path) -> None:
    from proxy.config.models import load_config

    configmap = _foreign("ConfigMap")
    volumes = {v["name"]: v for v in _foreign("Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["n-proxy-config"]["configMap"] == {"name": configmap["metadata"]["name"]}
    assert re.fullmatch(r"n-proxy-config-[a-z0-9]{10}", configmap["metadata"]["name"])
    path = tmp_path / "config.yaml"
    path.write_text(configmap["data"]["config.yaml"], "utf-8")
    config = load_config(path)
    (upstream,) = config.upstreams
    server = _sidecar_containers()["server"]
    assert upstream.urls == (f"http://127.0.0.1:{_flag(server['args'], '--port')}",)
    assert upstream.readiness == "required"  # a dead server takes the pod out of the Service
    proxy = _sidecar_containers()["n-proxy"]
    assert _port_number(proxy, "nproxy-http") == config.listen.port
    assert config.admin is not None
    assert _port_number(proxy, "nproxy-admin") == config.admin.port
    # The Component's own default loads too: a vLLM on its default port.
    default = yaml.safe_load((COMPONENT / "config.yaml").read_text("utf-8"))
    assert default["upstreams"][0]["urls"] == ["http://127.0.0.1:8000"]
    load_config(COMPONENT / "config.yaml")


def test_sidecar_service_sends_its_clients_to_the_proxy() -> None:
    (port,) = _foreign("Service")["spec"]["ports"]
    assert port == {"port": 80, "targetPort": "nproxy-http"}  # same port for clients
    assert _port_number(_sidecar_containers()["n-proxy"], port["targetPort"]) == 8080


def _sidecar_pre_stop() -> list[str]:
    command: list[str] = _sidecar_containers()["server"]["lifecycle"]["preStop"]["exec"]["command"]
    return command


def test_sidecar_grace_period_holds_the_proxy_drain_then_the_server() -> None:
    config = yaml.safe_load(_foreign("ConfigMap")["data"]["config.yaml"])
    command = _sidecar_pre_stop()
    assert command[:2] == ["sh", "-c"]
    assert "http://127.0.0.1:8081/livez" in command[-1]
    grace = _foreign("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert (config["drain_seconds"], _wait_bound(command), grace) == (25, 30, 45)


async def test_sidecar_pre_stop_returns_when_the_proxy_has_drained_and_exited(
    make_backend: Any, tmp_path: Path
) -> None:
    """As the overlays' test: SIGTERM to a real proxy, the server's preStop started with it."""
    await _pre_stop_beside_a_draining_proxy(_sidecar_pre_stop(), make_backend, tmp_path)


async def test_sidecar_pre_stop_without_curl_wget_or_python_waits_its_bound(
    tmp_path: Path,
) -> None:
    """A server image with none of the probes: the wait is the bound, never none at all."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("sh", "date", "sleep"):
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} is needed to run the preStop command")
        (tools / tool).symlink_to(found)
    command = _runnable(_sidecar_pre_stop(), free_port(), bound=2)
    started = time.monotonic()
    pre_stop = await asyncio.create_subprocess_exec(*command, env={"PATH": str(tools)})
    try:
        assert await asyncio.wait_for(pre_stop.wait(), 15) == 0
    finally:
        if pre_stop.returncode is None:
            pre_stop.kill()
            await pre_stop.wait()
    # Nothing listens on that admin port: with a probe it would return at once.
    assert 1 <= time.monotonic() - started < 8


def _server_side_merge(target: Manifest, patch: Manifest) -> None:
    """The API server's strategic merge (``kubectl patch``): a list item the object lacks is
    appended, where kustomize puts it first."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _server_side_merge(target[key], value)
        elif isinstance(value, list) and key in _MERGE_KEYS and isinstance(target.get(key), list):
            by_key = {item[_MERGE_KEYS[key]]: item for item in target[key]}
            for item in value:
                if item[_MERGE_KEYS[key]] in by_key:
                    _server_side_merge(by_key[item[_MERGE_KEYS[key]]], item)
                else:
                    target[key].append(copy.deepcopy(item))
        else:
            target[key] = copy.deepcopy(value)


def test_sidecar_patches_work_with_plain_kubectl_patch() -> None:
    """What docs/operating.md has an operator run without kustomize: the strategic-merge patch
    with the Deployment's name put in, then the JSON patches; the result validates and matches
    the Component's, but for the container order and the ConfigMap's hash suffix."""
    deployment = _load_one(FOREIGN / "deployment.yaml")
    service = _load_one(FOREIGN / "service.yaml")
    text = (COMPONENT / "sidecar.yaml").read_text("utf-8")
    assert text.count("YOUR-DEPLOYMENT") == 2  # the name in the patch, and the usage comment
    sidecar = yaml.safe_load(text.replace("YOUR-DEPLOYMENT", "textgen"))
    _server_side_merge(deployment, sidecar)
    _json_patch(deployment, yaml.safe_load((COMPONENT / "server-prestop.yaml").read_text()))
    _json_patch(service, yaml.safe_load((COMPONENT / "service.yaml").read_text()))
    assert deployment["metadata"]["name"] == "textgen"  # never renamed: the server would refuse
    for obj in (deployment, service):
        assert kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True) == "1.32"
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["server", "n-proxy"]
    assert containers[0]["lifecycle"] == _sidecar_containers()["server"]["lifecycle"]
    assert containers[1] == _sidecar_containers()["n-proxy"]
    assert service == _foreign("Service")
    (volume, _) = deployment["spec"]["template"]["spec"]["volumes"]
    assert volume == {"name": "n-proxy-config", "configMap": {"name": "n-proxy-config"}}


# --- The ServiceMonitor next to the PrometheusRule -----------------------------------------------

# The ServiceMonitor fields used (Prometheus Operator's monitoring.coreos.com/v1 CRD); anything
# else fails, as a misspelt key would be dropped by the operator without a word.
_SERVICE_MONITOR_FIELDS = {
    "": {"apiVersion", "kind", "metadata", "spec"},
    "metadata": {"name", "labels"},
    "spec": {"selector", "endpoints"},
    "endpoint": {"port", "path", "interval", "scrapeTimeout"},
}


def _service_monitor() -> Manifest:
    return _load_one(DEPLOY / "observability" / "servicemonitor.yaml")


def test_service_monitor_uses_only_the_fields_of_its_crd() -> None:
    monitor = _service_monitor()
    assert (monitor["apiVersion"], monitor["kind"]) == (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
    )
    assert set(monitor) <= _SERVICE_MONITOR_FIELDS[""]
    assert set(monitor["metadata"]) <= _SERVICE_MONITOR_FIELDS["metadata"]
    assert set(monitor["spec"]) <= _SERVICE_MONITOR_FIELDS["spec"]
    assert set(monitor["spec"]["selector"]) == {"matchLabels"}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= _SERVICE_MONITOR_FIELDS["endpoint"]
        interval, timeout = (
            int(endpoint[k].removesuffix("s")) for k in ("interval", "scrapeTimeout")
        )
        assert timeout <= interval  # the operator rejects a timeout past the interval
    rule = yaml.safe_load((DEPLOY / "observability" / "alerts.yaml").read_text("utf-8"))
    assert monitor["metadata"]["labels"] == rule["metadata"]["labels"]  # one rule selector for both


@pytest.mark.parametrize("tree", [*TREES, "gateway"])
def test_service_monitor_scrapes_the_proxy_admin_port_and_nothing_else(tree: str) -> None:
    objects = rendered_gateway() if tree == "gateway" else rendered(tree)
    monitor = _service_monitor()["spec"]
    selector = monitor["selector"]["matchLabels"]
    selected = [
        o
        for o in objects
        if o["kind"] == "Service" and selector.items() <= o["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in selected] == ["n-proxy"]  # never the inference fleet
    (endpoint,) = monitor["endpoints"]
    ports = {p["name"]: p for p in selected[0]["spec"]["ports"]}
    deployment = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "n-proxy"
    ]
    (proxy,) = [
        c for c in deployment[0]["spec"]["template"]["spec"]["containers"] if c["name"] == "n-proxy"
    ]
    config = yaml.safe_load(_one(objects, "ConfigMap")["data"]["config.yaml"])
    assert _port_number(proxy, ports[endpoint["port"]]["targetPort"]) == config["admin"]["port"]
    assert endpoint["path"] == "/metrics"
