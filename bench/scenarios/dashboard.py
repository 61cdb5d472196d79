"""The docs' dashboard picture: deploy/observability/dashboard.json's queries, run by a real
Prometheus that scraped n-proxy through mixed load, with twice the clients in the middle third
(the queue fills, then drains). Needs prometheus; bench/report.py draws the picture."""

import json
import re
import shutil
import time
from typing import Any
from urllib.parse import urlencode
from urllib.request import urlopen

import orjson

from bench.load import generate
from bench.procs import free_port
from bench.report import ROOT, Row, table
from bench.scenario import PROXY, Context, Scenario
from bench.stack import start_backend, start_proxy
from bench.workload import CHAT_PATH, SEED, chat_body, run_async

QUERIES = ROOT / "deploy" / "observability" / "dashboard.json"
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")  # Grafana's {{label}}
RATE_WINDOW = "10s"  # $__rate_interval for a 1 s scrape
COMPLETIONS = {"model": "demo", "prompt": "x", "n": 2, "stream": True, "max_tokens": 12}
# The mix, one in twenty of each: pass-through, fan-out JSON and streams, a failing child.
_MIX = [
    *[(CHAT_PATH, chat_body(max_tokens=t)) for t in (4, 10, 16, 24)],
    *[(CHAT_PATH, chat_body(stream=True, max_tokens=t)) for t in (8, 20)],
    *[(CHAT_PATH, chat_body(3, stream=True, max_tokens=t)) for t in (4, 8, 12, 16, 24)],
    *[(CHAT_PATH, chat_body(4, max_tokens=t)) for t in (6, 12, 18, 24)],
    *[("/v1/completions", COMPLETIONS)] * 4,
    (CHAT_PATH, chat_body(2, x_demo={"only_seed": SEED + 1, "fault": "status_500"})),
]  # fmt: skip
_PROXY_CONFIG = """\
admin: {host: 127.0.0.1, port: ADMIN}
upstreams:
  - name: demo
    urls: ["{url}", "http://127.0.0.1:9"]
    max_concurrency: 12
    max_queue: 48
    health_interval: 2
    eject: {failures: 2, seconds: 5}
"""
_PROMETHEUS_CONFIG = """\
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: n-proxy
    static_configs: [{targets: ["127.0.0.1:ADMIN"]}]
"""


def _run(ctx: Context) -> Row:
    """The demo backend (one dead replica beside it), n-proxy and Prometheus as processes of
    their own; the load from here, half the clients, then all, then half again."""
    if ctx.tools.prometheus is None:
        ctx.skipped["dashboard"] = "prometheus not found: nothing collected"
        return {"panels": []}
    admin, port, data = str(free_port()), free_port(), ctx.work / "prometheus-data"
    shutil.rmtree(data, ignore_errors=True)  # this run's series only
    (config := ctx.work / "prometheus.yml").write_text(_PROMETHEUS_CONFIG.replace("ADMIN", admin))
    argv = [ctx.tools.prometheus, f"--config.file={config}", f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    backend = start_backend(ctx.fleet, token_delay=0.02)
    proxy = start_proxy(ctx.fleet, ctx.work, backend.url,
                        config=_PROXY_CONFIG.replace("ADMIN", admin))  # fmt: skip
    prometheus = ctx.fleet.launch("prometheus", argv, "/-/ready", port)
    ctx.ready({"backend": backend, PROXY: proxy, "prometheus": prometheus})
    mix = [(proxy.url + path, orjson.dumps(body)) for path, body in _MIX]
    workers, seconds = ctx.options.concurrency[0], ctx.options.seconds
    start, sent = time.time(), 0
    for clients in (max(1, workers // 2), workers, max(1, workers // 2)):
        latencies, errors, _ = run_async(generate(mix, clients, seconds / 3))
        sent += len(latencies) + errors
    time.sleep(3)  # the last scrapes
    panels = _panels(f"{prometheus.url}/api/v1/query_range", start, time.time())
    return {"seconds": seconds, "workers": workers, "requests": sent, "panels": panels}


def _panels(query_range: str, start: float, end: float) -> list[dict[str, Any]]:
    """Each panel of the dashboard (a row: its title only) with every series its queries gave."""
    out: list[dict[str, Any]] = []
    for panel in json.loads(QUERIES.read_text())["panels"]:
        if panel["type"] == "row":
            out.append({"row": panel["title"]})
            continue
        series = []
        for target in panel["targets"]:
            expr = target["expr"].replace("$job", "n-proxy")
            query = {"query": expr.replace("$__rate_interval", RATE_WINDOW), "step": 2}
            url = f"{query_range}?{urlencode({**query, 'start': start, 'end': end})}"
            with urlopen(url, timeout=30) as answer:  # an error status raises, with its reason
                found = json.load(answer)["data"]["result"]
            for result in found:
                labels: dict[str, str] = result["metric"]
                legend = _LEGEND.sub(
                    lambda m, labels=labels: labels.get(m.group(1), ""),  # type: ignore[misc]
                    target.get("legendFormat", ""),
                )
                points = [[float(t) - start, float(v)] for t, v in result["values"]]
                series.append({"legend": legend, "points": points})
        unit = panel["fieldConfig"]["defaults"]["unit"]
        out.append({"title": panel["title"], "unit": unit, "series": series})
    return out


def _render(data: Row) -> list[str]:
    panels = [{**p, "count": len(p["series"])} for p in data["panels"] if "title" in p]
    if not panels:
        return ["Nothing collected (no prometheus)."]
    return [
        f"{data['requests']} requests from {data['workers']} clients over {data['seconds']:g} s;"
        " the picture is dashboard.png beside this report (bench/report.py draws it).",
        *table([("panel", "title", ""), ("unit", "unit", ""), ("series", "count", "")], panels),
    ]


DASHBOARD = Scenario(
    "dashboard", "The dashboard's queries under mixed load", _run, _render,
    full={"seconds": 60.0, "concurrency": (8,)}, smoke={"seconds": 3.0, "concurrency": (2,)},
)  # fmt: skip
