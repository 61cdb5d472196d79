"""How each contender is started on loopback: demo backends, n-proxy, nginx, LiteLLM's proxy,
SGLang's two Rust gateways (sglang-router and smg), and the canned upstream of the wire scenario.
Run as a script, this is the demo backend on uvloop (a faster backend is a harder baseline):
``python -m bench.stack --port P [devserver options]``."""

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from bench.pacer import BODY, HEALTH_PATH, MODELS, MODELS_PATH, paced_argv
from bench.procs import Fleet, Server, free_port
from bench.workload import BENCH_KEY, CHAT_PATH, MODEL, on_uvloop

# Admission control is a deployment choice, not a cost: lift it so only the proxy's work shows.
PROXY_CONFIG = """\
upstreams:
  - name: demo
    url: {url}
    max_concurrency: 100000
    max_queue: 0
drain_seconds: 1
"""

_NGINX_TEMP = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
# One worker, as n-proxy has one by default, and one server: a reverse proxy (HTTP/1.1 upstream
# connections kept alive, responses not buffered) or the canned upstream (``_CANNED``).
_NGINX = """\
worker_processes 1;
user root root;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    keepalive_requests {keepalive_requests};
{temp_paths}
    upstream backend {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
{locations}    }}
}}
"""
_PROXY = """\
        location / {
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }
"""
# `return` answers at once (and discards the request body, so keep-alive holds); default_type
# sets the Content-Type of a `return` text. Its keepalive_requests are lifted from nginx's 1,000:
# the proxies in front keep their upstream connections for the whole run.
_CANNED = """\
        location = {health} {{
            default_type text/plain;
            return 200 "ok\\n";
        }}
        location = {models_path} {{
            default_type application/json;
            return 200 '{models}';
        }}
        location = {path} {{
            default_type application/json;
            if ($request_method != POST) {{
                return 405;
            }}
            return 200 '{body}';
        }}
        location / {{
            return 404;
        }}
"""

_LITELLM_CONFIG = """\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {url}/v1
      api_key: bench-not-a-secret
general_settings:
  master_key: {key}
litellm_settings:
  telemetry: false
  drop_params: true
  request_timeout: 60
"""

# Keep LiteLLM off the network: the cost map ships with the package, no usage is reported.
LITELLM_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
               "LITELLM_LOG": "ERROR", "NO_PROXY": "127.0.0.1,localhost"}  # fmt: skip


def start_backend(
    fleet: Fleet, *, native_n: bool = False, name: str = "backend", token_delay: float = 0.0
) -> Server:
    """The demo backend on uvloop (this module as a script)."""
    argv = [sys.executable, "-m", "bench.stack", "--token-delay", str(token_delay)]
    return fleet.launch(name, argv + ["--native-n"] * native_n)


def start_proxy(
    fleet: Fleet, work: Path, upstream: str, name: str = "n-proxy", *, workers: int = 1,
    checkout: Path | None = None, config: str = PROXY_CONFIG, env: Mapping[str, str] | None = None,
) -> Server:  # fmt: skip
    """``workers`` > 1 uses the proxy's ``--workers``.

    ``config``: YAML in which ``{url}`` stands for ``upstream``. ``checkout``: another tree of
    n-proxy (a baseline, with its own ``.venv``), run beside this one so that before and after
    are measured in the same run. ``OTEL_*`` from the bench's environment is cleared (tracing
    is asked for with ``env``), so both trees run alike unless told otherwise.
    """
    path = work / f"{name}.yaml"
    path.write_text(config.replace("{url}", upstream))
    python = str(checkout / ".venv" / "bin" / "python") if checkout else sys.executable
    argv = [python, "-m", "proxy", "--config", str(path), "--host", "127.0.0.1"]
    argv += ["--workers", str(workers)] if workers > 1 else []
    clean = {k: "" for k in os.environ if k.startswith("OTEL_")}
    env = {**clean, **(env or {})}
    return fleet.launch(name, argv, env=env, cwd=checkout, tree=workers > 1)


FORWARDERS = {"": "aiohttp forwarder", "lean": "lean forwarder", "floor": "httptools floor"}


def start_forwarder(fleet: Fleet, upstream: Server, kind: str = "") -> Server:
    """The 20-line aiohttp forwarder (``bench/forwarder.py``), plain aiohttp; ``kind`` "lean":
    the same forwarder on n-proxy's own upstream client (``--lean``); "floor": that client behind
    a bare httptools protocol (``--floor``)."""
    argv = [sys.executable, "-m", "bench.forwarder", "--upstream", upstream.url]
    return fleet.launch(FORWARDERS[kind], argv + [f"--{kind}"] * bool(kind))


def start_pacer(fleet: Fleet, step: float, name: str, kind: str = "native") -> Server:
    """Paced streams, a chunk every ``step`` seconds: the native pacer (``bench.pacer.paced_argv``)
    or, ``kind`` "python", the same bytes from ``python -m bench.pacer --step``."""
    if kind == "python":
        return fleet.launch(name, [sys.executable, "-m", "bench.pacer", "--step", str(step)])
    return fleet.launch(name, paced_argv(step))


def start_nginx(fleet: Fleet, work: Path, nginx: str, upstream: Server | None = None) -> Server:
    """nginx as a reverse proxy in front of ``upstream``, or without one as the canned upstream;
    launched only, on a port its config names."""
    home, port = work / ("nginx" if upstream else "nginx-canned"), free_port()
    for sub in _NGINX_TEMP:
        (home / sub).mkdir(parents=True, exist_ok=True)
    canned = _CANNED.format(
        health=HEALTH_PATH,
        path=CHAT_PATH,
        body=BODY.decode(),
        models_path=MODELS_PATH,
        models=MODELS.decode(),
    )
    (home / "nginx.conf").write_text(_NGINX.format(
        work=home, port=port, upstream_port=upstream.port if upstream else port,  # canned: unused
        keepalive_requests=1000 if upstream else 100_000_000,
        temp_paths="\n".join(f"    {t}_temp_path {home}/{t};" for t in _NGINX_TEMP),
        locations=_PROXY if upstream else canned))  # fmt: skip
    argv = [nginx, "-p", str(home), "-c", str(home / "nginx.conf"), "-g", "daemon off;"]
    name = "nginx" if upstream else "canned nginx"
    return fleet.launch(name, argv, port=port, tree=True)  # its worker is a child


def start_canned(fleet: Fleet, work: Path, nginx: str | None) -> Server:
    """The canned upstream (``bench.pacer.BODY``): nginx, or ``python -m bench.pacer`` without it;
    named "canned nginx" or "canned python", so a report says which it was."""
    if nginx:
        return start_nginx(fleet, work, nginx)
    return fleet.launch("canned python", [sys.executable, "-m", "bench.pacer"])


def start_litellm(fleet: Fleet, work: Path, litellm: str, upstream: Server) -> Server:
    """One uvicorn worker (it takes seconds to import)."""
    config = work / "litellm.yaml"
    config.write_text(_LITELLM_CONFIG.format(model=MODEL, url=upstream.url, key=BENCH_KEY))
    argv = [litellm, "--config", str(config), "--host", "127.0.0.1", "--num_workers", "1"]
    return fleet.launch("litellm", argv, "/health/liveliness", env=LITELLM_ENV, cwd=work, tree=True)


# SGLang's model gateway, as its best operator runs it in front of one worker (bench/README.md,
# "The contenders", says why each flag): a plain router, round robin (cache-aware routing keeps a
# prefix tree per request, and with one worker it can only ever pick that one), logging at error
# (no line per request), its Prometheus listener on loopback at a port of its own (it cannot be
# turned off, and its default 29000 is shared by every gateway on the machine). smg also stops
# polling the worker's load, which only load-aware policies read.
GATEWAYS = ("sglang-router", "smg")
_GATEWAY_FLAGS = [
    "--policy",
    "round_robin",
    "--log-level",
    "error",
    "--prometheus-host",
    "127.0.0.1",
]
_GATEWAY_OWN = {"sglang-router": [], "smg": ["--disable-load-monitoring"]}


def gateway_argv(kind: str, binary: str, upstream: str) -> list[str]:
    """The command line of ``kind`` (one of ``GATEWAYS``) routing to ``upstream``, without its
    ports (``start_gateway`` adds them)."""
    return [binary, "launch", "--worker-urls", upstream, "--host", "127.0.0.1",
            *_GATEWAY_FLAGS, *_GATEWAY_OWN[kind]]  # fmt: skip


def start_gateway(fleet: Fleet, kind: str, binary: str, upstream: Server) -> Server:
    """One of SGLang's Rust gateways in front of ``upstream``; ready once ``/readiness`` says
    200 (a worker registered and healthy: before that it answers 503, or 404 to a chat)."""
    argv = [*gateway_argv(kind, binary, upstream.url), "--prometheus-port", str(free_port())]
    return fleet.launch(kind, argv, "/readiness", tree=True, ready_ok=True)


if __name__ == "__main__":  # the demo backend, as ``n-proxy-devserver`` serves it, on uvloop
    from proxy.devserver.cli import main

    on_uvloop()
    raise SystemExit(main(sys.argv[1:]))
