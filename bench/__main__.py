"""The benchmark's one command: ``python -m bench [SCENARIO ...] [options]`` (bench/README.md).
Runs each scenario, checks its targets, writes <scenario>.{json,md} (several: latest.{json,md});
installs nothing (bench/run --install-tools does): what is missing is left out, and said so."""

import argparse
import contextlib
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from bench import profile
from bench.procs import Fleet
from bench.report import ROOT, Row, header, stamp, targets_table, version, write
from bench.scenario import Context, Options, Scenario, Tools
from bench.scenarios import NAMES, SUITE, load

RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "bench" / ".work"  # where bench/run --install-tools puts LiteLLM, matplotlib, py-spy
FDS = 65536  # 1,000 open streams need a few thousand descriptors in proxy, backend and client


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"not KEY=VALUE: {text!r}")
    return key, value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                   help=f"any of {' '.join(NAMES)}\n(default: {' '.join(SUITE)})")  # fmt: skip
    o = p.add_argument_group("measurement (each scenario has its own defaults)")
    o.add_argument("--smoke", action="store_true", help="tiny, seconds: proves it runs (CI)")
    o.add_argument("--rounds", type=int, help="rounds, each contender once per round")
    o.add_argument("--seconds", type=float, help="per measurement (soak: all of it)")
    o.add_argument("--concurrency", type=_ints, help="comma-separated levels, or clients")
    o.add_argument("--n", type=_ints, help="comma-separated n (fanout, vllm, ...)")
    o.add_argument("--max-tokens", type=int, help="tokens per choice")
    o.add_argument("--reps", type=int, help="repetitions (ttft, vllm streams, llamacpp)")
    o.add_argument("--streams", type=_ints, help="open streams (manystream, memory)")
    o.add_argument("--no-warm-up", dest="warm_up", action="store_const", const=False)
    c = p.add_argument_group("what runs")
    c.add_argument("--baseline", type=Path, help="another n-proxy checkout (with its .venv),\n"
                   "run beside this one in every scenario that runs n-proxy")  # fmt: skip
    c.add_argument("--env", type=_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="for this tree's n-proxy only; {upstream}: the upstream's URL")  # fmt: skip
    c.add_argument("--nginx", help="the nginx binary (default: found on PATH or /usr/sbin)")
    c.add_argument("--wrk", help="the wrk binary (default: found on PATH)")
    c.add_argument("--litellm", help="LiteLLM's proxy (default: bench/.work/litellm)")
    c.add_argument("--tool", choices=("auto", "wrk", "python"), default="auto",
                   help="load generator; auto: wrk when found, except with --smoke")  # fmt: skip
    c.add_argument("--skip", type=lambda s: set(s.split(",")), default=set(),
                   help="leave out: nginx, wrk, litellm, forwarder, lean")  # fmt: skip
    c.add_argument("--profile", nargs="?", const="py-spy", metavar="PY_SPY",
                   help="record n-proxy with py-spy: its hot spots in the report")  # fmt: skip
    s = p.add_argument_group("one scenario's")
    s.add_argument("--workers", type=int, default=2, help="passthrough: also n-proxy xN (1: no)")
    s.add_argument("--steps-ms", type=_ints, default=(50, 20), help="manystream: decode steps")
    s.add_argument("--retry-on", type=lambda s: s.split(","), default=["connect", "reset"],
                   help="llamacpp: n-proxy's retry_on")  # fmt: skip
    r = p.add_argument_group("output")
    r.add_argument("--out", type=Path, help="results folder (default bench/results;"
                   " with --smoke bench/results/raw/smoke)")  # fmt: skip
    r.add_argument("--name", help="the report's file name (default: the scenario's, or latest)")
    r.add_argument("--note", default="", help="a line for the report")
    r.add_argument("--render", type=Path, metavar="JSON", help="only rebuild a run's Markdown")
    return p


def _find(name: str, explicit: str | None, skip: set[str], *places: Path) -> str | None:
    if name in skip:
        return None
    found = [str(p) for p in places if os.access(p, os.X_OK)]
    return explicit or shutil.which(name) or next(iter(found), None)


def tools(args: argparse.Namespace) -> Tools:
    nginx = _find("nginx", args.nginx, args.skip, Path("/usr/sbin/nginx"))
    wrk = _find("wrk", args.wrk, args.skip)
    litellm = _find("litellm", args.litellm, args.skip, WORK / "litellm" / "bin" / "litellm")
    py_spy = args.profile and _find(args.profile, None, set(), WORK / "venv" / "bin" / "py-spy")
    if args.profile and not py_spy:
        raise SystemExit("bench: --profile needs py-spy (bench/run --install-tools installs it)")
    if args.tool == "wrk" and not wrk:
        raise SystemExit("bench: --tool wrk needs wrk")
    for name, path, without in (("nginx", nginx, "its contenders are left out"),
                                ("wrk", wrk, "the Python load generator is used"),
                                ("litellm", litellm, "its contender is left out")):  # fmt: skip
        if path is None and name not in args.skip:
            print(f"bench: {name} not found: {without} (bench/run --install-tools installs it)")
    wanted = args.tool == "wrk" or (args.tool == "auto" and wrk and not args.smoke)
    return Tools(nginx, wrk, litellm, "wrk" if wanted else "python", py_spy or None)


def options(scenario: Scenario, args: argparse.Namespace) -> Options:
    """The scenario's defaults, then its smoke ones with --smoke, then what was asked for."""
    chosen: dict[str, Any] = dict(scenario.full)
    if args.smoke:
        chosen |= {"rounds": 1, "reps": 2, "warm_up": False, **scenario.smoke}
    given = {f.name: getattr(args, f.name) for f in fields(Options)}
    return Options(**chosen | {k: v for k, v in given.items() if v is not None})


def render(results: Row) -> str:
    """The whole report: the stamp, every target, then each scenario's section."""
    scenarios = [load(name) for name in results["scenarios"] if name in results]
    out = header("n-proxy benchmark: " + ", ".join(results["scenarios"]), results["meta"])
    if targets := [t for s in scenarios for t in s.targets(results[s.name])]:
        out += ["", "## Targets", *targets_table(targets)]
    if results["skipped"]:
        out += ["", "Left out: " + "; ".join(f"{k}: {v}" for k, v in results["skipped"].items())]
    for s in scenarios:
        data = results[s.name]
        out += ["", f"## {s.title}", "", *s.render(data)]
        out += profile.lines(data["profile"]) if data.get("profile") else []
    if results["errors"]:
        out += ["", "## Errors", ""] + [f"- {k}: {v}" for k, v in results["errors"].items()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out) + "\n")  # one blank line between parts


def run(
    scenario: Scenario, args: argparse.Namespace, found: Tools, work: Path, results: Row
) -> None:
    """One scenario into ``results``; a failure is noted (its traceback in work/error.log)."""
    print(f"== {scenario.name}", flush=True)
    started = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    try:
        chosen = options(scenario, args)
        with Fleet(work / "logs") as fleet, contextlib.ExitStack() as stack:
            ctx = Context(chosen, found, args, fleet, work, stack, results["skipped"])
            data = {"options": asdict(chosen), **scenario.run(ctx)}
        if (spots := work / "profile.txt").exists():
            data["profile"] = profile.hot_spots(spots)
        results[scenario.name] = data
    except Exception as exc:
        results["errors"][scenario.name] = f"{type(exc).__name__}: {exc}"[:500]
        (work / "error.log").write_text(traceback.format_exc())
        print(f"   {scenario.name} failed: {exc} (traceback in {work / 'error.log'})", flush=True)
    print(f"   ({time.monotonic() - started:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.env = dict(args.env)
    if args.render:
        saved = json.loads(args.render.read_text())
        return finish(saved, args.render.parent, args.render.stem, None)
    names = args.scenarios or list(SUITE)
    if unknown := [n for n in names if n not in NAMES]:
        raise SystemExit(f"bench: no scenario {', '.join(unknown)}; there are {' '.join(NAMES)}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(FDS, hard)), hard))
    found = tools(args)
    tools_used = ((found.wrk if found.tool == "wrk" else None, "-v"), (found.nginx, "-v"),
                  (found.litellm, "--version"))  # fmt: skip
    versions = [version([path, flag]) for path, flag in tools_used if path]
    command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    meta = stamp(command, found.tool, versions, args.baseline, args.note)
    results: Row = {"meta": meta, "scenarios": names, "skipped": {}, "errors": {}}
    raw = RESULTS / "raw" / ("smoke" if args.smoke else "full")
    for name in names:
        run(load(name), args, found, raw / name, results)
    results["meta"]["seconds"] = time.monotonic() - started
    out = args.out or (raw if args.smoke else RESULTS)
    stem = args.name or ("profile" if args.profile else names[0] if len(names) == 1 else "latest")
    chart = WORK / "venv" / "bin" / "python"
    return finish(results, out, stem, chart if chart.exists() and not args.smoke else None)


def finish(results: Row, out: Path, stem: str, chart_python: Path | None) -> int:
    """Targets checked, the report written (and the chart, when matplotlib is at hand)."""
    targets = [t for n in results["scenarios"] if n in results for t in load(n).targets(results[n])]
    results["targets"] = [{**asdict(t), "verdict": t.verdict} for t in targets]
    write(out, stem, results, render(results))
    if chart_python and {"passthrough", "fanout"} & set(results):
        files = [f"{out / stem}.json", f"{out / stem}.png"]
        argv = [str(chart_python), "-m", "bench.tools.chart", *files]
        drawn = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        if drawn.returncode:
            print(f"bench: no chart: {drawn.stderr[-500:]}", flush=True)
    print(f"\n== targets (results in {out / stem}.md)")
    for t in targets:
        print(f"  {t.verdict:<4}  {t.what}: {t.measured} (goal {t.goal})")
    for what, why in results["skipped"].items():
        print(f"  left out {what}: {why}")
    for name, error in results["errors"].items():
        print(f"  ERROR {name}: {error}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
