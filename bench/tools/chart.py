"""The results chart: ``python -m bench.tools.chart latest.json latest.png`` (the driver draws it
after a run when bench/.work/venv has matplotlib, which is not a project dependency)."""

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib  # type: ignore[import-not-found, unused-ignore]  # bench venv only

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

COLORS = {"direct": "#4c72b0", "nginx": "#55a868", "n-proxy": "#c44e52", "n-proxy x2": "#dd8452",
          "litellm": "#8172b2", "aiohttp forwarder": "#937860", "baseline": "#8c8c8c"}  # fmt: skip
Rows = list[dict[str, Any]]


def _passthrough(bars: Any, lines: Any, summary: Rows) -> None:
    """Req/s per contender and concurrency as bars; latency added over direct as lines."""
    names = list(dict.fromkeys(r["target"] for r in summary))
    levels = sorted({r["concurrency"] for r in summary})
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        rows = {r["concurrency"]: r for r in summary if r["target"] == name}
        xs = [j + i * width for j in range(len(levels))]
        bars.bar(xs, [rows[c]["rps"] for c in levels], width, label=name, color=COLORS.get(name))
        for q, style in (("p50", "o-"), ("p99", "x--")) if name != "direct" else ():
            values = [rows[c][f"added_{q}_ms"] for c in levels]
            lines.plot(levels, values, style, color=COLORS.get(name), label=f"{name} {q}")
    bars.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(levels))])
    bars.set_xticklabels([f"c={c}" for c in levels])
    bars.set(ylabel="requests/s", title="n=1 pass-through (non-streaming)")
    bars.legend(fontsize=8)
    lines.set_xscale("log", base=2)
    lines.set_yscale("symlog", linthresh=1)
    lines.axhline(0.3, color="grey", linewidth=0.8, linestyle=":")
    lines.set_xticks(levels, [str(c) for c in levels])
    lines.set(xlabel="concurrency", ylabel="added latency over direct, ms", title="added latency")
    lines.legend(fontsize=7)


def _fanout(ax: Any, summary: Rows) -> None:
    for stream, style in ((False, "o-"), (True, "o--")):
        rows = sorted((r for r in summary if r["stream"] == stream and r["target"] == "n-proxy"),
                      key=lambda r: r["n"])  # fmt: skip
        label = "streaming" if stream else "non-streaming"
        ax.plot([r["n"] for r in rows], [r["ratio"] * 100 for r in rows], style, label=label)
    ax.axhline(80, color="grey", linewidth=0.8, linestyle=":")
    ax.set(xlabel="n", ylabel="n-proxy / native n, % req/s", title="fan-out vs native n")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)


def _targets(ax: Any, targets: Rows) -> None:
    ax.axis("off")
    ax.set_title("targets")
    colors = {"pass": "#2e7d32", "MISS": "#c62828", "n/a": "#757575"}
    for i, t in enumerate(targets):
        y = 1 - (i + 0.5) / max(len(targets), 1)
        ax.text(0, y, t["verdict"], color=colors[t["verdict"]], fontsize=8, weight="bold")
        ax.text(0.12, y, f"{t['what']}: {t['measured']} (goal {t['goal']})", fontsize=7)


def render(results: dict[str, Any], out: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    if passthrough := results.get("passthrough", {}).get("summary"):
        _passthrough(axes[0][0], axes[0][1], passthrough)
    if fanout := results.get("fanout", {}).get("summary"):
        _fanout(axes[1][0], fanout)
    _targets(axes[1][1], results.get("targets", []))
    meta = results.get("meta", {})
    fig.suptitle(f"n-proxy benchmark · {meta.get('cpus')} x {meta.get('cpu_model')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


if __name__ == "__main__":
    render(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
