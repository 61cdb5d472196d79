"""Stitching: long n=8 streams back to back at saturation; SSE chunks/s, and n-proxy's CPU per
chunk from /proc (what one core of it stitches)."""

import asyncio
import time

import aiohttp
import orjson

from bench.procs import Server
from bench.report import Column, Row, Target, pick, say, table, target
from bench.scenario import PROXY, Context, Scenario
from bench.stack import start_backend
from bench.stats import grouped, median, medians, ratio
from bench.workload import CHAT_PATH, chat_body, client, read_stream, run_async, stream_events

SAMPLE_EVERY = 0.5  # seconds between RSS samples (at least)
REQUEST_BUDGET = 10_000  # per round: a bound far above what the time allows
SHOWN = ("chunks_per_s", "cpu_us_per_chunk", "errors")


async def _round(
    session: aiohttp.ClientSession, proxy: Server, body: bytes, expected: int, ctx: Context
) -> Row:
    events = errors = done = 0
    before = proxy.sample()
    samples = [before]  # growth is against this one, taken before any stream of the round

    async def worker() -> None:
        nonlocal events, errors, done
        while time.perf_counter() < deadline and done + errors < REQUEST_BUDGET:
            timing = await read_stream(session, proxy.url + CHAT_PATH, body)
            if timing.status == 200 and timing.events == expected:
                done += 1
                events += timing.events
            else:
                errors += 1
            if time.monotonic() - samples[-1].at >= SAMPLE_EVERY:  # the others still streaming
                samples.append(proxy.sample())

    start = time.perf_counter()
    deadline = start + ctx.options.seconds
    await asyncio.gather(*(worker() for _ in range(ctx.options.concurrency[0])))
    wall = time.perf_counter() - start
    cpu = proxy.sample().cpu_seconds - before.cpu_seconds
    rss = [s.rss_bytes for s in samples]
    return {
        "requests": done, "errors": errors, "chunks": events, "seconds": wall,
        "chunks_per_s": events / wall, "proxy_cpu_s": cpu, "proxy_cpu_share": cpu / wall,
        "cpu_us_per_chunk": cpu / events * 1e6 if events else float("nan"),
        "rss_growth_kib": (max(rss) - rss[0]) // 1024,
    }  # fmt: skip


async def _measure(ctx: Context, proxies: dict[str, Server]) -> Row:
    o = ctx.options
    body = orjson.dumps(chat_body(o.n[0], stream=True, max_tokens=o.max_tokens))
    expected = stream_events(o.n[0], o.max_tokens)
    rows: list[Row] = []
    async with client(120, limit=o.concurrency[0]) as session:
        for proxy in proxies.values():
            await read_stream(session, proxy.url + CHAT_PATH, body)  # warm-up
        for turn in range(o.rounds):
            for label, proxy in proxies.items():
                rows.append({"round": turn, "proxy": label})
                rows[-1] |= await _round(session, proxy, body, expected, ctx)
                say(f"stitching round {turn} {label}", rows[-1], *SHOWN)
    summary = []
    for (label,), mine in grouped(rows, "proxy"):
        cpu = median(r["cpu_us_per_chunk"] for r in mine)
        # chunks_per_cpu_s: what one fully busy core of proxy would stitch.
        summary.append({
            "proxy": label, **medians(mine, "chunks_per_s", "cpu_us_per_chunk"),
            "chunks_per_cpu_s": ratio(1e6, cpu), "errors": sum(r["errors"] for r in mine),
            "rss_growth_kib": max(r["rss_growth_kib"] for r in mine),
        })  # fmt: skip
    return {"events_per_request": expected, "runs": rows, "summary": summary}


def _run(ctx: Context) -> Row:
    backend = start_backend(ctx.fleet)
    proxies = ctx.proxies(backend.url)
    ctx.ready({"backend": backend})
    return run_async(_measure(ctx, ctx.ready(proxies)))


COLUMNS: list[Column] = [
    ("proxy", "proxy", ""), ("chunks/s through the proxy", "chunks_per_s", "{:,.0f}"),
    ("proxy CPU µs/chunk", "cpu_us_per_chunk", "{:.2f}"),
    ("chunks per proxy CPU-second", "chunks_per_cpu_s", "{:,.0f}"), ("errors", "errors", ""),
    ("RSS growth KiB", "rss_growth_kib", "{:,}"),
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
    proxy = pick(data["summary"], proxy=PROXY)
    what = "stitching, chunks per proxy CPU-second (one core)"
    return [target(what, proxy.get("chunks_per_cpu_s"), ">=", 50_000, "{:,.0f}/s")]


SCENARIO = Scenario(
    "stitching", "Stitching long streams", _run, _render, _targets,
    full={"rounds": 3, "seconds": 8.0, "concurrency": (4,), "n": (8,), "max_tokens": 1024},
    smoke={"seconds": 0.3, "concurrency": (2,), "max_tokens": 32},
)  # fmt: skip
