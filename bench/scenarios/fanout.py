"""The demo backend's fan-out, two ways: ``fanout``, n-proxy fanning n out to the n=1 backend
against the backend answering n itself (the ratio of req/s, paired by round); ``stitching``, long
n=8 streams back to back at saturation: SSE chunks/s (streams/s times the chunks in each) and
n-proxy's CPU per chunk from /proc (what one core of it stitches)."""

from collections.abc import Sequence

from bench.report import Column, Row, Section, pick, target
from bench.scenario import PROXY, Context, Scenario
from bench.scenarios.passthrough import measure
from bench.stack import start_backend
from bench.stats import grouped, median, medians, paired, ratio
from bench.workload import chat_request, stream_events

NATIVE = "native"
GOAL_N = 8


def _run(ctx: Context, stitching: bool = False) -> Row:
    """Every n and streaming or not, each n-proxy against native n; or (``stitching``) streams
    only, of --max-tokens per choice, through n-proxy alone."""
    o = ctx.options
    backend = start_backend(ctx.fleet)
    native = {} if stitching else {NATIVE: start_backend(ctx.fleet, native_n=True, name="native")}
    proxies = ctx.proxies(backend.url)
    ctx.ready({"backend": backend})
    targets = ctx.ready(native | proxies)
    streams = (True,) if stitching else (False, True)
    cases = [{"n": n, "stream": s, "concurrency": o.concurrency[0]} for s in streams for n in o.n]
    # The backend that does the generating: the n=1 one behind n-proxy, or native.
    data = measure(
        ctx, targets,
        lambda name, case: chat_request(case["n"], stream=case["stream"], max_tokens=o.max_tokens),
        cases, lambda name: native.get(name, backend),
    )  # fmt: skip
    if stitching:
        return {**data, "summary": _chunks(data["runs"], stream_events(o.n[0], o.max_tokens))}
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
            "ratio": median(paired(case, "target", name, NATIVE, "rps")),
            "backend_ceiling": ratio(_backend_cpu(native), _backend_cpu(mine)),
            # Cores busy: is the proxy or the backend the bottleneck? (native: no proxy)
            "proxy_cores": 0.0 if name == NATIVE else median(r["cores"] for r in mine),
            **medians(mine, "rps", "p50_ms", "backend_cores", "other_load_cores", "steal_cores"),
        })  # fmt: skip
    return summary


def _chunks(rows: Sequence[Row], chunks: int) -> list[Row]:
    """Per n-proxy: chunks/s from streams/s (``chunks`` in every stream: measure checked one),
    CPU per chunk, and chunks per CPU-second: what one fully busy core of proxy would stitch."""
    summary = []
    for (name,), mine in grouped(rows, "target"):
        cpu = median(r["cpu_us_per_req"] for r in mine) / chunks
        summary.append({
            "target": name, "chunks_per_s": chunks * median(r["rps"] for r in mine),
            "cpu_us_per_chunk": cpu, "chunks_per_cpu_s": ratio(1e6, cpu),
            "errors": sum(r["errors"] for r in mine),
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


def _targets(data: Row) -> list[Row]:
    def at(stream: bool) -> object:
        return pick(data["summary"], n=GOAL_N, stream=stream, target=PROXY).get("ratio")

    what = f"fan-out vs native, n={GOAL_N}"
    return [
        target(what + ", non-streaming", at(False), ">=", 0.8, "{:.0%}"),
        target(what + ", streaming", at(True), ">=", 0.8, "{:.0%}"),
    ]


FANOUT = Scenario(
    "fanout", "Fan-out vs native n", _run,
    Section(COLUMNS, "Concurrency {options[concurrency][0]}. Backend-bound ceiling: the ratio"
            " even a proxy costing nothing would reach (the demo backend's cost is mostly per"
            " request)."),
    _targets,
    full={"rounds": 3, "seconds": 2.0, "concurrency": (16,), "n": (1, 2, 4, 8, 10)},
    smoke={"seconds": 0.2, "concurrency": (4,), "n": (2,)},
)  # fmt: skip


CHUNK_COLUMNS: list[Column] = [
    ("proxy", "target", ""), ("chunks/s through the proxy", "chunks_per_s", "{:,.0f}"),
    ("proxy CPU µs/chunk", "cpu_us_per_chunk", "{:.2f}"),
    ("chunks per proxy CPU-second", "chunks_per_cpu_s", "{:,.0f}"), ("errors", "errors", ""),
]  # fmt: skip


def _chunk_targets(data: Row) -> list[Row]:
    proxy = pick(data["summary"], target=PROXY)
    what = "stitching, chunks per proxy CPU-second (one core)"
    return [target(what, proxy.get("chunks_per_cpu_s"), ">=", 50_000, "{:,.0f}/s")]


STITCHING = Scenario(
    "stitching", "Stitching long streams", lambda ctx: _run(ctx, stitching=True),
    Section(CHUNK_COLUMNS, "n={options[n][0]} streams of {options[max_tokens]} tokens per choice,"
            " {options[concurrency][0]} at a time.",
            "Chunks/s through the proxy is bounded by the demo backend generating them on the same"
            " cores; chunks per proxy CPU-second is what one core of proxy sustains."),
    _chunk_targets,
    full={"rounds": 3, "seconds": 8.0, "concurrency": (4,), "n": (8,), "max_tokens": 1024},
    smoke={"seconds": 0.3, "concurrency": (2,), "max_tokens": 32},
)  # fmt: skip
