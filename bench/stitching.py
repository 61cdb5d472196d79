"""Scenario 3: long n=8 streams at saturation; SSE chunks/s and proxy CPU per chunk.

Requests run back to back until the time is up and the last one finishes, so every chunk counted
is one the proxy fully stitched, and its CPU time is read before and after from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import orjson

from bench.procs import ProcSample, Server
from bench.streams import read_stream
from bench.workload import CHAT_PATH, chat_body, stream_events

SAMPLE_EVERY = 0.5  # seconds between RSS samples


async def _watch_rss(server: Server, samples: list[ProcSample], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(server.sample())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY)


async def run(
    proxy: Server, n: int, tokens: int, concurrency: int, seconds: float, rounds: int
) -> dict[str, Any]:
    body = orjson.dumps(chat_body(n, stream=True, max_tokens=tokens))
    expected = stream_events(n, tokens)
    url = proxy.url + CHAT_PATH
    rows: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency),
        timeout=aiohttp.ClientTimeout(total=120),
    ) as session:
        await read_stream(session, url, body)  # warm-up
        for turn in range(rounds):
            rows.append(await _round(session, proxy, url, body, expected, concurrency, seconds))
            row = rows[-1]
            print(
                f"  s3 round {turn} {row['chunks_per_s']:9.0f} chunks/s"
                f"  {row['cpu_us_per_chunk']:.2f} µs CPU/chunk  errors {row['errors']}",
                flush=True,
            )
    best = max(rows, key=lambda r: r["chunks_per_s"])
    cpu = sorted(r["cpu_us_per_chunk"] for r in rows)[len(rows) // 2]
    rate = sorted(r["chunks_per_s"] for r in rows)[len(rows) // 2]
    return {
        "n": n,
        "tokens_per_choice": tokens,
        "concurrency": concurrency,
        "events_per_request": expected,
        "runs": rows,
        "summary": {
            "chunks_per_s": rate,
            "best_chunks_per_s": best["chunks_per_s"],
            "cpu_us_per_chunk": cpu,
            # What one fully busy core of proxy would stitch: the "on one core" figure.
            "chunks_per_cpu_s": round(1e6 / cpu) if cpu > 0 else 0,
            "errors": sum(r["errors"] for r in rows),
            "rss_growth_kib": max(r["rss_growth_kib"] for r in rows),
        },
    }


async def _round(
    session: aiohttp.ClientSession,
    proxy: Server,
    url: str,
    body: bytes,
    expected: int,
    concurrency: int,
    seconds: float,
) -> dict[str, Any]:
    events = 0
    errors = 0
    done = 0
    budget = 10_000  # requests: a bound far above what the time allows
    samples: list[ProcSample] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_rss(proxy, samples, stop))
    before = proxy.sample()
    start = time.perf_counter()
    deadline = start + seconds

    async def worker() -> None:
        nonlocal events, errors, done
        while time.perf_counter() < deadline and done + errors < budget:
            timing = await read_stream(session, url, body)
            if timing.status == 200 and timing.events == expected:
                done += 1
                events += timing.events
            else:
                errors += 1

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        stop.set()
        await watcher
    wall = time.perf_counter() - start
    after = proxy.sample()
    cpu = after.cpu_seconds - before.cpu_seconds
    # The first sample is taken before any stream of the round: growth is against it.
    rss = [s.rss_bytes for s in samples] or [before.rss_bytes]
    return {
        "requests": done,
        "errors": errors,
        "chunks": events,
        "seconds": round(wall, 3),
        "chunks_per_s": round(events / wall),
        "proxy_cpu_s": round(cpu, 3),
        "proxy_cpu_share": round(cpu / wall, 3),
        "cpu_us_per_chunk": round(cpu / events * 1e6, 3) if events else 0.0,
        "rss_first_kib": rss[0] // 1024,
        "rss_last_kib": rss[-1] // 1024,
        "rss_growth_kib": (max(rss) - rss[0]) // 1024,
    }
