"""A closed-loop HTTP load generator on aiohttp, run as its own process.

``concurrency`` connections each send the same POST back to back until the time is up; it prints
one result line with exact latency percentiles (and can dump every latency for raw analysis).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from pathlib import Path

import aiohttp

from bench.load import HEADERS, result_line

MAX_REQUESTS_PER_SECOND = 200_000  # a bound on the loop, far above what one core can send


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of an ascending list (0 when empty)."""
    if not sorted_values:
        return 0
    rank = max(1, min(len(sorted_values), math.ceil(q / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


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
    parser.add_argument("--latencies-out", type=Path)
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    body = args.body_file.read_bytes()
    latencies, errors, elapsed = asyncio.run(
        generate(args.url, body, args.concurrency, args.seconds)
    )
    if args.latencies_out is not None:
        args.latencies_out.write_text("".join(f"{v}\n" for v in latencies))
    latencies.sort()
    ms = 1e6
    result = {
        "tool": "python",
        "requests": len(latencies),
        "errors": errors,
        "seconds": elapsed,
        "p50_ms": percentile(latencies, 50) / ms,
        "p90_ms": percentile(latencies, 90) / ms,
        "p99_ms": percentile(latencies, 99) / ms,
        "max_ms": (latencies[-1] if latencies else 0) / ms,
    }
    print(result_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
