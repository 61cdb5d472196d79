"""Fan-out: n-proxy fanning n out to the n=1 demo backend against the backend answering n itself;
the ratio is n-proxy's req/s over native's, paired by round."""

from collections.abc import Sequence

from bench.report import Column, Row, Target, pick, table, target
from bench.scenario import PROXY, Context, Scenario
from bench.scenarios.passthrough import measure
from bench.stack import start_backend
from bench.stats import grouped, median, medians, over, paired, ratio
from bench.workload import chat_request

NATIVE = "native"
GOAL_N = 8


def _run(ctx: Context) -> Row:
    backend = start_backend(ctx.fleet)
    native = start_backend(ctx.fleet, native_n=True, name="backend-native")
    proxies = ctx.proxies(backend.url)
    ctx.ready({"backend": backend})
    targets = ctx.ready({NATIVE: native, **proxies})
    c = ctx.options.concurrency[0]
    cases = [{"n": n, "stream": s, "concurrency": c} for s in (False, True) for n in ctx.options.n]
    # The backend that does the generating: the n=1 one behind n-proxy, or native.
    data = measure(
        ctx, targets, lambda name, case: chat_request(case["n"], stream=case["stream"]), cases,
        lambda name: native if name == NATIVE else backend,
    )  # fmt: skip
    return {"runs": data["runs"], "summary": summarize(data["runs"])}


def summarize(rows: Sequence[Row]) -> list[Row]:
    """Medians per (n, stream, contender); the ratio to native paired by round; and the
    backend-bound ceiling: the ratio a proxy costing nothing would reach, from the backend CPU
    one native n-choice request takes over what its n single-choice requests take."""
    summary: list[Row] = []
    for (n, stream, name), mine in grouped(rows, "n", "stream", "target"):
        case = [r for r in rows if (r["n"], r["stream"]) == (n, stream)]
        native = [r for r in case if r["target"] == NATIVE]
        summary.append({
            "n": n, "stream": stream, "target": name, "errors": sum(r["errors"] for r in mine),
            "ratio": median(paired(case, "target", name, NATIVE, over("rps"))),
            "backend_ceiling": ratio(_backend_cpu(native), _backend_cpu(mine)),
            # Cores busy: is the proxy or the backend the bottleneck? (native: no proxy)
            "proxy_cores": 0.0 if name == NATIVE else median(r["cores"] for r in mine),
            **medians(mine, "rps", "p50_ms", "backend_cores", "other_load_cores", "steal_cores"),
        })  # fmt: skip
    return summary


def _backend_cpu(rows: Sequence[Row]) -> float:
    """Median backend CPU per request (cores over req/s)."""
    return median(r["backend_cores"] / r["rps"] for r in rows if r["rps"])


COLUMNS: list[Column] = [
    ("n", "n", ""), ("stream", "stream", ""), ("contender", "target", ""),
    ("req/s", "rps", "{:,.0f}"), ("over native", "ratio", "{:.0%}"),
    ("backend-bound ceiling", "backend_ceiling", "{:.0%}"), ("p50 ms", "p50_ms", "{:.3f}"),
    ("proxy cores", "proxy_cores", "{:.2f}"), ("its backend's cores", "backend_cores", "{:.2f}"),
    ("errors", "errors", ""), ("other load, cores", "other_load_cores", "{:.2f}"),
    ("steal, cores", "steal_cores", "{:.2f}"),
]  # fmt: skip


def _render(data: Row) -> list[str]:
    return [
        f"Concurrency {data['options']['concurrency'][0]}. Backend-bound ceiling: the ratio even a"
        " proxy costing nothing would reach (the demo backend's cost is mostly per request).",
        *table(COLUMNS, data["summary"]),
    ]


def _targets(data: Row) -> list[Target]:
    def at(stream: bool) -> object:
        return pick(data["summary"], n=GOAL_N, stream=stream, target=PROXY).get("ratio")

    what = f"fan-out vs native, n={GOAL_N}"
    return [
        target(what + ", non-streaming", at(False), ">=", 0.8, "{:.0%}"),
        target(what + ", streaming", at(True), ">=", 0.8, "{:.0%}"),
    ]


FANOUT = Scenario(
    "fanout", "Fan-out vs native n", _run, _render, _targets,
    full={"rounds": 3, "seconds": 2.0, "concurrency": (16,), "n": (1, 2, 4, 8, 10)},
    smoke={"seconds": 0.2, "concurrency": (4,), "n": (2,)},
)  # fmt: skip
