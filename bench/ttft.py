"""Scenario 4: time to first token of the merged stream with one child slow to start and slow.

The baseline is the same fan-out done by the client itself: the n child requests sent straight to
the backend at once, so the backend sees the same load either way. The merged stream should show
its first token when the fastest child does (the stream starts with the first child to answer,
docs/behaviour.md#stream-start, so the slow child's late status line does not hold it back) and
end when the slowest child does.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp
import orjson

from bench.procs import Server
from bench.stats import median
from bench.streams import StreamTiming, read_stream
from bench.workload import CHAT_PATH, SEED, chat_body

# The slow child's status line comes this late, as from a server with no free slot for it.
SLOW_START_S = 0.05


def _bodies(n: int, tokens: int, slow_delay: float) -> tuple[bytes, list[bytes]]:
    """The n>1 request and its n children as the proxy plans them (seed + i, n dropped)."""
    # The last child is slow to start and slow to generate.
    slow = {"only_seed": SEED + n - 1, "token_delay": slow_delay, "headers_delay": SLOW_START_S}
    merged = chat_body(n, stream=True, max_tokens=tokens, x_demo=slow)
    children = [
        chat_body(1, stream=True, max_tokens=tokens, seed=SEED + i, x_demo=slow) for i in range(n)
    ]
    return orjson.dumps(merged), [orjson.dumps(c) for c in children]


async def _direct(session: aiohttp.ClientSession, url: str, bodies: list[bytes]) -> dict[str, Any]:
    started = time.perf_counter()
    timings = await asyncio.gather(*(read_stream(session, url, b, started) for b in bodies))
    _require_ok(timings)
    return {
        "fastest_first_token_ms": min(t.first_token_at for t in timings) * 1e3,
        "fastest_first_byte_ms": min(t.first_byte_at for t in timings) * 1e3,
        # stream_start: all waits for this before the 200; the default starts at the first answer.
        "slowest_headers_ms": max(t.headers_at for t in timings) * 1e3,
        "slowest_end_ms": max(t.end_at for t in timings) * 1e3,
    }


async def _merged(session: aiohttp.ClientSession, url: str, body: bytes) -> dict[str, Any]:
    timing = await read_stream(session, url, body)
    _require_ok([timing])
    return {
        "first_token_ms": timing.first_token_at * 1e3,
        "first_byte_ms": timing.first_byte_at * 1e3,
        "end_ms": timing.end_at * 1e3,
    }


def _require_ok(timings: list[StreamTiming]) -> None:
    for t in timings:
        if t.status != 200 or math.isnan(t.first_token_at):
            raise RuntimeError(f"stream failed: status {t.status}, {t.events} events")


async def run(
    proxy: Server, backend: Server, n: int, tokens: int, slow_delay: float, reps: int
) -> dict[str, Any]:
    """``proxy`` must stand in front of ``backend``; fast children run at its token delay."""
    merged_body, child_bodies = _bodies(n, tokens, slow_delay)
    rows: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        # Warm-up, so both paths start with pooled connections.
        await _direct(session, backend.url + CHAT_PATH, child_bodies)
        await _merged(session, proxy.url + CHAT_PATH, merged_body)
        for rep in range(reps):
            # Alternate which path goes first, so neither always runs on a cooler machine.
            if rep % 2:
                merged = await _merged(session, proxy.url + CHAT_PATH, merged_body)
                direct = await _direct(session, backend.url + CHAT_PATH, child_bodies)
            else:
                direct = await _direct(session, backend.url + CHAT_PATH, child_bodies)
                merged = await _merged(session, proxy.url + CHAT_PATH, merged_body)
            rows.append({"rep": rep, **direct, **merged})
    ttft_gap = [r["first_token_ms"] - r["fastest_first_token_ms"] for r in rows]
    total_ratio = [r["end_ms"] / r["slowest_end_ms"] for r in rows]
    summary = {
        "fastest_child_first_token_ms": round(median(r["fastest_first_token_ms"] for r in rows), 3),
        "merged_first_token_ms": round(median(r["first_token_ms"] for r in rows), 3),
        "ttft_added_ms": round(median(ttft_gap), 3),
        "slowest_child_headers_ms": round(median(r["slowest_headers_ms"] for r in rows), 3),
        # How long before the slow child's status line the merged stream showed its first token.
        "first_token_before_slowest_headers_ms": round(
            median(r["slowest_headers_ms"] - r["first_token_ms"] for r in rows), 3
        ),
        "first_byte_added_ms": round(
            median(r["first_byte_ms"] - r["fastest_first_byte_ms"] for r in rows), 3
        ),
        "slowest_child_total_ms": round(median(r["slowest_end_ms"] for r in rows), 3),
        "merged_total_ms": round(median(r["end_ms"] for r in rows), 3),
        "total_over_slowest": round(median(total_ratio) - 1, 4),
    }
    print(
        f"  s4 merged TTFT {summary['merged_first_token_ms']:.2f} ms vs fastest child"
        f" {summary['fastest_child_first_token_ms']:.2f} ms; total {summary['merged_total_ms']:.1f}"
        f" ms vs slowest child {summary['slowest_child_total_ms']:.1f} ms",
        flush=True,
    )
    return {
        "n": n,
        "tokens_per_choice": tokens,
        "slow_child_token_delay_s": slow_delay,
        "slow_child_headers_delay_s": SLOW_START_S,
        "runs": [{k: round(v, 3) for k, v in r.items()} for r in rows],
        "summary": summary,
    }
