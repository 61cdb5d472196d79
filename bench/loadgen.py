"""A closed-loop HTTP load generator on aiohttp, in its own process: ``concurrency`` connections
POST back to back until the time is up; one result line with exact latency percentiles."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import aiohttp

from bench.load import HEADERS, result_line
from bench.stats import percentile
from bench.streams import run_async

MAX_REQUESTS_PER_SECOND = 200_000  # a bound on the loop, far above what one core can send
QUANTILES = (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))


async def generate(
    url: str, body: bytes, concurrency: int, seconds: float
) -> tuple[list[int], int, float]:
    """Latencies in ns of the 2xx answers, the error count, and the elapsed seconds."""
    latencies: list[int] = []
    errors = 0
    budget = max(1, int(seconds * MAX_REQUESTS_PER_SECOND))
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",)
    ) as session:
        start = time.perf_counter()
        deadline = start + seconds

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < deadline and len(latencies) + errors < budget:
                began = time.perf_counter_ns()
                try:
                    async with session.post(url, data=body, headers=HEADERS) as response:
                        await response.read()
                        ok = 200 <= response.status < 300
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if ok:
                    latencies.append(time.perf_counter_ns() - began)
                else:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return latencies, errors, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen")
    parser.add_argument("--url", required=True)
    parser.add_argument("--body-file", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args(argv)
    body = args.body_file.read_bytes()
    latencies, errors, elapsed = run_async(generate(args.url, body, args.concurrency, args.seconds))
    ms = sorted(ns / 1e6 for ns in latencies)
    result = {"tool": "python", "requests": len(ms), "errors": errors, "seconds": elapsed}
    result |= {f"{q}_ms": percentile(ms, p) if ms else 0.0 for q, p in QUANTILES}
    print(result_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
