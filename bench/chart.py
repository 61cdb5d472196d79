"""The headline chart from a results JSON: ``python -m bench.chart latest.json latest.png``.

Runs in the bench's own venv, where matplotlib lives (it is not a project dependency).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib  # type: ignore[import-not-found, unused-ignore]  # bench venv only

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

COLORS = {
    "direct": "#4c72b0",
    "nginx": "#55a868",
    "n-proxy": "#c44e52",
    "n-proxy x2": "#dd8452",
    "litellm": "#8172b2",
}


def _passthrough(ax: Any, summary: list[dict[str, Any]]) -> None:
    names = list(dict.fromkeys(r["target"] for r in summary))
    concurrencies = sorted({r["concurrency"] for r in summary})
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        rows = {r["concurrency"]: r for r in summary if r["target"] == name}
        xs = [j + i * width for j in range(len(concurrencies))]
        ax.bar(
            xs,
            [rows[c]["rps"] for c in concurrencies],
            width,
            label=name,
            color=COLORS.get(name),
        )
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(concurrencies))])
    ax.set_xticklabels([f"c={c}" for c in concurrencies])
    ax.set_ylabel("requests/s")
    ax.set_title("1. n=1 pass-through (non-streaming)")
    ax.legend(fontsize=8)


def _latency(ax: Any, summary: list[dict[str, Any]]) -> None:
    names = [n for n in dict.fromkeys(r["target"] for r in summary) if n != "direct"]
    concurrencies = sorted({r["concurrency"] for r in summary})
    for name in names:
        rows = {r["concurrency"]: r for r in summary if r["target"] == name}
        ax.plot(
            concurrencies,
            [rows[c]["added_p50_ms"] for c in concurrencies],
            marker="o",
            color=COLORS.get(name),
            label=f"{name} p50",
        )
        ax.plot(
            concurrencies,
            [rows[c]["added_p99_ms"] for c in concurrencies],
            marker="x",
            linestyle="--",
            color=COLORS.get(name),
            label=f"{name} p99",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=1)
    ax.axhline(0.3, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xticks(concurrencies)
    ax.set_xticklabels([str(c) for c in concurrencies])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("added latency over direct, ms")
    ax.set_title("1. added latency")
    ax.legend(fontsize=7)


def _fanout(ax: Any, summary: list[dict[str, Any]]) -> None:
    for stream, style in ((False, "-"), (True, "--")):
        rows = sorted((r for r in summary if r["stream"] == stream), key=lambda r: r["n"])
        ax.plot(
            [r["n"] for r in rows],
            [r["ratio"] * 100 for r in rows],
            marker="o",
            linestyle=style,
            label="streaming" if stream else "non-streaming",
        )
    ax.axhline(80, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("n")
    ax.set_ylabel("n-proxy / native n, % req/s")
    ax.set_ylim(bottom=0)
    ax.set_title("2. fan-out vs native n")
    ax.legend(fontsize=8)


def _targets(ax: Any, targets: list[dict[str, Any]]) -> None:
    ax.axis("off")
    colors = {"pass": "#2e7d32", "MISS": "#c62828", "n/a": "#757575"}
    ax.set_title("targets")
    for i, t in enumerate(targets):
        y = 1 - (i + 0.5) / max(len(targets), 1)
        ax.text(0, y, t["verdict"], color=colors[t["verdict"]], fontsize=8, weight="bold")
        ax.text(0.12, y, f"{t['what']}: {t['measured']} (goal {t['goal']})", fontsize=7)


def render(results: dict[str, Any], out: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    s1 = results.get("passthrough", {}).get("summary")
    if s1:
        _passthrough(axes[0][0], s1)
        _latency(axes[0][1], s1)
    s2 = results.get("fanout", {}).get("summary")
    if s2:
        _fanout(axes[1][0], s2)
    _targets(axes[1][1], results.get("targets", []))
    meta = results.get("meta", {})
    fig.suptitle(f"n-proxy benchmark · {meta.get('cpus')} x {meta.get('cpu_model')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main(argv: list[str]) -> int:
    source, out = Path(argv[0]), Path(argv[1])
    render(json.loads(source.read_text()), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
