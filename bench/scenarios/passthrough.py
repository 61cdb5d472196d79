"""n=1 pass-through, non-streaming, at fixed concurrency: every contender in each round, direct to
the upstream as the limit. ``passthrough`` runs in front of the demo backend; ``wire`` in front of
a canned upstream that costs next to nothing (nginx's ``return``, else ``python -m bench.pacer``),
with the lean forwarder, the httptools floor and n-proxy fan-out n=4 too. SGLang's Rust gateways
(sglang-router, smg) run in both, when installed. ``measure`` is every closed loop's."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request as UrlRequest
from urllib.request import urlopen

import orjson

from bench import stack
from bench.procs import CpuWatch, Server, wakeups
from bench.report import Column, Row, missing, pick, say, table, target
from bench.scenario import BASELINE, PROXY, Context, Scenario
from bench.stack import GATEWAYS
from bench.stats import grouped, median, medians, minus, paired, quartiles, ratio
from bench.workload import HEADERS, Request, chat_request

DIRECT = "direct"
FORWARDER = "aiohttp forwarder"
LEAN = "lean forwarder"  # the aiohttp forwarder on n-proxy's own client: aiohttp's server and it
FLOOR = "httptools floor"  # n-proxy's client behind a bare httptools protocol: no server framework
# n-proxy with no line per request (log_level: warning), as the gateways run (--log-level error):
# shown beside them (wire), never in place of n-proxy as users run it, which the goals judge.
QUIET = f"{PROXY} quiet"
FANOUT_N = 4  # wire: each n-proxy a second time, as a contender sent n = FANOUT_N
FANOUT = f"{PROXY} n={FANOUT_N}"
HEADLINE = 16  # the concurrency the goals are stated at
SGL = "sglang-router"  # the Rust gateway the goals name


def check(name: str, server: Server, request: Request) -> int:
    """A contender must answer correctly before it is timed: choices 0 to n-1, with usage (in a
    stream: every index, and one ``[DONE]``). Returns n."""
    sent = orjson.loads(request.body)
    n = int(sent.get("n", 1))
    try:
        with urlopen(UrlRequest(server.url + request.path, request.body, HEADERS), timeout=30) as r:
            status, raw = r.status, r.read()
    except HTTPError as error:  # not 2xx
        status, raw = error.code, error.read()
    if sent.get("stream"):
        events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line[:7] == b"data: {"]
        indexes = sorted({c["index"] for e in events for c in e.get("choices") or ()})
        ok = raw.count(b"data: [DONE]") == 1
    else:
        body: Any = orjson.loads(raw) if status == 200 else None
        ok = isinstance(body, dict) and "usage" in body
        indexes = [c.get("index") for c in body.get("choices") or ()] if ok else []
    if status != 200 or not ok or indexes != list(range(n)):
        raise RuntimeError(f"{name}: bad answer to the n={n} request ({status}): {raw[:300]!r}")
    return n


def measure(
    ctx: Context, targets: Mapping[str, Server],
    request: Callable[[str, Row], Request] = lambda name, case: chat_request(),
    cases: Sequence[Row] = (), backend: Callable[[str], Server] | None = None,
) -> Row:  # fmt: skip
    """Rounds of every contender in every case (its ``concurrency``, and what ``request`` reads
    in it: what the contender is sent; default: each --concurrency), each with the CPU its own
    processes and the backend doing its work (``backend`` of the contender; default: direct)
    used per request."""
    cases = cases or [{"concurrency": c} for c in ctx.options.concurrency]
    checked = {}
    for name, server in targets.items():
        for sent in dict.fromkeys(request(name, case) for case in cases):
            checked[name] = check(name, server, sent)
    for name in targets if ctx.options.warm_up else ():  # connection pools, lazy imports, caches
        ctx.loader.run(targets[name].url, request(name, cases[-1]), cases[-1]["concurrency"])

    def one(name: str, case: Row) -> Row:
        slept = wakeups(targets[name])
        watch = CpuWatch(ctx.fleet.servers)
        result = ctx.loader.run(targets[name].url, request(name, case), case["concurrency"])
        cpu = watch.stop()
        slept = wakeups(targets[name]) - slept
        us = 1e6 / result["rps"] if result["rps"] else 0.0
        upstream = backend(name) if backend else targets[DIRECT]
        own, behind = (cpu.by_server.get(s.name, 0.0) for s in (targets[name], upstream))
        row = {
            **result, "cores": own, "backend_cores": behind,
            "cpu_us_per_req": own * us, "backend_cpu_us_per_req": behind * us,
            "wakeups_per_req": slept / result["requests"] if result["requests"] else 0.0,
            "other_load_cores": cpu.foreign, "steal_cores": cpu.steal,
        }  # fmt: skip
        what = " ".join([*(f"{k}={v}" for k, v in case.items()), name])
        say(f"{ctx.work.name} {what}", row, "rps", "p50_ms", "p99_ms", "errors",
            "other_load_cores", "steal_cores")  # fmt: skip
        return row

    return {"runs": ctx.rounds(targets, cases, one), "checked": checked}


def versus(
    rows: Sequence[Row], name: str, base: str, c: int, key: str = "rps",
    op: Callable[[Any, Any], float] = ratio,
) -> list[float]:  # fmt: skip
    """Per round at concurrency ``c``: ``value`` of ``name``'s row and ``base``'s."""
    return paired([r for r in rows if r["concurrency"] == c], "target", name, base, key, op)


def summarize(rows: Sequence[Row]) -> list[Row]:
    """Medians per contender and concurrency; added latency against direct in the same round, and
    req/s and CPU per request against the baseline's (quartiles) when there is one."""
    summary: list[Row] = []
    for (c, name), mine in grouped(rows, "concurrency", "target"):
        row = {
            "target": name,
            "concurrency": c,
            **medians(
                mine,
                "rps",
                "p50_ms",
                "p99_ms",
                "cpu_us_per_req",
                "backend_cpu_us_per_req",
                "wakeups_per_req",
            ),
            "rps_vs_direct": median(versus(rows, name, DIRECT, c)),
            "added_p50_ms": median(versus(rows, name, DIRECT, c, "p50_ms", minus)),
            "added_p99_ms": median(versus(rows, name, DIRECT, c, "p99_ms", minus)),
            "errors": sum(r["errors"] for r in mine),
            **medians(mine, "other_load_cores", "steal_cores"),
        }
        if name.endswith(f" n={FANOUT_N}"):  # wire's fan-out: children per second too
            row["children_per_s"] = FANOUT_N * row["rps"]
        base = name.replace(PROXY, BASELINE, 1)
        if base != name and any(r["target"] == base for r in rows):
            row["baseline"] = base
            row["rps_vs_baseline"] = quartiles(versus(rows, name, base, c))
            row["cpu_vs_baseline"] = quartiles(versus(rows, name, base, c, "cpu_us_per_req"))
        summary.append(row)
    return summary


COLUMNS: list[Column] = [
    ("contender", "target", ""), ("concurrency", "concurrency", ""), ("req/s", "rps", "{:,.0f}"),
    ("vs direct", "rps_vs_direct", "{:.0%}"), ("p50 ms", "p50_ms", "{:.3f}"),
    ("p99 ms", "p99_ms", "{:.3f}"), ("added p50 ms", "added_p50_ms", "{:+.3f}"),
    ("added p99 ms", "added_p99_ms", "{:+.3f}"), ("own CPU µs/req", "cpu_us_per_req", "{:,.0f}"),
    ("upstream CPU µs/req", "backend_cpu_us_per_req", "{:,.0f}"),
    ("wake-ups/req", "wakeups_per_req", "{:.2f}"), ("errors", "errors", ""),
    ("other load, cores", "other_load_cores", "{:.2f}"), ("steal, cores", "steal_cores", "{:.2f}"),
]  # fmt: skip
NOTE = (
    "Added latency is paired by round (contender minus direct in the same round), then the"
    " median. Wake-ups: the contender's voluntary context switches per request, every thread"
    " (one each time its event loop, or a Tokio worker, sleeps and is woken). Other load: CPU"
    " used by processes that are not the bench; steal: CPU the hypervisor gave to other"
    " machines. Both should be near 0 for clean numbers."
)


def baseline_table(summary: Sequence[Row]) -> list[str]:
    """This tree's n-proxy over the baseline's, per round, then the median (and quartiles)."""

    def spread(q: Sequence[float]) -> str:
        return f"{q[1]:.3f}x ({q[0]:.3f}-{q[2]:.3f})"

    rows = [
        {**r, "rps_q": spread(r["rps_vs_baseline"]), "cpu_q": spread(r["cpu_vs_baseline"])}
        for r in summary
        if "baseline" in r
    ]
    return [] if not rows else [
        "", "Against the baseline, paired by round (a shared machine's load moves both alike"
        " within a round): the median over rounds, and the first to third quartile.",
        *table([("contender", "target", ""), ("over", "baseline", ""),
                ("concurrency", "concurrency", ""), ("req/s", "rps_q", ""),
                ("own CPU µs/req", "cpu_q", "")], rows),
    ]  # fmt: skip


def _run(ctx: Context, upstream: Server, wire: bool = False) -> Row:
    """Every contender in front of ``upstream``: the demo backend, with n-proxy --workers and
    LiteLLM, or (``wire``) the canned upstream, with the lean forwarder, the httptools floor and
    the fan-out too."""
    fleet, work, tools, count = ctx.fleet, ctx.work, ctx.tools, ctx.options.workers
    contenders = {DIRECT: upstream}
    if tools.nginx:
        contenders["nginx"] = stack.start_nginx(fleet, work, tools.nginx, upstream)
    if ctx.wants("forwarder"):
        contenders[FORWARDER] = stack.start_forwarder(fleet, upstream)
    if wire and ctx.wants("lean"):
        contenders[LEAN] = stack.start_forwarder(fleet, upstream, "lean")
    if wire and ctx.wants("floor"):
        contenders[FLOOR] = stack.start_forwarder(fleet, upstream, "floor")
    proxies = ctx.proxies(upstream.url)
    fanning = wire and ctx.wants("fanout")
    fanouts = (
        {f"{label} n={FANOUT_N}": server for label, server in proxies.items()} if fanning else {}
    )
    contenders |= proxies | fanouts
    if wire and ctx.wants("quiet"):
        quiet = stack.PROXY_CONFIG + "log_level: warning\n"
        contenders[QUIET] = stack.start_proxy(fleet, work, upstream.url, QUIET, config=quiet)
    workers = f"{PROXY} x{count}"
    if not wire and count > 1:
        contenders[workers] = stack.start_proxy(fleet, work, upstream.url, workers, workers=count)
    if not wire and tools.litellm:
        contenders["litellm"] = stack.start_litellm(fleet, work, tools.litellm, upstream)
    for kind, binary in tools.gateways.items():
        contenders[kind] = stack.start_gateway(fleet, kind, binary, upstream)
    optional = {"nginx", FORWARDER, LEAN, FLOOR, QUIET, workers, "litellm", *GATEWAYS}
    up = ctx.ready(contenders, optional)
    data = measure(ctx, up, lambda name, case: chat_request(FANOUT_N if name in fanouts else 1))
    return {"upstream": upstream.name, **data, "summary": summarize(data["runs"])}


def _levels(data: Row) -> tuple[int, int]:
    """The lowest concurrency run, and the one to compare at: HEADLINE, else the highest."""
    levels = sorted({r["concurrency"] for r in data["runs"]})
    return levels[0], HEADLINE if HEADLINE in levels else levels[-1]


def _render(data: Row) -> list[str]:
    """The ratios that were measured, at the concurrency to compare at; every contender's row."""
    high, rows, n = _levels(data)[1], data["runs"], FANOUT_N

    def rps(a: str, b: str) -> float:
        return median(versus(rows, a, b, high))

    def cpu(a: str, b: str, per: int = 1, c: int = high) -> float:
        mine, theirs = (pick(data["summary"], target=t, concurrency=c) for t in (a, b))
        return ratio(mine.get("cpu_us_per_req"), theirs.get("cpu_us_per_req")) / per

    levels = dict.fromkeys((high, _levels(data)[0]))  # c=16 first, then c=1
    gateways = [(f"n-proxy pass-through CPU/req over {g}'s (c={c})", cpu(PROXY, g, c=c))
                for g in GATEWAYS for c in levels]  # fmt: skip
    # Like for like: the gateways log no line per request.
    gateways += [(f"{QUIET} (no request log) CPU/req over {g}'s (c={c})", cpu(QUIET, g, c=c))
                 for g in GATEWAYS for c in levels]  # fmt: skip
    ratios = [
        ("n-proxy pass-through CPU/req over the aiohttp forwarder's", cpu(PROXY, FORWARDER)),
        ("n-proxy pass-through CPU/req over nginx's", cpu(PROXY, "nginx")),
        ("n-proxy pass-through CPU/req over the lean forwarder's", cpu(PROXY, LEAN)),
        ("lean forwarder req/s over the aiohttp forwarder's", rps(LEAN, FORWARDER)),
        ("n-proxy pass-through CPU/req over the httptools floor's", cpu(PROXY, FLOOR)),
        ("lean forwarder CPU/req over the httptools floor's", cpu(LEAN, FLOOR)),
        *[
            (f"httptools floor CPU/req over sglang-router's (c={c})", cpu(FLOOR, SGL, c=c))
            for c in levels
        ],
        ("n-proxy req/s over nginx's", rps(PROXY, "nginx")),
        (f"fan-out n={n} CPU per child over pass-through CPU/req", cpu(FANOUT, PROXY, n)),
        (f"fan-out n={n} CPU per child over the forwarder's CPU/req", cpu(FANOUT, FORWARDER, n)),
        *gateways,
    ]
    columns = list(COLUMNS)
    if any("children_per_s" in r for r in data["summary"]):
        columns.insert(3, ("children/s", "children_per_s", "{:,.0f}"))
    return [
        f"Upstream: {data.get('upstream', 'backend')}. Ratios at c={high}, of req/s paired by"
        " round, of CPU per request from /proc (each contender's own processes).",
        *table(
            [("ratio", "what", ""), ("measured", "value", "{:.2f}x")],
            [{"what": w, "value": v} for w, v in ratios if not missing(v)],
        ),
        *table(columns, data["summary"]),
        "",
        NOTE,
        *baseline_table(data["summary"]),
    ]


def _targets(data: Row) -> list[Row]:
    rows, summary, c = data["runs"], data["summary"], HEADLINE
    proxy, at = pick(summary, target=PROXY, concurrency=c), f" (n=1, c={c})"
    low = pick(summary, target=PROXY, concurrency=1).get("added_p50_ms")

    def vs(other: str) -> float:
        return median(versus(rows, PROXY, other, c))

    return [
        target("added p50 latency" + at, proxy.get("added_p50_ms"), "<=", 0.3, "{:.3f} ms"),
        target("added p99 latency" + at, proxy.get("added_p99_ms"), "<=", 1.0, "{:.3f} ms"),
        target("throughput vs direct" + at, proxy.get("rps_vs_direct"), ">=", 0.5, "{:.0%}"),
        target("throughput vs LiteLLM" + at, vs("litellm"), ">=", 5, "{:.1f}x"),
        target("throughput vs nginx" + at, vs("nginx"), ">=", 0.5, "{:.2f}x"),
        target("throughput vs the aiohttp forwarder" + at, vs(FORWARDER), ">=", 1.5, "{:.2f}x"),
        target("added p50 latency (n=1, c=1)", low, "<=", 0.25, "{:.3f} ms"),
        *gateway_targets(data, "demo backend"),
    ]


def gateway_targets(data: Row, upstream: str) -> list[Row]:
    """n-proxy's pass-through against sglang-router's, each paired by round: CPU per request
    at concurrency 1 and 16, and p50 at concurrency 1 (n-proxy's minus sglang-router's: the
    same as their added p50s' difference, direct's p50 cancelling)."""
    rows = data["runs"]
    out = [
        target(f"n-proxy CPU/req over sglang-router's (c={c}, {upstream})",
               median(versus(rows, PROXY, SGL, c, "cpu_us_per_req")), "<=", 1.0, "{:.2f}x")
        for c in (1, HEADLINE)
    ]  # fmt: skip
    p50 = median(versus(rows, PROXY, SGL, 1, "p50_ms", minus))
    what = f"n-proxy added p50 minus sglang-router's (c=1, {upstream})"
    return [*out, target(what, p50, "<=", 0.0, "{:+.3f} ms")]


def _wire_targets(data: Row) -> list[Row]:
    """At the lowest concurrency run and the one to compare at (1 and 16 but in a smoke run)."""
    (low, high), rows = _levels(data), data["runs"]
    added = pick(data["summary"], target=PROXY, concurrency=low).get("added_p50_ms")
    children = FANOUT_N * median(versus(rows, FANOUT, PROXY, high))
    return [
        target(f"n-proxy pass-through req/s over the aiohttp forwarder's (c={high})",
               median(versus(rows, PROXY, FORWARDER, high)), ">=", 1.5, "{:.2f}x"),
        target(f"n-proxy pass-through added p50 (c={low})", added, "<=", 0.25, "{:.3f} ms"),
        target(f"fan-out n={FANOUT_N} children/s over pass-through req/s (c={high})", children,
               ">=", 2, "{:.2f}x"),
        *gateway_targets(data, "canned upstream"),
    ]  # fmt: skip


PASSTHROUGH = Scenario(
    "passthrough", "n=1 pass-through, non-streaming, against the demo backend",
    lambda ctx: _run(ctx, stack.start_backend(ctx.fleet)), _render, _targets,
    full={"rounds": 5, "seconds": 3.0, "concurrency": (1, 16, 64)},
    smoke={"seconds": 0.2, "concurrency": (4,)},
)  # fmt: skip
WIRE = Scenario(
    "wire", "Wire cost against a canned upstream",
    lambda ctx: _run(ctx, stack.start_canned(ctx.fleet, ctx.work, ctx.tools.nginx), wire=True),
    _render, _wire_targets, full={"rounds": 5, "seconds": 3.0, "concurrency": (1, 16)},
    smoke={"seconds": 0.3, "concurrency": (2,)},
)  # fmt: skip
