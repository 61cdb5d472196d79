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

import orjson

from bench import profile
from bench.procs import Fleet
from bench.report import PICTURED, ROOT, Row, header, stamp, table, version
from bench.scenario import Context, Options, Scenario, Tools
from bench.scenarios import NAMES, SUITE, load
from bench.stack import GATEWAYS

RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "bench" / ".work"  # where bench/run --install-tools puts LiteLLM, matplotlib, py-spy
TARGET_COLUMNS = [("target", "what", ""), ("goal", "goal", ""), ("measured", "measured", ""),
                  ("verdict", "verdict", "")]  # fmt: skip
FDS = 65536  # 1,000 open streams need a few thousand descriptors in proxy, backend and client


# Each tool: where else to look for it, what happens without it, how it says its version.
TOOLS = {
    "nginx": ([Path("/usr/sbin/nginx")], "its contenders are left out", "-v"),
    "wrk": ([], "the Python load generator is used", "-v"),
    "litellm": ([WORK / "litellm" / "bin" / "litellm"], "its contender is left out", "--version"),
    "sglang-router": (
        [WORK / "sglang-router" / "bin" / "sglang-router"],
        "its contender is left out",
        "--version",
    ),
    "smg": ([WORK / "smg" / "bin" / "smg"], "its contender is left out", "--version"),
    "prometheus": ([], "the dashboard scenario collects nothing", "--version"),
}
INSTALL = {"prometheus": "Debian's prometheus package has it"}  # else bench/run --install-tools


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
    for f in fields(Options):
        switch = {"action": argparse.BooleanOptionalAction}  # --warm-up and --no-warm-up
        how = switch if f.default is True else {"type": f.metadata["parse"]}
        o.add_argument(f"--{f.name.replace('_', '-')}", help=f.metadata["help"], **how)
    c = p.add_argument_group("what runs")
    c.add_argument("--baseline", type=Path, help="another n-proxy checkout (with its .venv),\n"
                   "run beside this one in every scenario that runs n-proxy")  # fmt: skip
    c.add_argument("--env", type=_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="for this tree's n-proxy only; {upstream}: the upstream's URL")  # fmt: skip
    for name, (places, _, _) in TOOLS.items():
        where = "".join(f" or {str(path).removeprefix(f'{ROOT}/')}" for path in places)
        c.add_argument(f"--{name}", help=f"the {name} binary (default: found on PATH{where})")
    c.add_argument("--tool", choices=("auto", "wrk", "python"), default="auto",
                   help="load generator; auto: wrk when found, except with --smoke")  # fmt: skip
    c.add_argument("--skip", type=lambda s: set(s.split(",")), default=set(),
                   help="leave out: nginx, wrk, litellm, sglang-router, smg, prometheus,\n"
                   "forwarder, lean, floor, quiet, fanout")  # fmt: skip
    c.add_argument("--profile", nargs="?", const="py-spy", metavar="PY_SPY",
                   help="record n-proxy with py-spy: its hot spots in the report")  # fmt: skip
    c.add_argument("--perf", nargs="?", const="perf", metavar="PERF",
                   help="sample n-proxy with perf: its CPU by object and symbol")  # fmt: skip
    r = p.add_argument_group("output")
    r.add_argument("--out", type=Path, help="results folder (default bench/results;"
                   " with --smoke bench/results/raw/smoke)")  # fmt: skip
    r.add_argument("--name", help="the report's file name (default: the scenario's, or latest)")
    r.add_argument("--note", default="", help="a line for the report")
    r.add_argument("--render", type=Path, metavar="JSON", help="only rebuild a run's Markdown")
    return p


def _find(name: str, places: list[Path]) -> str | None:
    return shutil.which(name) or next((str(p) for p in places if os.access(p, os.X_OK)), None)


def tools(args: argparse.Namespace) -> tuple[Tools, list[str]]:
    """What is installed (or given, or left out with --skip), and the versions of those used."""
    found: dict[str, str | None] = {}
    for name, (places, without, _) in TOOLS.items():
        given = getattr(args, name.replace("-", "_"))
        found[name] = None if name in args.skip else given or _find(name, places)
        if found[name] is None and name not in args.skip:
            how = INSTALL.get(name, "bench/run --install-tools installs it")
            print(f"bench: {name} not found: {without} ({how})")
    py_spy = args.profile and _find(args.profile, [WORK / "venv" / "bin" / "py-spy"])
    if args.profile and not py_spy:
        raise SystemExit("bench: --profile needs py-spy (bench/run --install-tools installs it)")
    perf = args.perf and _find(args.perf, [])
    if args.perf and not perf:
        raise SystemExit("bench: --perf needs perf (bench/run --install-tools installs it)")
    if args.tool == "wrk" and not found["wrk"]:
        raise SystemExit("bench: --tool wrk needs wrk")
    wrk = args.tool == "wrk" or (args.tool == "auto" and found["wrk"] and not args.smoke)
    used = {k: v for k, v in found.items() if v and (k != "wrk" or wrk)}  # wrk: when it loads
    versions = [version([path, TOOLS[name][2]]) for name, path in used.items()]
    gateways = {kind: path for kind in GATEWAYS if (path := found[kind])}
    chosen = Tools(found["nginx"], found["wrk"], found["litellm"], found["prometheus"],
                   "wrk" if wrk else "python", py_spy or None, perf or None, gateways)  # fmt: skip
    return chosen, versions


def render(results: Row) -> str:
    """The whole report: the stamp, every target, then each scenario's section."""
    scenarios = [load(name) for name in results["scenarios"] if name in results]
    out = header("n-proxy benchmark: " + ", ".join(results["scenarios"]), results["meta"])
    if results["targets"]:
        out += ["", "## Targets", *table(TARGET_COLUMNS, results["targets"])]
    if results["skipped"]:
        out += ["", "Left out: " + "; ".join(f"{k}: {v}" for k, v in results["skipped"].items())]
    for s in scenarios:
        data = results[s.name]
        out += ["", f"## {s.title}", "", *s.render(data)]
        out += profile.lines(data["profile"]) if data.get("profile") else []
        out += profile.perf_lines(data["perf"]) if data.get("perf") else []
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
    (work / "profile.txt").unlink(missing_ok=True)  # an earlier run's, with --profile
    (work / "perf.data").unlink(missing_ok=True)  # and with --perf
    try:  # the scenario's defaults, then its smoke ones with --smoke, then what was asked for
        chosen: dict[str, Any] = dict(scenario.full)
        if args.smoke:
            chosen |= {"rounds": 1, "reps": 2, "warm_up": False, **scenario.smoke}
        given = {f.name: getattr(args, f.name) for f in fields(Options)}
        options = Options(**chosen | {k: v for k, v in given.items() if v is not None})
        with Fleet(work / "logs") as fleet, contextlib.ExitStack() as stack:
            ctx = Context(options, found, args, fleet, work, stack, results["skipped"])
            data = {"options": asdict(options), **scenario.run(ctx)}
        if (spots := work / "profile.txt").exists():
            data["profile"] = profile.hot_spots(spots)
        if (samples := work / "perf.data").exists() and found.perf:  # this run's, with --perf
            data["perf"] = profile.perf_spots(found.perf, samples)
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
        return finish(saved, args.render.parent, args.render.stem, pictures=True)
    names = args.scenarios or list(SUITE)
    if unknown := [n for n in names if n not in NAMES]:
        raise SystemExit(f"bench: no scenario {', '.join(unknown)}; there are {' '.join(NAMES)}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(FDS, hard)), hard))
    found, versions = tools(args)
    command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    meta = stamp(command, found.tool, versions, args.baseline, args.note)
    results: Row = {"meta": meta, "scenarios": names, "skipped": {}, "errors": {}}
    raw = RESULTS / "raw" / ("smoke" if args.smoke else "full")
    for name in names:
        run(load(name), args, found, raw / name, results)
    results["meta"]["seconds"] = time.monotonic() - started
    out = args.out or (raw if args.smoke else RESULTS)
    return finish(results, out, report_stem(args), pictures=not args.smoke)


def report_stem(args: argparse.Namespace) -> str:
    """The report's file name: ``--name``, else ``profile`` with ``--profile`` or ``--perf``,
    else the one scenario's, else ``latest`` (docs cite a report by the command that writes
    it)."""
    names = args.scenarios or SUITE
    return str(
        args.name
        or ("profile" if args.profile or args.perf else names[0] if len(names) == 1 else "latest")
    )


def finish(results: Row, out: Path, stem: str, pictures: bool) -> int:
    """Targets checked, the report written (and the pictures, when asked for and the bench venv,
    which has matplotlib, is at hand)."""
    targets = [t for n in results["scenarios"] if n in results for t in load(n).targets(results[n])]
    results["targets"] = targets
    out.mkdir(parents=True, exist_ok=True)  # the JSON with NaN (a moment not measured) as null
    options = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE
    (out / f"{stem}.json").write_bytes(orjson.dumps(results, default=str, option=options))
    (out / f"{stem}.md").write_text(render(results))
    python = WORK / "venv" / "bin" / "python"
    if pictures and python.exists() and PICTURED & set(results):
        argv = [str(python), "-m", "bench.report", f"{out / stem}.json"]
        drawn = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        if drawn.returncode:
            print(f"bench: no picture: {drawn.stderr[-500:]}", flush=True)
    lines = ["  {verdict:<4}  {what}: {measured} (goal {goal})".format(**t) for t in targets]
    lines += [f"  left out {what}: {why}" for what, why in results["skipped"].items()]
    lines += [f"  ERROR {name}: {error}" for name, error in results["errors"].items()]
    print(f"\n== targets (results in {out / stem}.md)", *lines, sep="\n")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
