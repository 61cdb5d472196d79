"""TTFT: the merged stream's first token and end against the same n children sent straight to the
backend, one child slow to start and slow; with the fast children at 0 and at 1 ms/token."""

import asyncio
import math
import time

import aiohttp
import orjson

from bench.procs import Server
from bench.report import Column, Row, Section, say, target
from bench.scenario import PROXY, Context, Scenario
from bench.stack import start_backend
from bench.stats import medians
from bench.workload import CHAT_PATH, SEED, StreamTiming, chat_body, client, read_stream, run_async

SLOW_START_S = 0.05  # the slow child's status line this late, as from a server with no free slot
SLOW_TOKEN_S = 0.01
PACED_TOKEN_S = 0.001
SHOWN = ("merged_first_token_ms", "fastest_child_first_token_ms", "merged_total_ms",
         "slowest_child_total_ms")  # fmt: skip


def _bodies(n: int, tokens: int) -> tuple[bytes, list[bytes]]:
    """The n>1 request and its n children as the proxy plans them (seed + i, n dropped)."""
    slow = {"only_seed": SEED + n - 1, "token_delay": SLOW_TOKEN_S, "headers_delay": SLOW_START_S}
    merged = chat_body(n, stream=True, max_tokens=tokens, x_demo=slow)
    children = [
        chat_body(1, stream=True, max_tokens=tokens, seed=SEED + i, x_demo=slow) for i in range(n)
    ]
    return orjson.dumps(merged), [orjson.dumps(c) for c in children]


def _ok(timings: list[StreamTiming]) -> list[StreamTiming]:
    for t in timings:
        if t.status != 200 or math.isnan(t.first_token_at):
            raise RuntimeError(f"stream failed: status {t.status}, {t.events} events")
    return timings


async def _pair(session: aiohttp.ClientSession, proxy: Server, backend: Server,
                bodies: tuple[bytes, list[bytes]], proxy_first: bool) -> Row:  # fmt: skip
    merged_body, child_bodies = bodies

    async def direct() -> list[StreamTiming]:
        started = time.perf_counter()
        children = (read_stream(session, backend.url + CHAT_PATH, b, started) for b in child_bodies)
        return _ok(list(await asyncio.gather(*children)))

    async def merged() -> StreamTiming:
        return _ok([await read_stream(session, proxy.url + CHAT_PATH, merged_body)])[0]

    # Alternate which path goes first, so neither always runs on a cooler machine.
    if proxy_first:
        m, d = await merged(), await direct()
    else:
        d, m = await direct(), await merged()
    first, end = m.first_token_at * 1e3, m.end_at * 1e3
    fastest, slowest = min(t.first_token_at for t in d) * 1e3, max(t.end_at for t in d) * 1e3
    slowest_headers = max(t.headers_at for t in d) * 1e3
    return {
        "fastest_child_first_token_ms": fastest, "merged_first_token_ms": first,
        "ttft_added_ms": first - fastest, "slowest_child_headers_ms": slowest_headers,
        # How long before the slow child's status line the merged stream showed its first token.
        "first_token_before_slowest_headers_ms": slowest_headers - first,
        "first_byte_added_ms": (m.first_byte_at - min(t.first_byte_at for t in d)) * 1e3,
        "slowest_child_total_ms": slowest, "merged_total_ms": end,
        "total_over_slowest": end / slowest - 1,
    }  # fmt: skip


async def _measure(ctx: Context, pairs: list[tuple[str, float, Server, Server]]) -> Row:
    runs, summary, bodies = [], [], _bodies(ctx.options.n[0], ctx.options.max_tokens)
    async with client(60) as session:
        for label, delay, proxy, backend in pairs:
            await _pair(session, proxy, backend, bodies, False)  # warm-up
            rows = [await _pair(session, proxy, backend, bodies, rep % 2 == 1)
                    for rep in range(ctx.options.reps)]  # fmt: skip
            case = {"proxy": label, "fast_delay_ms": delay * 1e3}
            runs += [case | r for r in rows]
            summary.append(case | medians(rows, *rows[0]))
            say(f"ttft {label} at {delay * 1e3:g} ms/token", summary[-1], *SHOWN)
    return {"runs": runs, "summary": summary}


def _run(ctx: Context) -> Row:
    pairs = []
    for delay in (0.0, PACED_TOKEN_S):
        suffix = "-paced" if delay else ""
        backend = start_backend(ctx.fleet, name="backend" + suffix, token_delay=delay)
        proxies = ctx.proxies(backend.url, suffix).items()
        pairs += [(label, delay, proxy, backend) for label, proxy in proxies]
    ctx.ready({server.name: server for *_, proxy, backend in pairs for server in (backend, proxy)})
    return run_async(_measure(ctx, pairs))


COLUMNS: list[Column] = [
    ("proxy", "proxy", ""), ("fast children, ms/token", "fast_delay_ms", "{:g}"),
    ("fastest child first token ms", "fastest_child_first_token_ms", "{:.3f}"),
    ("slowest child headers ms", "slowest_child_headers_ms", "{:.3f}"),
    ("merged first token ms", "merged_first_token_ms", "{:.3f}"),
    ("TTFT gap ms", "ttft_added_ms", "{:+.3f}"),
    ("first token before slowest headers ms", "first_token_before_slowest_headers_ms", "{:.3f}"),
    ("first-byte gap ms", "first_byte_added_ms", "{:+.3f}"),
    ("slowest child total ms", "slowest_child_total_ms", "{:.1f}"),
    ("merged total ms", "merged_total_ms", "{:.1f}"),
    ("total over slowest", "total_over_slowest", "{:+.1%}"),
]  # fmt: skip


RENDER = Section(
    COLUMNS,
    f"n={{options[n][0]}}, {{options[max_tokens]}} tokens, one child {SLOW_START_S * 1e3:.0f} ms"
    f" slow to start and at {SLOW_TOKEN_S * 1e3:.0f} ms/token.",
    "Baseline: the client sends the same n children straight to the backend at once. n-proxy"
    " starts the stream with the first child to answer, so its first token need not wait for the"
    " slow child's status line.",
)


def _targets(data: Row) -> list[Row]:
    """At each speed of the fast children: the merged first token against the fastest child's,
    the merged end against the slowest child's."""
    rows = {r["fast_delay_ms"]: r for r in data["summary"] if r["proxy"] == PROXY}
    out = []
    for delay, at in ((0.0, ""), (PACED_TOKEN_S * 1e3, ", backend at 1 ms/token")):
        gap, over = (rows.get(delay, {}).get(k) for k in ("ttft_added_ms", "total_over_slowest"))
        out += [
            target("merged TTFT minus fastest child's" + at, gap, "<=", 1.0, "{:.3f} ms"),
            target("merged total over slowest child's" + at, over, "<=", 0.05, "{:+.1%}"),
        ]
    return out


TTFT = Scenario(
    "ttft", "Time to first token with one slow child", _run, RENDER, _targets,
    full={"n": (8,), "max_tokens": 32, "reps": 30}, smoke={"n": (2,), "max_tokens": 4},
)  # fmt: skip
