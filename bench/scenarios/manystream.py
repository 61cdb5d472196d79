"""Many streams: hundreds of paced SSE streams through each contender, one small chunk per decode
step: CPU per relayed chunk and latency added per chunk, under each shape of traffic. The pacer
and the client are the native ones (``bench/native``) by default: in Python, each cost as much
CPU as the contender at 50,000 chunks/s. ``--pacers native,python --clients native,python`` runs
every combination with the Python ones too (``bench.pacer --step``, ``bench.streams``): a writer
and a reader with an interpreter's pace, as real servers and SDK clients have. SGLang's gateways
relay at n = 1 only: they pass ``n`` through, and a server of one choice per request refuses it."""

import contextlib
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import psutil

from bench import native
from bench.procs import CpuWatch, Server, switches
from bench.report import ROOT, Row, cell, pick, say, table, target
from bench.scenario import BASELINE, PROXY, Context, Scenario
from bench.scenarios.passthrough import DIRECT, FORWARDER
from bench.stack import (
    GATEWAYS,
    gateway_argv,
    start_forwarder,
    start_gateway,
    start_nginx,
    start_pacer,
)
from bench.stats import grouped, median, medians, minus, paired
from bench.workload import chat_request, raw_post

RAMP_LIMIT = 15.0  # seconds for every stream to get its first chunk
CLIENT_TIMEOUT = 120.0
WARMUP = 1.0  # seconds of flowing streams before the window, at most as long as the window
KINDS = ("native", "python")  # of client, and of pacer
SGL = "sglang-router"
# Per relayed chunk, from /proc over the window, summed over the contender's processes: read(2)
# and write(2) calls (the read and write families only: uvloop reads a socket with read(2), nginx
# and tokio with recv(2), which /proc does not count), and context switches: voluntary, a sleep
# in epoll_wait (so one per wake-up of the loop), and involuntary, a preemption by another
# process wanting the core; and the CPU split into user and system (kernel) time, in µs. Those
# two, like the CPU of every table, are the kernel's tick samples (here 250 a second: the task
# running at a tick is charged the whole 4 ms), which a pacer's timer in step with the tick can
# bias; ``exact_us`` is the scheduler's own count of time on the CPU, in ns
# (/proc/PID/task/TID/schedstat), which is not sampled.
COUNTS = ("reads", "writes", "wakeups", "preempted", "user_us", "system_us", "exact_us")
MEDIANS = ("cpu_us_per_chunk", "proxy_cores", "delivered", "p50_ms", "p99_ms", "client_cores",
           "pacer_cores", *(f"{c}_per_chunk" for c in COUNTS))  # fmt: skip


def _counts(server: Server) -> tuple[float, ...]:
    """``COUNTS`` of the server's processes so far."""
    root = psutil.Process(server.pid)
    total = [0.0] * len(COUNTS)
    for each in [root, *(root.children(recursive=True) if server.tree else [])]:
        with contextlib.suppress(psutil.NoSuchProcess, OSError):
            io, cpu = each.io_counters(), each.cpu_times()  # the whole process's, every thread's
            found = (io.read_count, io.write_count, *switches(each.pid), cpu.user * 1e6,
                     cpu.system * 1e6, _runtime_us(each.pid))  # fmt: skip
            for i, value in enumerate(found):
                total[i] += value
    return tuple(total)


def _runtime_us(pid: int) -> float:
    """µs on the CPU of every thread of ``pid`` so far, as the scheduler counts it."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(stat.read_text().split()[0])
    return total / 1000


def _cpu(pid: int) -> float:
    with contextlib.suppress(psutil.Error):
        return float(sum(psutil.Process(pid).cpu_times()[:2]))
    return math.nan


def client_argv(kind: str, port: int, requests: int, n: int, step: float, warmup: float,
                seconds: float) -> list[str]:  # fmt: skip
    """The many-stream client: ``bench/native/streams.c``, or ``bench.streams`` (Python)."""
    args = [str(a) for a in (port, requests, n, step, RAMP_LIMIT, warmup, seconds)]
    if kind == "python":
        return [sys.executable, "-m", "bench.streams", *args]
    return [str(native.tool("streams")), *args]


def measure(
    server: Server, n: int, streams: int, step: float, warmup: float, seconds: float,
    client: str = "native", pacer: Server | None = None,
) -> Row:  # fmt: skip
    """One client process of ``streams`` / ``n`` requests of ``n`` choices against one contender;
    over the client's window, the contender's CPU and ``COUNTS``, the client's own CPU and the
    pacer's (``pacer``, when it is not the contender itself)."""
    steps = math.ceil((RAMP_LIMIT + warmup + seconds + 5) / step)
    request = raw_post(chat_request(n, stream=True, max_tokens=steps, seed=None))
    argv = client_argv(client, server.port, max(streams // n, 1), n, step, warmup, seconds)
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
    assert process.stdin is not None
    assert process.stdout is not None
    process.stdin.write(request)
    process.stdin.close()
    watched = [server] + ([pacer] if pacer is not None and pacer is not server else [])
    watch, result = None, cast(Row, {})
    counts, client_cpu = (0.0,) * len(COUNTS), 0.0
    deadline = time.monotonic() + CLIENT_TIMEOUT
    try:
        for line in process.stdout:
            if line.startswith(b"start"):
                watch, counts, client_cpu = CpuWatch(watched), _counts(server), _cpu(process.pid)
            elif line.startswith(b"end") and watch is not None:
                client_cpu = _cpu(process.pid) - client_cpu
                counts = tuple(b - a for a, b in zip(counts, _counts(server), strict=True))
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
        wall, by_server = result["cpu"]["wall_seconds"], result["cpu"]["by_server"]
        result["proxy_cores"] = cores = by_server[server.name]
        result["cpu_us_per_chunk"] = cores * wall / result["chunks"] * 1e6
        result["client_cores"] = client_cpu / wall
        result["pacer_cores"] = by_server.get(pacer.name) if pacer is not None else None
        for name, count in zip(COUNTS, counts, strict=True):
            result[f"{name}_per_chunk"] = count / result["chunks"]
    return result


def _step(ctx: Context, step: float, kind: str, found: Row) -> list[Row]:
    """Every contender in front of one pacer (of ``kind``) of ``step`` seconds, every --streams
    and --clients, in rounds; what nginx and the gateways ran with goes into ``found``."""
    ms, o = f"{step * 1000:.0f}ms", ctx.options
    pacer = start_pacer(ctx.fleet, step, f"pacer-{kind}-{ms}", kind)
    servers = {DIRECT: pacer, **ctx.proxies(pacer.url, f"-{kind}-{ms}")}
    if ctx.tools.nginx:
        servers["nginx"] = start_nginx(ctx.fleet, ctx.work, ctx.tools.nginx, pacer)
        found["nginx_conf"] = (ctx.work / "nginx" / "nginx.conf").read_text()
    if ctx.wants("forwarder"):
        servers[FORWARDER] = start_forwarder(ctx.fleet, pacer)
    for gateway, binary in ctx.tools.gateways.items():
        servers[gateway] = start_gateway(ctx.fleet, gateway, binary, pacer)
        found.setdefault("gateways", {})[gateway] = shlex.join(
            [*gateway_argv(gateway, gateway, "http://127.0.0.1:PACER"), "--prometheus-port", "P"]
        )
    up = ctx.ready(servers, optional=GATEWAYS)
    contenders = {k: (up[k], 1) for k in (DIRECT, "nginx", FORWARDER, *GATEWAYS) if k in up}
    for label in (PROXY, BASELINE):
        for n in (1, 4) if label in up else ():
            contenders[f"{label} n={n}"] = (up[label], n)

    def one(name: str, case: Row) -> Row:
        warmup = min(WARMUP, o.seconds)
        server, n = contenders[name]
        row = measure(server, n, case["streams"], step, warmup, o.seconds, case["client"], pacer)
        what = f"{case['streams']} x {ms} ({kind} pacer, {case['client']} client) {name}"
        say(what, row, "cpu_us_per_chunk", "delivered", "p99_ms", "client_cores", "pacer_cores",
            "wakeups_per_chunk", "not_started")  # fmt: skip
        return row

    cases = [{"pacer": kind, "client": client, "streams": size, "step_ms": step * 1000}
             for client in o.clients for size in o.streams]  # fmt: skip
    rows = ctx.rounds(contenders, cases, one, label="contender")
    ctx.fleet.stop(*up.values())
    return rows


def _run(ctx: Context) -> Row:
    o = ctx.options
    if unknown := sorted(set(o.clients + o.pacers) - set(KINDS)):
        raise ValueError(f"no client or pacer {', '.join(unknown)}: there are {', '.join(KINDS)}")
    found: Row = {}
    rows = [
        row for ms in o.steps_ms for kind in o.pacers for row in _step(ctx, ms / 1000, kind, found)
    ]
    return {"runs": rows, "summary": summarize(rows), **found}


def summarize(rows: list[Row]) -> list[Row]:
    """Medians per (pacer, client, streams, step, contender); added latency against direct in
    the same round; against nginx and sglang-router, paired by round: CPU per chunk, and (nginx)
    the added p99 (added_p99 below)."""
    out = []
    keys = ("pacer", "client", "streams", "step_ms")
    for (pacer, client, streams, step_ms), case in grouped(rows, *keys):
        timed = [r for r in case if "p50_ms" in r]
        for r in timed:
            base = pick(timed, round=r["round"], contender=DIRECT)
            r["added_p99_ms"] = minus(r["p99_ms"], base["p99_ms"]) if base else None
        for (name,), mine in grouped(case, "contender"):
            row = {"pacer": pacer or "native", "client": client or "native", "streams": streams,
                   "step_ms": step_ms, "contender": name}  # fmt: skip
            row |= medians(mine, *MEDIANS)
            if name != DIRECT:
                row["added_ms"] = [
                    median(paired(timed, "contender", name, DIRECT, f"{q}_ms", minus))
                    for q in ("p50", "p99")
                ]
            if name not in (DIRECT, "nginx"):
                row["cpu_vs_nginx"], row["p99_vs_nginx"], row["exact_vs_nginx"] = (
                    median(paired(timed, "contender", name, "nginx", key))
                    for key in ("cpu_us_per_chunk", "added_p99_ms", "exact_us_per_chunk")
                )
            if name not in (DIRECT, SGL):
                row["cpu_vs_sgl"] = median(
                    paired(timed, "contender", name, SGL, "cpu_us_per_chunk")
                )
            out.append({**row, "not_started": max(r.get("not_started", 0) for r in mine)})
    return out


# The goals of the stream path, each at the most streams run: CPU per chunk against nginx's at a
# 50 ms step; at 20 ms (50,000 chunks a second for 1,000 streams), the chunks delivered and the
# added p99 against nginx's.
CPU_GOALS = ((1, 1.2), (4, 1.4))
CPU_STEP_MS, LOADED_STEP_MS, DELIVERED_GOAL, P99_GOAL = 50, 20, 0.99, 2.0


SGL_GOAL = 1.0  # n-proxy's relay: CPU per chunk at most sglang-router's


def _shapes(summary: list[Row]) -> list[tuple[str, str]]:
    return list(
        dict.fromkeys((r.get("pacer", "native"), r.get("client", "native")) for r in summary)
    )


def _shape(pacer: str, client: str) -> str:
    """How a target names the traffic's shape: nothing for the C pacer and client."""
    return "" if (pacer, client) == ("native", "native") else f", {pacer} pacer, {client} client"


def _targets(data: Row) -> list[Row]:
    summary = data["summary"]
    streams = max((r["streams"] for r in summary), default=0)
    out = []
    for pacer, client in _shapes(summary):
        shape = {"pacer": pacer, "client": client, "streams": streams}
        at = f"({streams} x {CPU_STEP_MS} ms{_shape(pacer, client)})"
        for n, bound in CPU_GOALS:
            row = pick(summary, **shape, step_ms=CPU_STEP_MS, contender=f"{PROXY} n={n}")
            what = f"CPU per chunk over nginx's, n={n} {at}"
            out.append(target(what, row.get("cpu_vs_nginx"), "<=", bound, "{:.2f}x"))
        row = pick(summary, **shape, step_ms=CPU_STEP_MS, contender=f"{PROXY} n=1")
        what = f"CPU per chunk over sglang-router's, n=1 {at}"
        out.append(target(what, row.get("cpu_vs_sgl"), "<=", SGL_GOAL, "{:.2f}x"))
        for n, _ in CPU_GOALS:
            row = pick(summary, **shape, step_ms=LOADED_STEP_MS, contender=f"{PROXY} n={n}")
            at = f"n={n} ({streams} x {LOADED_STEP_MS} ms{_shape(pacer, client)})"
            if not row and (pacer, client) != ("native", "native"):
                continue  # the 20 ms step is the C tools' load; run with them only
            what = f"delivered, {at}"
            out.append(target(what, row.get("delivered"), ">=", DELIVERED_GOAL, "{:.1%}"))
            what = f"added p99 over nginx's, {at}"
            out.append(target(what, row.get("p99_vs_nginx"), "<=", P99_GOAL, "{:.2f}x"))
    return out


def _render(data: Row) -> list[str]:
    rows, last = [], None
    for row in data["summary"]:
        group = f"{row['streams']} x {row['step_ms']:.0f} ms"
        shape = f"{row.get('pacer', 'native')} / {row.get('client', 'native')}"
        rows.append({**row, "group": group if (group, shape) != last else "",
                     "shape": shape if (group, shape) != last else ""})  # fmt: skip
        last = (group, shape)
    tools = [r for r in rows if r.get("client_cores") is not None]
    return [
        f"Medians of {data['options']['rounds']} round(s) of {data['options']['seconds']:g} s."
        " CPU from /proc of the contender's processes only; added latency = the contender's"
        " minus direct's in the same round; over nginx and over sglang-router: the ratios of CPU"
        " per chunk (and of added p99 over nginx's), each paired by round; exact: the same from"
        " the scheduler's count of time on the CPU rather than /proc's tick samples (below)."
        " Pacer / client: the C"
        " ones (native) or the Python ones (`python -m bench.pacer --step`, `bench.streams`)."
        " SGLang's gateways relay at n = 1 only: they pass `n` through to a server of one choice"
        " per request, which refuses it with a 400, as LiteLLM does.",
        *table([("streams x step", "group", ""), ("pacer / client", "shape", ""),
                ("contender", "contender", ""),
                ("CPU µs / chunk", "cpu_us_per_chunk", "{:.1f}"),
                ("CPU over nginx", "cpu_vs_nginx", "{:.2f}x"),
                ("over sglang-router", "cpu_vs_sgl", "{:.2f}x"),
                ("exact µs / chunk", "exact_us_per_chunk", "{:.1f}"),
                ("exact over nginx", "exact_vs_nginx", "{:.2f}x"),
                ("cores", "proxy_cores", "{:.2f}"), ("delivered", "delivered", "{:.1%}"),
                ("added p50 / p99 ms", "added_ms", "{:+.1f}"),
                ("added p99 over nginx", "p99_vs_nginx", "{:.2f}x"),
                ("not started", "not_started", "")], rows),
        "",
        "Per relayed chunk, from /proc over the window (medians), and what the load tools"
        " themselves used: read(2) and write(2) calls (uvloop reads a socket with read(2);"
        " nginx and the Rust gateways read with recv(2), which /proc does not count, so their"
        " reads show as 0), wake-ups (voluntary context switches: one per sleep of the event"
        " loop) and preemptions (involuntary ones), and its CPU in user and in system (kernel)"
        " time, summed over the contender's processes, as /proc samples them (the task running"
        " at each tick of the kernel's clock is charged the whole tick), and exactly (the"
        " scheduler's time on the CPU, /proc/PID/task/TID/schedstat); the client's and the"
        " pacer's own CPU in cores.",
        *table([("streams x step", "group", ""), ("pacer / client", "shape", ""),
                ("contender", "contender", ""), ("reads", "reads_per_chunk", "{:.2f}"),
                ("writes", "writes_per_chunk", "{:.2f}"),
                ("wake-ups", "wakeups_per_chunk", "{:.3f}"),
                ("preempted", "preempted_per_chunk", "{:.3f}"),
                ("user µs", "user_us_per_chunk", "{:.1f}"),
                ("system µs", "system_us_per_chunk", "{:.1f}"),
                ("exact µs", "exact_us_per_chunk", "{:.1f}"),
                ("client cores", "client_cores", "{:.2f}"),
                ("pacer cores", "pacer_cores", "{:.2f}")], tools),
        *_configs(data),
    ]  # fmt: skip


def _configs(data: Row) -> list[str]:
    """nginx's configuration as it ran, and the gateways' command lines."""
    out = []
    if conf := data.get("nginx_conf"):
        out += ["", "nginx's configuration (the last one started; each differs only in its"
                " paths and ports):", "", "```nginx", conf.rstrip(), "```"]  # fmt: skip
    for gateway, argv in (data.get("gateways") or {}).items():
        out += ["", f"{gateway}: `{cell(argv)}`"]
    return out


MANYSTREAM = Scenario(
    "manystream", "Many paced streams", _run, _render, _targets,
    full={"rounds": 1, "seconds": 5.0, "streams": (200, 1000)},
    smoke={"seconds": 0.5, "streams": (8,)},
)  # fmt: skip
