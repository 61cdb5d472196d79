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
from bench.report import ROOT, Row, say, table
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
    """Medians per (streams, step, contender); added latency against direct in the same round."""
    out = []
    for (streams, step_ms), case in grouped(rows, "streams", "step_ms"):
        timed = [r for r in case if "p50_ms" in r]
        for (name,), mine in grouped(case, "contender"):
            row = {"streams": streams, "step_ms": step_ms, "contender": name}
            row |= medians(mine, *MEDIANS)
            if name != DIRECT:
                row["added_ms"] = [
                    median(paired(timed, "contender", name, DIRECT, f"{q}_ms", minus))
                    for q in ("p50", "p99")
                ]
            out.append({**row, "not_started": max(r.get("not_started", 0) for r in mine)})
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
        " minus direct's in the same round.",
        *table([("streams x step", "group", ""), ("contender", "contender", ""),
                ("CPU µs / chunk", "cpu_us_per_chunk", "{:.1f}"),
                ("cores", "proxy_cores", "{:.2f}"), ("delivered", "delivered", "{:.1%}"),
                ("added p50 / p99 ms", "added_ms", "{:+.1f}"),
                ("not started", "not_started", "")], rows),
    ]  # fmt: skip


MANYSTREAM = Scenario(
    "manystream", "Many paced streams", _run, _render,
    full={"rounds": 1, "seconds": 5.0, "streams": (200, 1000)},
    smoke={"seconds": 0.5, "streams": (8,)},
)  # fmt: skip
