"""Wire cost: each contender in front of a canned upstream that costs next to nothing.

Scenario 1 puts the Python demo backend upstream, which takes ~270 µs of CPU per request on the
same two cores and hides what a proxy costs. Here nginx answers every POST with the same
chat.completion (``bench/canned.py``; its Python server when nginx is missing), and the contenders
are timed side by side in alternating rounds with scenario 1's code: direct, nginx as a proxy, the
20-line aiohttp forwarder, the same forwarder on n-proxy's client ("lean forwarder": the floor
of aiohttp's server plus that client), n-proxy n=1 and n-proxy fan-out n=4 (the same proxy,
``"n": 4``).

    python -m bench.wire --nginx /usr/sbin/nginx --wrk /usr/bin/wrk   # bench/results/wire.*
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench import passthrough
from bench.load import Loader
from bench.main import _choose_tool, _git_version, _version
from bench.procs import Fleet, Server, machine, wait_ready
from bench.report import _PASSTHROUGH, _TARGETS, Target, _check, _table, targets_json
from bench.stack import start_canned, start_forwarder, start_nginx, start_proxy
from bench.stats import Row, median, paired
from bench.workload import chat_request

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FANOUT_N = 4
PROXY = "n-proxy"
FANOUT = f"n-proxy n={FANOUT_N}"
FORWARDER = "aiohttp forwarder"
LEAN = "lean forwarder"  # the same, on n-proxy's client: aiohttp's server plus that client
NGINX = "nginx"
BASELINE = "baseline n-proxy"
BASELINE_FANOUT = f"baseline n={FANOUT_N}"


def line_up(
    fleet: Fleet, work: Path, nginx: str | None, canned_nginx: bool, baseline: Path | None = None
) -> dict[str, Server]:
    """Every contender, booted side by side; the canned upstream is "direct"."""
    canned = start_canned(fleet, work, nginx if canned_nginx else None)
    wait_ready(canned)
    proxy = start_proxy(fleet, work, canned)  # per-request log on, to its log file, as in s1
    targets = {"direct": canned}
    if nginx:
        targets[NGINX] = start_nginx(fleet, work, nginx, canned)
    targets[FORWARDER] = start_forwarder(fleet, canned)
    targets[LEAN] = start_forwarder(fleet, canned, lean=True)
    targets[PROXY] = targets[FANOUT] = proxy
    if baseline is not None:  # another checkout, measured in the same rounds
        base = start_proxy(fleet, work, canned, "baseline", 1, baseline)
        targets[BASELINE] = targets[BASELINE_FANOUT] = base
    for server in targets.values():
        wait_ready(server)
    return targets


def _paired_ratio(
    rows: list[Row], name: str, base: str, c: int, scale: float = 1.0
) -> float | None:
    """Median over rounds of ``scale`` x name's req/s over base's req/s in the same round."""
    at_c = [r for r in rows if r["concurrency"] == c]
    values = paired(
        at_c,
        lambda r: bool(r["target"] == name),
        lambda r: bool(r["target"] == base),
        lambda r, b: scale * r["rps"] / b["rps"] if b["rps"] else float("nan"),
    )
    values = [v for v in values if v == v]  # not NaN
    return round(median(values), 3) if values else None


def _summary(summary: list[Row], name: str, c: int) -> Row:
    return next((r for r in summary if r["target"] == name and r["concurrency"] == c), {})


def _cpu_ratio(summary: list[Row], name: str, base: str, c: int, per: float = 1.0) -> float | None:
    mine = _summary(summary, name, c).get("cpu_us_per_req")
    theirs = _summary(summary, base, c).get("cpu_us_per_req")
    return round(mine / per / theirs, 3) if mine and theirs else None


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's three ratios, each paired by round, and CPU per request against the others."""
    rows, summary = results["runs"], results["summary"]
    levels = sorted({r["concurrency"] for r in rows})
    low, high = levels[0], levels[-1]
    return {
        "low_concurrency": low,
        "high_concurrency": high,
        "proxy_vs_forwarder_rps": _paired_ratio(rows, PROXY, FORWARDER, high),
        "proxy_vs_nginx_rps": _paired_ratio(rows, PROXY, NGINX, high),
        "proxy_added_p50_ms_low": _summary(summary, PROXY, low).get("added_p50_ms"),
        "fanout_children_vs_proxy_rps": _paired_ratio(rows, FANOUT, PROXY, high, FANOUT_N),
        "fanout_children_per_s": FANOUT_N * _summary(summary, FANOUT, high).get("rps", 0.0),
        "cpu_proxy_vs_forwarder": _cpu_ratio(summary, PROXY, FORWARDER, high),
        "cpu_proxy_vs_lean": _cpu_ratio(summary, PROXY, LEAN, high),
        "lean_vs_forwarder_rps": _paired_ratio(rows, LEAN, FORWARDER, high),
        "cpu_proxy_vs_nginx": _cpu_ratio(summary, PROXY, NGINX, high),
        "cpu_fanout_child_vs_proxy": _cpu_ratio(summary, FANOUT, PROXY, high, FANOUT_N),
        "cpu_fanout_child_vs_forwarder": _cpu_ratio(summary, FANOUT, FORWARDER, high, FANOUT_N),
    }


def evaluate(r: dict[str, Any]) -> list[Target]:
    low, high = r["low_concurrency"], r["high_concurrency"]
    return [
        _check(
            f"n-proxy pass-through req/s over the aiohttp forwarder's (c={high})",
            ">= 1.5x",
            r["proxy_vs_forwarder_rps"],
            lambda v: v >= 1.5,
            "{:.2f}x",
        ),
        _check(
            f"n-proxy pass-through added p50 (c={low})",
            "<= 0.25 ms",
            r["proxy_added_p50_ms_low"],
            lambda v: v <= 0.25,
            "{:.3f} ms",
        ),
        _check(
            f"fan-out n={FANOUT_N} children/s over pass-through req/s (c={high})",
            ">= 2x",
            r["fanout_children_vs_proxy_rps"],
            lambda v: v >= 2,
            "{:.2f}x",
        ),
    ]


_CPU: list[tuple[str, str, str]] = [
    ("n-proxy pass-through CPU/req over the forwarder's", "cpu_proxy_vs_forwarder", "{:.2f}x"),
    ("n-proxy pass-through CPU/req over nginx's", "cpu_proxy_vs_nginx", "{:.2f}x"),
    ("n-proxy pass-through CPU/req over the lean forwarder's", "cpu_proxy_vs_lean", "{:.2f}x"),
    ("lean forwarder req/s over the aiohttp forwarder's", "lean_vs_forwarder_rps", "{:.2f}x"),
    ("n-proxy req/s over nginx's", "proxy_vs_nginx_rps", "{:.2f}x"),
    (f"fan-out n={FANOUT_N} CPU per child over pass-through CPU/req", "cpu_fanout_child_vs_proxy",
     "{:.2f}x"),
    (f"fan-out n={FANOUT_N} CPU per child over the forwarder's CPU/req",
     "cpu_fanout_child_vs_forwarder", "{:.2f}x"),
]  # fmt: skip


def markdown(results: dict[str, Any]) -> str:
    meta, wire = results["meta"], results["wire"]
    r, targets = wire["ratios"], evaluate(wire["ratios"])
    rows = [
        {**row, "children_per_s": FANOUT_N * row["rps"] if row["target"] == FANOUT else None}
        for row in wire["summary"]
    ]
    columns = [*_PASSTHROUGH[:3], ("children/s", "children_per_s", "{:,.0f}"), *_PASSTHROUGH[3:]]
    columns.insert(-3, ("upstream CPU µs/req", "backend_cpu_us_per_req", "{:,.0f}"))
    out = [
        "# Wire cost against a canned upstream (bench/wire)",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['cpus']} x {meta['cpu_model']}, Linux {meta['kernel']}, Python"
        f" {meta['python']}; load generator: {meta['tool']}; upstream: {meta['upstream']};"
        f" proxy at commit {meta['proxy_version']}  ",
        f"Started {meta['started']}, took {meta['seconds']:.0f} s. Medians of {meta['rounds']}"
        f" alternating rounds of {meta['round_seconds']:g} s; everything on 127.0.0.1.",
        "",
        "## Targets (issue 12)",
        *_table(_TARGETS, targets_json(targets)),
        "",
        "Ratios of req/s are taken per round (both contenders in the same round), then the median.",
        "",
        f"## Other ratios (c={r['high_concurrency']}; CPU per request from /proc, each"
        " contender's own processes)",
        *_table(
            [("ratio", "what", ""), ("measured", "value", "")],
            [{"what": what, "value": _fmt(r.get(key), fmt)} for what, key, fmt in _CPU],
        ),
        "",
        "## Contenders",
        *_table(columns, rows),
        "",
        f'direct is the canned upstream itself; {FANOUT} sends `"n": {FANOUT_N}` to the same'
        f" n-proxy, so its req/s are parent requests ({FANOUT_N} upstream requests each) and"
        " its CPU µs/req is per parent. Own CPU: the contender's processes; upstream CPU: the"
        " canned server's, per request of the row. Added latency: contender minus direct in the"
        " same round, then the median. Other load: CPU of processes outside the bench (the"
        " machine is shared); steal: CPU the hypervisor gave to other machines. CPU µs/req moves"
        " much less than req/s when either is high.",
    ]
    return "\n".join(out) + "\n"


def _fmt(value: object, fmt: str) -> str:
    return "-" if not isinstance(value, int | float) or value != value else fmt.format(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/wire", description=__doc__)
    parser.add_argument("--nginx", help="the nginx binary: canned upstream and a contender")
    parser.add_argument("--wrk", help="the wrk binary (else the Python load generator)")
    parser.add_argument("--tool", choices=("auto", "wrk", "python"), default="auto")
    parser.add_argument("--upstream", choices=("auto", "nginx", "python"), default="auto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated")
    parser.add_argument("--no-warm-up", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--command", help="the command line to print in the report")
    parser.add_argument(
        "--baseline", type=Path, help="another n-proxy checkout (with .venv) measured beside"
    )
    args = parser.parse_args(argv)
    if args.upstream == "nginx" and not args.nginx:
        raise SystemExit("bench/wire: --upstream nginx needs --nginx")
    tool = _choose_tool(args.tool, args.wrk, smoke=False)
    concurrencies = tuple(int(c) for c in args.concurrency.split(","))
    work = RESULTS / "raw" / "wire" / "work"
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    canned_nginx = args.upstream != "python" and bool(args.nginx)
    results: dict[str, Any] = {
        "meta": {
            "command": args.command or "python -m bench.wire " + shlex.join(argv or sys.argv[1:]),
            **machine(),
            "tool": tool,
            "upstream": "canned nginx" if canned_nginx else "canned python (bench/canned.py)",
            "proxy_version": _git_version(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "rounds": args.rounds,
            "round_seconds": args.seconds,
            "concurrencies": list(concurrencies),
            "versions": {
                "wrk": _version([args.wrk, "-v"]) if args.wrk else None,
                "nginx": _version([args.nginx, "-v"]) if args.nginx else None,
            },
        }
    }
    loader = Loader(tool, args.seconds, work, args.wrk)
    requests = {FANOUT: chat_request(FANOUT_N), BASELINE_FANOUT: chat_request(FANOUT_N)}
    with Fleet(work.parent / "logs") as fleet:
        targets = line_up(fleet, work, args.nginx, canned_nginx, args.baseline)
        wire = passthrough.run(
            targets,
            loader,
            concurrencies,
            args.rounds,
            list(fleet.servers),
            warm_up=not args.no_warm_up,
            requests=requests,
            tag="wire",
        )
    wire["ratios"] = ratios(wire)
    wire["targets"] = targets_json(evaluate(wire["ratios"]))
    results["wire"] = wire
    results["meta"]["seconds"] = round(time.monotonic() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "wire.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    text = markdown(results)
    (args.out / "wire.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
