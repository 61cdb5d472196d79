"""Observability's cost on the pass-through path: the proxy as it was (a checkout at
``--baseline``), the proxy now with tracing off, and now with tracing on, side by side in front
of the canned upstream, in alternating rounds, with bench/wire's measurement (CPU per request
of each proxy's own process, from /proc).

    git worktree add /tmp/np-before <commit>
    python -m bench.obscost --baseline /tmp/np-before     # bench/results/obscost.{json,md}

Tracing on exports over OTLP/HTTP to the canned upstream itself (it answers any POST with 200),
so the exporter's thread does its real work in the proxy's process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import passthrough
from bench.load import Loader
from bench.main import _choose_tool, _git_version
from bench.procs import Fleet, Server, free_port, machine, wait_ready
from bench.stack import _PROXY_CONFIG, start_canned

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BEFORE = "before"
OFF = "tracing off"
ON = "tracing on"


def _proxy(fleet: Fleet, work: Path, name: str, tree: Path, upstream: Server, **env: str) -> Server:
    port = free_port()
    config = work / f"{name.replace(' ', '-')}.yaml"
    config.write_text(_PROXY_CONFIG.format(url=upstream.url))
    argv = [sys.executable, "-m", "proxy", "--config", str(config)]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    clean = {k: "" for k in os.environ if k.startswith("OTEL_")}
    return fleet.launch(
        name, argv, port, "/health", env={**clean, "PYTHONPATH": str(tree), **env}, cwd=tree
    )


def _paired(runs: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[float, float, float]]:
    """(target, c) -> median, first and third quartile of its per-round CPU ratio to before."""
    base = {(r["round"], r["concurrency"]): r["own_cpu_us"] for r in runs if r["target"] == BEFORE}
    ratios: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        b = base.get((r["round"], r["concurrency"]))
        if r["target"] in (BEFORE, OFF, ON) and b:
            ratios.setdefault((r["target"], r["concurrency"]), []).append(r["own_cpu_us"] / b)
    out = {}
    for key, values in ratios.items():
        q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
        out[key] = (q2, q1, q3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.obscost", description=__doc__)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the before")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", default="16")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    work = RESULTS / "raw" / "obscost" / "work"
    work.mkdir(parents=True, exist_ok=True)
    concurrencies = tuple(int(c) for c in args.concurrency.split(","))
    loader = Loader(_choose_tool("python", None, smoke=False), args.seconds, work)
    with Fleet(work.parent / "logs") as fleet:
        canned = start_canned(fleet, work, None)
        wait_ready(canned)
        traces = f"{canned.url}/v1/chat/completions"
        targets = {
            passthrough.DIRECT: canned,
            BEFORE: _proxy(fleet, work, BEFORE, args.baseline.resolve(), canned),
            OFF: _proxy(fleet, work, OFF, ROOT, canned),
            ON: _proxy(fleet, work, ON, ROOT, canned, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=traces),
        }
        for server in targets.values():
            wait_ready(server)
        result = passthrough.run(
            targets, loader, concurrencies, args.rounds, list(fleet.servers), tag="obscost"
        )
    rows = [r for r in result["summary"] if r["target"] != passthrough.DIRECT]
    paired = _paired(result["runs"])
    lines = [
        "# Observability's pass-through cost (issue 20)",
        "",
        f"Proxy at {_git_version()}, baseline {args.baseline}; {args.rounds} alternating"
        f" rounds of {args.seconds:g} s; Python load generator; canned Python upstream;"
        f" {machine()['cpus']} CPUs, shared.",
        "",
        "| proxy | c | req/s | CPU µs/req | vs before (paired) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = paired.get((r["target"], r["concurrency"]))
        shown = "-" if ratio is None else f"{ratio[0]:.3f}x ({ratio[1]:.3f}-{ratio[2]:.3f})"
        lines.append(
            f"| {r['target']} | {r['concurrency']} | {r['rps']:,.0f} | {r['cpu_us_per_req']:.1f}"
            f" | {shown} |"
        )
    lines += [
        "",
        "CPU µs/req: median over rounds. vs before: each round's CPU µs/req over the before's in"
        " the same round, median and interquartile range over rounds (on a shared machine,"
        " neighbours' load moves both alike within a round).",
    ]
    text = "\n".join(lines) + "\n"
    out: dict[str, Any] = {"summary": result["summary"], "runs": result["runs"]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "obscost.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    (args.out / "obscost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
