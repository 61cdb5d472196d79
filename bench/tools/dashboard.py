"""The README's dashboard picture: deploy/observability/dashboard.json's queries, run by a real
Prometheus scraping n-proxy under a minute of mixed load (``collect``), drawn (``render``)."""

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode
from urllib.request import urlopen

import orjson

from bench.load import generate
from bench.procs import Fleet, free_port, wait_ready
from bench.report import ROOT, pyplot
from bench.stack import start_backend, start_proxy
from bench.workload import CHAT_PATH, SEED, chat_body, run_async

DASHBOARD = ROOT / "deploy" / "observability" / "dashboard.json"
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
admin: {{host: 127.0.0.1, port: {admin}}}
upstreams:
  - name: demo
    urls: ["{{url}}", "http://127.0.0.1:9"]
    max_concurrency: 12
    max_queue: 48
    health_interval: 2
    eject: {{failures: 2, seconds: 5}}
"""
_PROMETHEUS_CONFIG = """\
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: n-proxy
    static_configs: [{{targets: ["127.0.0.1:{admin}"]}}]
"""


def collect(prometheus: str, seconds: float, workers: int) -> dict[str, Any]:
    """The demo backend, n-proxy and Prometheus as processes of their own; the load from here,
    with twice the clients in the middle third (the queue fills, then drains)."""
    admin, prom = free_port(), free_port()
    with (
        tempfile.TemporaryDirectory(prefix="n-proxy-dashboard-", ignore_cleanup_errors=True) as tmp,
        Fleet(Path(tmp) / "logs") as fleet,  # stopped before the folder goes
    ):
        config = Path(tmp) / "prometheus.yml"
        config.write_text(_PROMETHEUS_CONFIG.format(admin=admin))
        argv = [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{prom}"]  # fmt: skip
        backend = start_backend(fleet, token_delay=0.02)
        wait_ready(backend)
        proxy = start_proxy(fleet, Path(tmp), backend.url, config=_PROXY_CONFIG.format(admin=admin))
        wait_ready(proxy)
        wait_ready(fleet.launch("prometheus", argv, prom, "/-/ready"))
        mix = [(proxy.url + path, orjson.dumps(body)) for path, body in _MIX]
        start, sent = time.time(), 0
        for clients in (workers // 2, workers, workers // 2):
            latencies, errors, _ = run_async(generate(mix, clients, seconds / 3))
            sent += len(latencies) + errors
        time.sleep(3)  # the last scrapes
        panels = _panels(f"http://127.0.0.1:{prom}/api/v1/query_range", start, time.time())
    return {"seconds": seconds, "workers": workers, "requests": sent, "panels": panels}


def _panels(query_range: str, start: float, end: float) -> list[dict[str, Any]]:
    """Each panel of the dashboard (a row: its title only) with every series its queries gave."""
    out: list[dict[str, Any]] = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
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


def render(data: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    panels = [p for p in data["panels"] if "title" in p]
    rows = (len(panels) + 1) // 2  # two columns
    plt.style.use("dark_background")
    fig, axes = plt.subplots(rows, 2, figsize=(11, 2.1 * rows), dpi=72)
    scale = {"percentunit": (100, "%"), "s": (1000, "ms"), "reqps": (1, "/s"), "short": (1, "")}
    for ax, panel in zip(axes.flat, panels, strict=False):
        factor, suffix = scale.get(panel["unit"], (1, ""))
        shown = [s for s in panel["series"] if any(v == v for _, v in s["points"])][:8]  # not NaN
        for series in shown:
            xs = [p[0] for p in series["points"]]
            ys = [p[1] * factor for p in series["points"]]
            ax.plot(xs, ys, linewidth=1.2, label=series["legend"][:34])
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.2)
        if suffix:
            ax.set_ylabel(suffix, fontsize=7)
        if shown:
            ax.legend(fontsize=6, loc="upper left", frameon=False, ncol=2)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"n-proxy dashboard: {data['requests']} requests from {data['workers']} clients"
                 f" over {data['seconds']:g} s (demo backend, one dead replica of two); x: seconds",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(png, dpi=72)
    from PIL import Image  # type: ignore[import-not-found, unused-ignore]  # matplotlib's dependency

    with Image.open(png) as image:  # a palette of 64 colours: a third of the bytes, same look
        image.convert("RGB").quantize(64).save(png, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.dashboard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("collect")
    run.add_argument("out", type=Path)
    run.add_argument("--seconds", type=float, default=60)
    run.add_argument("--workers", type=int, default=8)
    run.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    draw = sub.add_parser("render")
    draw.add_argument("data", type=Path)
    draw.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    if args.command == "collect":
        data = collect(args.prometheus, args.seconds, args.workers)
        args.out.write_text(json.dumps(data) + "\n")
        print(f"{data['requests']} requests; {len(data['panels'])} panels -> {args.out}")
    else:
        render(json.loads(args.data.read_text()), args.png)
        print(f"{args.png}: {args.png.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
