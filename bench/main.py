"""The benchmark run: start every contender, run the five scenarios, write JSON, markdown, chart.

``bench/run`` installs the optional tools and calls this; see bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import fanout, memory, passthrough, stitching, ttft
from bench.load import Loader, Tool
from bench.procs import Fleet, Server, machine, wait_ready
from bench.profile import PySpy, hot_spots, inclusive
from bench.report import evaluate, markdown, targets_json
from bench.stack import (
    start_backend,
    start_forwarder,
    start_litellm,
    start_nginx,
    start_proxy,
)
from bench.streams import run_async

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SCENARIOS = ("passthrough", "fanout", "stitching", "ttft", "memory")
# Scenario 4 again with every child at this delay per token: with none, the demo backend writes a
# fast child's whole answer before it looks at the next request, which a real server would not.
PACED_TOKEN_DELAY = 0.001


@dataclass(frozen=True)
class Settings:
    rounds: int
    seconds: float
    concurrencies: tuple[int, ...]
    fanout_ns: tuple[int, ...]
    fanout_concurrency: int
    fanout_rounds: int
    fanout_seconds: float
    stitch_n: int
    stitch_tokens: int
    stitch_concurrency: int
    stitch_seconds: float
    stitch_rounds: int
    ttft_n: int
    ttft_tokens: int
    ttft_slow_delay: float
    ttft_reps: int
    open_streams: int
    open_n: int
    open_tokens: int
    open_token_delay: float
    slow_n: int
    slow_tokens: int
    slow_stall: float


FULL = Settings(
    rounds=5,
    seconds=3,
    concurrencies=(1, 16, 64),
    fanout_ns=(1, 2, 4, 8, 10),
    fanout_concurrency=16,
    fanout_rounds=3,
    fanout_seconds=2,
    stitch_n=8,
    stitch_tokens=1024,
    stitch_concurrency=4,
    stitch_seconds=8,
    stitch_rounds=3,
    ttft_n=8,
    ttft_tokens=32,
    ttft_slow_delay=0.01,
    ttft_reps=30,
    open_streams=1000,
    open_n=2,
    open_tokens=40,
    open_token_delay=0.25,
    slow_n=8,
    slow_tokens=100_000,
    slow_stall=4,
)
SMOKE = Settings(
    rounds=1,
    seconds=0.2,
    concurrencies=(4,),
    fanout_ns=(2,),
    fanout_concurrency=4,
    fanout_rounds=1,
    fanout_seconds=0.2,
    stitch_n=8,
    stitch_tokens=32,
    stitch_concurrency=2,
    stitch_seconds=0.3,
    stitch_rounds=1,
    ttft_n=2,
    ttft_tokens=4,
    ttft_slow_delay=0.01,
    ttft_reps=2,
    open_streams=20,
    open_n=2,
    open_tokens=4,
    open_token_delay=0.1,
    slow_n=2,
    slow_tokens=20_000,
    slow_stall=0.6,
)
# Profiling samples the proxy alone, long enough for a few thousand samples per scenario.
PROFILE = replace(
    FULL,
    rounds=1,
    seconds=8,
    concurrencies=(16,),
    fanout_ns=(8,),
    fanout_rounds=1,
    fanout_seconds=8,
    stitch_rounds=1,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench/run", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="every scenario, tiny, seconds")
    parser.add_argument("--profile", metavar="PY_SPY", help="profile the proxy on scenarios 1-3")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results)")
    parser.add_argument("--tool", choices=("auto", "wrk", "python"), default="auto")
    parser.add_argument("--wrk", help="the wrk binary")
    parser.add_argument("--nginx", help="the nginx binary")
    parser.add_argument("--litellm", help="LiteLLM's proxy command, from its own venv")
    parser.add_argument("--chart-python", help="a python with matplotlib, for the chart")
    parser.add_argument(
        "--skipped", action="append", default=[], metavar="WHAT=WHY", help="noted in the report"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="also run n-proxy --workers N in scenario 1 (1: don't)",
    )
    parser.add_argument("--rounds", type=int, help="rounds of scenarios 1 and 2")
    parser.add_argument("--only", help="comma-separated scenarios: " + ",".join(SCENARIOS))
    parser.add_argument("--command", help="the command line to print in the report")
    parser.add_argument(
        "--rerender",
        type=Path,
        metavar="JSON",
        help="only rebuild the summaries, markdown and chart of an earlier run's JSON",
    )
    return parser


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0] if text else "unknown"


def _git_version() -> str:
    """The commit the proxy ran from, marked dirty when proxy/ had uncommitted changes."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "proxy"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{commit}{'+dirty' if dirty else ''}" if commit else "unknown"


def _choose_tool(requested: str, wrk: str | None, smoke: bool) -> Tool:
    if requested == "wrk" or (requested == "auto" and wrk and not smoke):
        if not wrk:
            raise SystemExit("bench: --tool wrk needs wrk (install it or pass --wrk)")
        return "wrk"
    return "python"


def _attempt(
    name: str, results: dict[str, Any], log: Path, step: Callable[[], dict[str, Any]]
) -> None:
    print(f"== {name}", flush=True)
    started = time.monotonic()
    try:
        results[name] = step()
    except Exception as exc:
        results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:500]
        with log.open("a") as out:
            out.write(f"--- {name}\n{traceback.format_exc()}\n")
        print(f"   {name} failed: {exc} (traceback in {log})", flush=True)
    print(f"   ({time.monotonic() - started:.1f} s)", flush=True)


@dataclass(frozen=True)
class Lineup:
    """The running servers: the n=1 backend, its native-n twin, and every contender."""

    backend: Server
    native: Server
    proxy: Server
    contenders: dict[str, Server]  # name -> server, direct first
    # A backend that yields between tokens, and n-proxy in front of it (scenario 4).
    paced_backend: Server
    paced_proxy: Server


def _line_up(fleet: Fleet, work: Path, args: argparse.Namespace, skipped: dict[str, str]) -> Lineup:
    """Boot everything side by side; an optional contender that fails to start is skipped."""
    backend = start_backend(fleet)
    native = start_backend(fleet, native_n=True, name="backend-native")
    proxy = start_proxy(fleet, work, backend)
    paced = start_backend(fleet, name="backend-paced", token_delay=PACED_TOKEN_DELAY)
    paced_proxy = start_proxy(fleet, work, paced, name="n-proxy-paced")
    optional: dict[str, Server] = {}
    if args.workers > 1 and not args.profile:
        name = f"n-proxy x{args.workers}"
        optional[name] = start_proxy(fleet, work, backend, name, workers=args.workers)
    if args.nginx and not args.profile:
        optional["nginx"] = start_nginx(fleet, work, args.nginx, backend)
    if not args.profile:
        optional["aiohttp forwarder"] = start_forwarder(fleet, backend)
    if args.litellm and not args.profile:
        optional["litellm"] = start_litellm(fleet, work, args.litellm, backend)
    for server in (backend, native, proxy, paced, paced_proxy):
        wait_ready(server)
    for name, server in list(optional.items()):
        try:
            wait_ready(server)
        except RuntimeError as exc:
            skipped[name] = f"did not start: {exc}"[:300]
            fleet.stop(server)
            del optional[name]
    contenders = {"direct": backend}
    if "nginx" in optional:
        contenders["nginx"] = optional["nginx"]
    if "aiohttp forwarder" in optional:
        contenders["aiohttp forwarder"] = optional["aiohttp forwarder"]
    contenders["n-proxy"] = proxy
    contenders.update((k, v) for k, v in optional.items() if k.startswith("n-proxy x"))
    if "litellm" in optional:
        contenders["litellm"] = optional["litellm"]
    return Lineup(backend, native, proxy, contenders, paced, paced_proxy)


def _steps(
    lineup: Lineup, s: Settings, loader: Loader, servers: list[Server], warm_up: bool
) -> dict[str, Callable[[], dict[str, Any]]]:
    proxy, backend = lineup.proxy, lineup.backend
    return {
        "passthrough": lambda: passthrough.run(
            lineup.contenders,
            loader,
            s.concurrencies,
            s.rounds,
            servers,
            warm_up=warm_up,
        ),
        "fanout": lambda: fanout.run(
            proxy,
            backend,
            lineup.native,
            replace(loader, seconds=s.fanout_seconds),
            s.fanout_ns,
            s.fanout_concurrency,
            s.fanout_rounds,
            servers,
        ),
        "stitching": lambda: run_async(
            stitching.run(
                proxy,
                s.stitch_n,
                s.stitch_tokens,
                s.stitch_concurrency,
                s.stitch_seconds,
                s.stitch_rounds,
            )
        ),
        "ttft": lambda: {
            **run_async(
                ttft.run(proxy, backend, s.ttft_n, s.ttft_tokens, s.ttft_slow_delay, s.ttft_reps)
            ),
            "paced_token_delay_s": PACED_TOKEN_DELAY,
            "paced": run_async(
                ttft.run(
                    lineup.paced_proxy,
                    lineup.paced_backend,
                    s.ttft_n,
                    s.ttft_tokens,
                    s.ttft_slow_delay,
                    s.ttft_reps,
                )
            ),
        },
        "memory": lambda: {
            "open_streams": run_async(
                memory.open_streams(
                    proxy, s.open_streams, s.open_n, s.open_tokens, s.open_token_delay
                )
            ),
            "slow_client": run_async(
                memory.slow_client(proxy, backend, s.slow_n, s.slow_tokens, s.slow_stall)
            ),
        },
    }


def run(args: argparse.Namespace) -> int:
    smoke = bool(args.smoke)
    settings = PROFILE if args.profile else SMOKE if smoke else FULL
    if args.rounds:
        settings = replace(settings, rounds=args.rounds, fanout_rounds=args.rounds)
    out: Path = args.out or (RESULTS / "raw" / "smoke" if smoke else RESULTS)
    raw = RESULTS / "raw" / ("smoke" if smoke else "profile" if args.profile else "full")
    work = raw / "work"
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    errors_log = raw / "errors.log"
    errors_log.unlink(missing_ok=True)
    tool = _choose_tool(args.tool, args.wrk, smoke)
    only = set(args.only.split(",")) if args.only else set(SCENARIOS)
    if args.profile:
        only &= {"passthrough", "fanout", "stitching"}
    started = time.monotonic()
    results: dict[str, Any] = {
        "meta": _meta(args, tool, settings),
        "skipped": dict(s.split("=", 1) for s in args.skipped if "=" in s),
    }
    loader = Loader(tool, settings.seconds, work, args.wrk)
    with Fleet(raw / "logs") as fleet:
        lineup = _line_up(fleet, work, args, results["skipped"])
        steps = _steps(lineup, settings, loader, list(fleet.servers), warm_up=not smoke)
        for name in SCENARIOS:
            if name not in only:
                continue
            step = steps[name]
            if args.profile:
                with PySpy(args.profile, lineup.proxy.pid, raw / f"profile-{name}.txt"):
                    _attempt(name, results, errors_log, step)
            else:
                _attempt(name, results, errors_log, step)
    results["meta"]["seconds"] = round(time.monotonic() - started, 1)
    if args.profile:
        return _write_profile(results, raw, out)
    return _write_results(results, out, "smoke" if smoke else "latest", args.chart_python)


def _meta(args: argparse.Namespace, tool: Tool, settings: Settings) -> dict[str, Any]:
    return {
        "command": args.command or shlex.join(["bench/run", *sys.argv[1:]]),
        **machine(),
        "tool": tool,
        "proxy_version": _git_version(),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": asdict(settings),
        "versions": {
            "wrk": _version([args.wrk, "-v"]) if args.wrk else None,
            "nginx": _version([args.nginx, "-v"]) if args.nginx else None,
            "litellm": _version([args.litellm, "--version"]) if args.litellm else None,
        },
    }


def _write_results(results: dict[str, Any], out: Path, stem: str, chart_python: str | None) -> int:
    targets = evaluate(results)
    results["targets"] = targets_json(targets)
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / f"{stem}.md").write_text(markdown(results, targets))
    if chart_python:
        chart = subprocess.run(
            [chart_python, "-m", "bench.chart", str(json_path), str(out / f"{stem}.png")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if chart.returncode != 0:
            print(f"bench: chart failed: {chart.stderr[-500:]}", file=sys.stderr)
    print(f"\n== targets (results in {out})")
    for t in targets:
        print(f"  {t.verdict:<4}  {t.what}: {t.measured} (goal {t.goal})")
    for what, why in results["skipped"].items():
        print(f"  skipped {what}: {why}")
    errors = results.get("errors", {})
    for name, error in errors.items():
        print(f"  ERROR {name}: {error}")
    print(f"bench: done in {results['meta']['seconds']:.0f} s", flush=True)
    return 1 if errors else 0


def _write_profile(results: dict[str, Any], raw: Path, out: Path) -> int:
    lines = [
        "# n-proxy profile (py-spy, scenarios 1-3, n-proxy only)",
        "",
        f"Command: `{results['meta']['command']}`; {results['meta']['cpus']} x"
        f" {results['meta']['cpu_model']}. Raw stacks: bench/results/raw/profile/.",
    ]
    for name in ("passthrough", "fanout", "stitching"):
        source = raw / f"profile-{name}.txt"
        if not source.exists():
            lines += ["", f"## {name}: no profile ({results.get('errors', {}).get(name, '')})"]
            continue
        samples, spots = hot_spots(source)
        lines += [
            "",
            f"## {name} ({samples} samples)",
            "",
            "| self | total | function |",
            "|---|---|---|",
        ]
        lines += [f"| {s.self_share:.1%} | {s.total_share:.1%} | `{s.function}` |" for s in spots]
        lines += ["", "Inclusive (on the stack):", "", "| total | function |", "|---|---|"]
        lines += [f"| {share:.1%} | `{fn}` |" for fn, share in inclusive(source, 30)]
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    (out / "profile.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"bench: profile written to {out / 'profile.md'}")
    return 1 if results.get("errors") else 0


def rerender(source: Path, chart_python: str | None) -> int:
    results = json.loads(source.read_text())
    if "passthrough" in results:
        s1 = results["passthrough"]
        names = list(dict.fromkeys(r["target"] for r in s1["runs"]))
        levels = list(dict.fromkeys(r["concurrency"] for r in s1["runs"]))
        s1["summary"] = passthrough.summarize(s1["runs"], names, levels)
    if "fanout" in results:
        results["fanout"]["summary"] = fanout.summarize(results["fanout"]["runs"])
    return _write_results(results, source.parent, source.stem, chart_python)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.rerender:
        return rerender(args.rerender, args.chart_python)
    if args.profile and not shutil.which(args.profile):
        raise SystemExit(f"bench: py-spy not found at {args.profile}")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
