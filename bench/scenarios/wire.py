"""Wire cost: the passthrough loop against a canned upstream that costs next to nothing (nginx's
``return``, else ``bench.pacer --canned``), with the lean forwarder and n-proxy fan-out n=4 too."""

from bench.report import Row, Target, pick, table, target
from bench.scenario import PROXY, Context, Scenario
from bench.scenarios import passthrough
from bench.scenarios.passthrough import COLUMNS, DIRECT, FORWARDER, baseline_table, versus
from bench.stack import start_canned, start_forwarder, start_nginx
from bench.stats import NAN, median, ratio
from bench.workload import chat_request

FANOUT_N = 4
FANOUT = f"{PROXY} n={FANOUT_N}"
LEAN = "lean forwarder"  # the aiohttp forwarder on n-proxy's own client: the floor under n-proxy


def _run(ctx: Context) -> Row:
    canned = start_canned(ctx.fleet, ctx.work, ctx.tools.nginx)
    targets = ctx.ready({DIRECT: canned})
    if ctx.tools.nginx:
        targets["nginx"] = start_nginx(ctx.fleet, ctx.work, ctx.tools.nginx, canned)
    if ctx.wants("forwarder"):
        targets[FORWARDER] = start_forwarder(ctx.fleet, canned)
    if ctx.wants("lean"):
        targets[LEAN] = start_forwarder(ctx.fleet, canned, lean=True)
    fanouts = {}  # each n-proxy a second time, as a contender sent n = FANOUT_N
    for label, server in ctx.proxies(canned.url).items():
        targets[label] = fanouts[f"{label} n={FANOUT_N}"] = server
    data = passthrough.measure(
        ctx, ctx.ready(targets | fanouts),
        lambda name, case: chat_request(FANOUT_N if name in fanouts else 1),
    )  # fmt: skip
    return {"upstream": canned.name, **data, "summary": passthrough.summarize(data["runs"])}


def _levels(data: Row) -> tuple[int, int]:
    levels = sorted({r["concurrency"] for r in data["runs"]})
    return levels[0], levels[-1]


def _render(data: Row) -> list[str]:
    high, rows, n = _levels(data)[1], data["runs"], FANOUT_N

    def rps(a: str, b: str) -> float:
        return median(versus(rows, a, b, high))

    def cpu(a: str, b: str, per: int = 1) -> float:
        mine, theirs = (pick(data["summary"], target=t, concurrency=high) for t in (a, b))
        return ratio(mine.get("cpu_us_per_req"), per * theirs.get("cpu_us_per_req", NAN))

    others = [
        ("n-proxy pass-through CPU/req over the aiohttp forwarder's", cpu(PROXY, FORWARDER)),
        ("n-proxy pass-through CPU/req over nginx's", cpu(PROXY, "nginx")),
        ("n-proxy pass-through CPU/req over the lean forwarder's", cpu(PROXY, LEAN)),
        ("lean forwarder req/s over the aiohttp forwarder's", rps(LEAN, FORWARDER)),
        ("n-proxy req/s over nginx's", rps(PROXY, "nginx")),
        (f"fan-out n={n} CPU per child over pass-through CPU/req", cpu(FANOUT, PROXY, n)),
        (f"fan-out n={n} CPU per child over the forwarder's CPU/req", cpu(FANOUT, FORWARDER, n)),
    ]
    summary = [
        {**r, "children_per_s": n * r["rps"] if r["target"].endswith(f"n={n}") else None}
        for r in data["summary"]
    ]
    columns = [*COLUMNS[:3], ("children/s", "children_per_s", "{:,.0f}"), *COLUMNS[3:]]
    columns.insert(-3, ("upstream CPU µs/req", "backend_cpu_us_per_req", "{:,.0f}"))
    return [
        f"Upstream: {data['upstream']}. Ratios at c={high}, of req/s paired by round, of CPU per"
        " request from /proc (each contender's own processes).",
        *table(
            [("ratio", "what", ""), ("measured", "value", "{:.2f}x")],
            [{"what": w, "value": v} for w, v in others],
        ),
        *table(columns, summary),
        *baseline_table(data["summary"]),
    ]


def _targets(data: Row) -> list[Target]:
    (low, high), rows = _levels(data), data["runs"]
    added = pick(data["summary"], target=PROXY, concurrency=low).get("added_p50_ms")
    children = FANOUT_N * median(versus(rows, FANOUT, PROXY, high))
    return [
        target(f"n-proxy pass-through req/s over the aiohttp forwarder's (c={high})",
               median(versus(rows, PROXY, FORWARDER, high)), ">=", 1.5, "{:.2f}x"),
        target(f"n-proxy pass-through added p50 (c={low})", added, "<=", 0.25, "{:.3f} ms"),
        target(f"fan-out n={FANOUT_N} children/s over pass-through req/s (c={high})", children,
               ">=", 2, "{:.2f}x"),
    ]  # fmt: skip


SCENARIO = Scenario(
    "wire", "Wire cost against a canned upstream", _run, _render, _targets,
    full={"rounds": 5, "seconds": 3.0, "concurrency": (1, 16)},
    smoke={"seconds": 0.3, "concurrency": (2,)},
)  # fmt: skip
