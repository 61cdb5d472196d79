"""Stitching: long n=8 streams back to back at saturation, driven by the load generator as every
closed loop here is; SSE chunks/s (streams/s times the chunks in each checked stream) and
n-proxy's CPU per chunk from /proc (what one core of it stitches)."""

from bench.report import Column, Row, Target, pick, table, target
from bench.scenario import PROXY, Context, Scenario
from bench.scenarios.passthrough import measure
from bench.stack import start_backend
from bench.stats import grouped, median, ratio
from bench.workload import chat_request, stream_events


def _run(ctx: Context) -> Row:
    o = ctx.options
    backend = start_backend(ctx.fleet)
    proxies = ctx.proxies(backend.url)
    ctx.ready({"backend": backend})
    request = chat_request(o.n[0], stream=True, max_tokens=o.max_tokens)
    data = measure(ctx, ctx.ready(proxies), lambda name, case: request, backend=lambda _: backend)
    chunks = stream_events(o.n[0], o.max_tokens)  # in every stream: measure checked one
    summary = []
    for (name,), mine in grouped(data["runs"], "target"):
        cpu = median(r["cpu_us_per_req"] for r in mine) / chunks
        # chunks_per_cpu_s: what one fully busy core of proxy would stitch.
        summary.append({
            "target": name, "chunks_per_s": chunks * median(r["rps"] for r in mine),
            "cpu_us_per_chunk": cpu, "chunks_per_cpu_s": ratio(1e6, cpu),
            "errors": sum(r["errors"] for r in mine),
        })  # fmt: skip
    return {"events_per_request": chunks, **data, "summary": summary}


COLUMNS: list[Column] = [
    ("proxy", "target", ""), ("chunks/s through the proxy", "chunks_per_s", "{:,.0f}"),
    ("proxy CPU µs/chunk", "cpu_us_per_chunk", "{:.2f}"),
    ("chunks per proxy CPU-second", "chunks_per_cpu_s", "{:,.0f}"), ("errors", "errors", ""),
]  # fmt: skip


def _render(data: Row) -> list[str]:
    o = data["options"]
    return [
        f"n={o['n'][0]} streams of {o['max_tokens']} tokens per choice, {o['concurrency'][0]} at a"
        " time.",
        *table(COLUMNS, data["summary"]),
        "",
        "Chunks/s through the proxy is bounded by the demo backend generating them on the same"
        " cores; chunks per proxy CPU-second is what one core of proxy sustains.",
    ]


def _targets(data: Row) -> list[Target]:
    proxy = pick(data["summary"], target=PROXY)
    what = "stitching, chunks per proxy CPU-second (one core)"
    return [target(what, proxy.get("chunks_per_cpu_s"), ">=", 50_000, "{:,.0f}/s")]


STITCHING = Scenario(
    "stitching", "Stitching long streams", _run, _render, _targets,
    full={"rounds": 3, "seconds": 8.0, "concurrency": (4,), "n": (8,), "max_tokens": 1024},
    smoke={"seconds": 0.3, "concurrency": (2,), "max_tokens": 32},
)  # fmt: skip
