"""Many streams: hundreds of paced SSE streams through each contender, one small chunk per decode
step: CPU per relayed chunk and latency added per chunk. The pacer and the client are the native
ones (``bench/native``): in Python, each cost as much CPU as the contender at 50,000 chunks/s."""

import json
import math
import subprocess
import time
from typing import cast

from bench import native
from bench.procs import CpuWatch, Server
from bench.report import ROOT, Row, pick, say, table, target
from bench.scenario import BASELINE, PROXY, Context, Scenario
from bench.scenarios.passthrough import DIRECT, FORWARDER
from bench.stack import start_forwarder, start_nginx, start_pacer
from bench.stats import grouped, median, medians, minus, paired
from bench.workload import chat_request, raw_post

RAMP_LIMIT = 15.0  # seconds for every stream to get its first chunk
CLIENT_TIMEOUT = 120.0
WARMUP = 1.0  # seconds of flowing streams before the window, at most as long as the window
MEDIANS = ("cpu_us_per_chunk", "proxy_cores", "delivered", "p50_ms", "p99_ms")


def measure(
    server: Server, n: int, streams: int, step: float, warmup: float, seconds: float
) -> Row:
    """One client process (``bench/native/streams.c``) of ``streams`` / ``n`` requests of ``n``
    choices against one contender; the contender's CPU over the client's window."""
    steps = math.ceil((RAMP_LIMIT + warmup + seconds + 5) / step)
    request = raw_post(chat_request(n, stream=True, max_tokens=steps, seed=None))
    argv = [str(native.tool("streams")), str(server.port), str(max(streams // n, 1)), str(n)]
    argv += [str(step), str(RAMP_LIMIT), str(warmup), str(seconds)]
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
    assert process.stdin is not None
    assert process.stdout is not None
    process.stdin.write(request)
    process.stdin.close()
    watch, result = None, cast(Row, {})
    deadline = time.monotonic() + CLIENT_TIMEOUT
    try:
        for line in process.stdout:
            if line.startswith(b"start"):
                watch = CpuWatch([server])
            elif line.startswith(b"end") and watch is not None:
                result["cpu"] = watch.stop().__dict__
            elif line.startswith(b"result "):
                result.update(json.loads(line[7:]))
            if time.monotonic() > deadline:
                break
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if "cpu" in result and result.get("chunks"):
        result["proxy_cores"] = cores = result["cpu"]["servers"]
        result["cpu_us_per_chunk"] = cores * result["cpu"]["wall_seconds"] / result["chunks"] * 1e6
    return result


def _step(ctx: Context, step: float) -> list[Row]:
    """Every contender in front of one pacer of ``step`` seconds, every --streams, in rounds."""
    ms, o = f"{step * 1000:.0f}ms", ctx.options
    pacer = start_pacer(ctx.fleet, step, f"pacer-{ms}")
    servers = {DIRECT: pacer, **ctx.proxies(pacer.url, f"-{ms}")}
    if ctx.tools.nginx:
        servers["nginx"] = start_nginx(ctx.fleet, ctx.work, ctx.tools.nginx, pacer)
    if ctx.wants("forwarder"):
        servers[FORWARDER] = start_forwarder(ctx.fleet, pacer)
    up = ctx.ready(servers)
    contenders = {k: (up[k], 1) for k in (DIRECT, "nginx", FORWARDER) if k in up}
    for label in (PROXY, BASELINE):
        for n in (1, 4) if label in up else ():
            contenders[f"{label} n={n}"] = (up[label], n)

    def one(name: str, case: Row) -> Row:
        warmup = min(WARMUP, o.seconds)
        row = measure(*contenders[name], case["streams"], step, warmup, o.seconds)
        say(f"{case['streams']} x {ms} {name}", row, *MEDIANS, "not_started")
        return row

    cases = [{"streams": size, "step_ms": step * 1000} for size in o.streams]
    rows = ctx.rounds(contenders, cases, one, label="contender")
    ctx.fleet.stop(*up.values())
    return rows


def _run(ctx: Context) -> Row:
    rows = [row for ms in ctx.options.steps_ms for row in _step(ctx, ms / 1000)]
    return {"runs": rows, "summary": summarize(rows)}


def summarize(rows: list[Row]) -> list[Row]:
    """Medians per (streams, step, contender); added latency against direct in the same round;
    against nginx, paired by round: CPU per chunk, and the added p99 (added_p99 below)."""
    out = []
    for (streams, step_ms), case in grouped(rows, "streams", "step_ms"):
        timed = [r for r in case if "p50_ms" in r]
        for r in timed:
            base = pick(timed, round=r["round"], contender=DIRECT)
            r["added_p99_ms"] = minus(r["p99_ms"], base["p99_ms"]) if base else None
        for (name,), mine in grouped(case, "contender"):
            row = {"streams": streams, "step_ms": step_ms, "contender": name}
            row |= medians(mine, *MEDIANS)
            if name != DIRECT:
                row["added_ms"] = [
                    median(paired(timed, "contender", name, DIRECT, f"{q}_ms", minus))
                    for q in ("p50", "p99")
                ]
            if name not in (DIRECT, "nginx"):
                row["cpu_vs_nginx"], row["p99_vs_nginx"] = (
                    median(paired(timed, "contender", name, "nginx", key))
                    for key in ("cpu_us_per_chunk", "added_p99_ms")
                )
            out.append({**row, "not_started": max(r.get("not_started", 0) for r in mine)})
    return out


# The goals of the stream path, each at the most streams run: CPU per chunk against nginx's at a
# 50 ms step; at 20 ms (50,000 chunks a second for 1,000 streams), the chunks delivered and the
# added p99 against nginx's.
CPU_GOALS = ((1, 1.2), (4, 1.4))
CPU_STEP_MS, LOADED_STEP_MS, DELIVERED_GOAL, P99_GOAL = 50, 20, 0.99, 2.0


def _targets(data: Row) -> list[Row]:
    summary = data["summary"]
    streams = max((r["streams"] for r in summary), default=0)
    out = []
    for n, bound in CPU_GOALS:
        row = pick(summary, streams=streams, step_ms=CPU_STEP_MS, contender=f"{PROXY} n={n}")
        what = f"CPU per chunk over nginx's, n={n} ({streams} x {CPU_STEP_MS} ms)"
        out.append(target(what, row.get("cpu_vs_nginx"), "<=", bound, "{:.2f}x"))
    for n, _ in CPU_GOALS:
        row = pick(summary, streams=streams, step_ms=LOADED_STEP_MS, contender=f"{PROXY} n={n}")
        at = f"n={n} ({streams} x {LOADED_STEP_MS} ms)"
        out.append(target(f"delivered, {at}", row.get("delivered"), ">=", DELIVERED_GOAL, "{:.1%}"))
        what = f"added p99 over nginx's, {at}"
        out.append(target(what, row.get("p99_vs_nginx"), "<=", P99_GOAL, "{:.2f}x"))
    return out


def _render(data: Row) -> list[str]:
    rows, last = [], None
    for row in data["summary"]:
        group = f"{row['streams']} x {row['step_ms']:.0f} ms"
        rows.append({**row, "group": group if group != last else ""})
        last = group
    return [
        f"Medians of {data['options']['rounds']} round(s) of {data['options']['seconds']:g} s."
        " CPU from /proc of the contender's processes only; added latency = the contender's"
        " minus direct's in the same round; over nginx: the ratios of CPU per chunk and of added"
        " p99, each paired by round.",
        *table([("streams x step", "group", ""), ("contender", "contender", ""),
                ("CPU µs / chunk", "cpu_us_per_chunk", "{:.1f}"),
                ("CPU over nginx", "cpu_vs_nginx", "{:.2f}x"),
                ("cores", "proxy_cores", "{:.2f}"), ("delivered", "delivered", "{:.1%}"),
                ("added p50 / p99 ms", "added_ms", "{:+.1f}"),
                ("added p99 over nginx", "p99_vs_nginx", "{:.2f}x"),
                ("not started", "not_started", "")], rows),
    ]  # fmt: skip


MANYSTREAM = Scenario(
    "manystream", "Many paced streams", _run, _render, _targets,
    full={"rounds": 1, "seconds": 5.0, "streams": (200, 1000)},
    smoke={"seconds": 0.5, "streams": (8,)},
)  # fmt: skip
