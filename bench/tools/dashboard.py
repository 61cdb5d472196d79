"""The README's dashboard picture: deploy/observability/dashboard.json's queries, run by a real
Prometheus scraping n-proxy under a minute of mixed load (``collect``), drawn (``render``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.procs import Fleet, free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "observability" / "dashboard.json"
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")  # Grafana's {{label}}
RATE_WINDOW = "10s"  # $__rate_interval for a 1 s scrape
MESSAGES = [{"role": "user", "content": "Say something."}]


def _requests(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """One request of the mix: pass-through, fan-out JSON and streams, a rare failing child."""
    chat = {"model": "demo", "messages": MESSAGES, "max_tokens": rng.randint(4, 24)}
    kind = rng.random()
    if kind < 0.2:
        return "/v1/chat/completions", chat
    if kind < 0.3:
        return "/v1/chat/completions", {**chat, "stream": True}
    if kind < 0.55:
        return "/v1/chat/completions", {**chat, "n": 3, "stream": True}
    if kind < 0.75:
        return "/v1/chat/completions", {**chat, "n": 4}
    if kind < 0.95:
        return "/v1/completions", {"model": "demo", "prompt": "x", "n": 2, "stream": True,
                                   "max_tokens": chat["max_tokens"]}  # fmt: skip
    return "/v1/chat/completions", {**chat, "n": 2, "seed": 1,
                                    "x_demo": {"only_seed": 2, "fault": "status_500"}}  # fmt: skip


async def _load(url: str, seconds: float, workers: int) -> int:
    import aiohttp

    deadline = time.monotonic() + seconds
    sent = 0

    async def worker(index: int) -> None:
        nonlocal sent
        rng = random.Random(index)
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                path, body = _requests(rng)
                # More clients in the middle third: the queue fills, then drains.
                third = (deadline - time.monotonic()) / seconds
                if index >= workers // 2 and not 0.33 < third < 0.66:
                    await asyncio.sleep(0.2)
                    continue
                try:
                    async with http.post(url + path, json=body) as r:
                        await r.read()
                except aiohttp.ClientError:
                    pass
                sent += 1

    await asyncio.gather(*(worker(i) for i in range(workers)))
    return sent


_PROXY_CONFIG = """\
listen: {{host: 127.0.0.1, port: {port}}}
admin: {{host: 127.0.0.1, port: {admin}}}
upstreams:
  - name: demo
    urls: ["http://127.0.0.1:{backend}", "http://127.0.0.1:9"]
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


def _collect(prometheus: str, seconds: float, workers: int) -> dict[str, Any]:
    """The demo backend, n-proxy and Prometheus as processes of their own; the load from here."""
    home = Path(tempfile.mkdtemp(prefix="n-proxy-dashboard-"))
    backend, port, admin, prom = (free_port() for _ in range(4))
    (home / "proxy.yaml").write_text(_PROXY_CONFIG.format(port=port, admin=admin, backend=backend))
    (home / "prometheus.yml").write_text(_PROMETHEUS_CONFIG.format(admin=admin))
    python = [sys.executable, "-m"]
    devserver = [*python, "proxy.devserver", "--port", str(backend), "--token-delay", "0.02"]
    proxy = [*python, "proxy", "--config", str(home / "proxy.yaml")]
    prometheus_argv = [prometheus, f"--config.file={home / 'prometheus.yml'}",
                       f"--storage.tsdb.path={home / 'data'}",
                       f"--web.listen-address=127.0.0.1:{prom}"]  # fmt: skip
    try:
        with Fleet(home / "logs") as fleet:
            wait_ready(fleet.launch("backend", devserver, backend, "/health"))
            wait_ready(fleet.launch("n-proxy", proxy, admin, "/readyz"))
            wait_ready(fleet.launch("prometheus", prometheus_argv, prom, "/-/ready"))
            api = f"http://127.0.0.1:{prom}/api/v1"
            return asyncio.run(_drive(f"http://127.0.0.1:{port}", api, seconds, workers))
    finally:
        shutil.rmtree(home, ignore_errors=True)


async def _drive(proxy: str, api: str, seconds: float, workers: int) -> dict[str, Any]:
    import aiohttp

    start = time.time()
    sent = await _load(proxy, seconds, workers)
    await asyncio.sleep(3)  # the last scrapes
    async with aiohttp.ClientSession() as http:
        panels = await _query_panels(http, api, start, time.time())
    return {"seconds": seconds, "workers": workers, "requests": sent, "panels": panels}


async def _query_panels(http: Any, api: str, start: float, end: float) -> list[dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.append({"row": panel["title"]})
            continue
        series = []
        for target in panel["targets"]:
            expr = (
                target["expr"].replace("$job", "n-proxy").replace("$__rate_interval", RATE_WINDOW)
            )
            params = {"query": expr, "start": start, "end": end, "step": 2}
            async with http.get(f"{api}/query_range", params=params) as r:
                answer = await r.json()
            if answer.get("status") != "success":
                raise RuntimeError(f"{panel['title']}: {answer}")
            for result in answer["data"]["result"]:
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
    import matplotlib  # type: ignore[import-not-found, unused-ignore]  # bench venv only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    panels = [p for p in data["panels"] if "title" in p]
    columns = 2
    rows = (len(panels) + columns - 1) // columns
    plt.style.use("dark_background")
    fig, axes = plt.subplots(rows, columns, figsize=(11, 2.1 * rows), dpi=72)
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
    fig.suptitle(
        f"n-proxy dashboard: {data['requests']} requests from {data['workers']} clients over"
        f" {data['seconds']:g} s (demo backend, one dead replica of two); x: seconds",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=72)
    from PIL import Image  # type: ignore[import-not-found, unused-ignore]  # matplotlib's dependency

    with Image.open(png) as image:  # a palette of 64 colours: a third of the bytes, same look
        image.convert("RGB").quantize(64).save(png, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.dashboard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    collect = sub.add_parser("collect")
    collect.add_argument("out", type=Path)
    collect.add_argument("--seconds", type=float, default=60)
    collect.add_argument("--workers", type=int, default=8)
    collect.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    draw = sub.add_parser("render")
    draw.add_argument("data", type=Path)
    draw.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    if args.command == "collect":
        data = _collect(args.prometheus, args.seconds, args.workers)
        args.out.write_text(json.dumps(data) + "\n")
        print(f"{data['requests']} requests; {len(data['panels'])} panels -> {args.out}")
    else:
        render(json.loads(args.data.read_text()), args.png)
        print(f"{args.png}: {args.png.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
