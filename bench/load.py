"""Closed-loop load at fixed concurrency, by wrk (C, a fraction of a core) or by this module run as
a process of its own (aiohttp, exact percentiles, but about a core itself: the fallback, and the
smoke run's tool)."""

import asyncio
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp

from bench.stats import percentile
from bench.workload import HEADERS, Request, run_async

Tool = Literal["wrk", "python"]
WRK_TIMEOUT_SECONDS = 10
_MARK = "BENCHJSON "
MAX_REQUESTS_PER_SECOND = 200_000  # a bound on the Python generator's loop, far above one core's
QUANTILES = (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))


def _lua(request: Request) -> str:
    body = request.body.decode()
    if "]==]" in body:
        raise ValueError("request body cannot be quoted as a Lua long string")
    # wrk calls done() once with the merged statistics of every thread, in µs; the result line
    # has the fields of the Python generator's (Loader.run says which).
    return f"""
wrk.method = "POST"
wrk.path = "{request.path}"
wrk.headers["Content-Type"] = "{HEADERS["Content-Type"]}"
wrk.headers["Authorization"] = "{HEADERS["Authorization"]}"
wrk.body = [==[{body}]==]
done = function(summary, latency, requests)
  local e = summary.errors  -- wrk counts non-2xx answers in both `requests` and `status`
  io.write(string.format(
    '{_MARK}{{"tool":"wrk","requests":%d,"errors":%d,"seconds":%f,'
    .. '"p50_ms":%f,"p90_ms":%f,"p99_ms":%f,"max_ms":%f}}\\n',
    summary.requests - e.status, e.connect + e.read + e.write + e.status + e.timeout,
    summary.duration / 1e6, latency:percentile(50) / 1e3, latency:percentile(90) / 1e3,
    latency:percentile(99) / 1e3, latency.max / 1e3))
end
"""


@dataclass(frozen=True)
class Loader:
    """One load tool with its settings, so scenarios just say where, what and how many."""

    tool: Tool
    seconds: float
    work: Path
    wrk: str | None = None

    def run(self, base_url: str, request: Request, concurrency: int) -> dict[str, Any]:
        """``tool``, ``requests`` (answered with a 2xx status), ``errors`` (other statuses,
        connection errors, timeouts), ``seconds``, ``rps`` and the latency quantiles
        ``p50_ms``, ``p90_ms``, ``p99_ms`` and ``max_ms``."""
        self.work.mkdir(parents=True, exist_ok=True)
        url, python = base_url + request.path, self.tool == "python"
        if python:  # the body on its standard input
            argv = [sys.executable, "-m", "bench.load", url, str(concurrency), str(self.seconds)]
            timeout = self.seconds + 60
        else:
            assert self.wrk is not None, "the wrk tool needs the wrk binary"
            script = self.work / f"wrk-{hashlib.sha256(request.body).hexdigest()[:12]}.lua"
            script.write_text(_lua(request))
            seconds = max(1, round(self.seconds))  # wrk takes whole seconds
            # One thread: it keeps up with these servers and leaves the cores to them.
            argv = [self.wrk, "-t1", f"-c{concurrency}", f"-d{seconds}s", "-s", str(script)]
            argv += [f"--timeout={WRK_TIMEOUT_SECONDS}s", url]
            timeout = seconds + WRK_TIMEOUT_SECONDS + 30
        body = request.body.decode() if python else None
        out = subprocess.run(argv, input=body, capture_output=True, text=True, timeout=timeout)
        for line in out.stdout.splitlines():
            if line.startswith(_MARK):
                found: dict[str, Any] = json.loads(line.removeprefix(_MARK))
                return {**found, "rps": found["requests"] / max(found["seconds"], 1e-9)}
        tail = out.stdout[-1000:] + out.stderr[-1000:]
        raise RuntimeError(f"{' '.join(argv)}: no result line\n{tail}")


async def generate(
    requests: Sequence[tuple[str, bytes]], concurrency: int, seconds: float, timeout: float = 30,
    together: int = 1,
) -> tuple[list[int], int, float]:  # fmt: skip
    """Latencies in ns of the 2xx answers, the error count, and the elapsed seconds (the last
    requests end past ``seconds``). Each worker cycles through ``requests`` (URL and body), from
    its own place in the list; each request may take ``timeout`` seconds. With ``together`` > 1
    a worker sends that many consecutive requests at once and counts them as one, answered when
    all are: a client doing its own fan-out."""
    latencies: list[int] = []
    errors = 0
    budget = max(1, int(seconds * MAX_REQUESTS_PER_SECOND))
    connector = aiohttp.TCPConnector(limit=concurrency * together, force_close=False)
    limit = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(
        connector=connector, timeout=limit, skip_auto_headers=("User-Agent",)
    ) as session:
        start = time.perf_counter()
        deadline = start + seconds

        async def answered(url: str, body: bytes) -> bool:
            try:
                async with session.post(url, data=body, headers=HEADERS) as response:
                    await response.read()
                    return 200 <= response.status < 300
            except (aiohttp.ClientError, TimeoutError):
                return False

        async def worker(turn: int) -> None:
            nonlocal errors
            while time.perf_counter() < deadline and len(latencies) + errors < budget:
                batch = [requests[(turn + i) % len(requests)] for i in range(together)]
                turn += together
                began = time.perf_counter_ns()
                sent = [answered(url, body) for url, body in batch]
                # One request is awaited as it is: a task of its own would slow the Python
                # generator, whose cost per request is what it must keep low.
                ok = await sent[0] if together == 1 else all(await asyncio.gather(*sent))
                if ok:
                    latencies.append(time.perf_counter_ns() - began)
                else:
                    errors += 1

        await asyncio.gather(*(worker(i * together) for i in range(concurrency)))
        elapsed = time.perf_counter() - start
    return latencies, errors, elapsed


if __name__ == "__main__":  # the Python generator: URL CONCURRENCY SECONDS, the body on stdin
    url, concurrency, seconds, body = *sys.argv[1:4], sys.stdin.buffer.read()
    latencies, errors, elapsed = run_async(
        generate([(url, body)], int(concurrency), float(seconds))
    )
    ms = sorted(ns / 1e6 for ns in latencies)
    result = {"tool": "python", "requests": len(ms), "errors": errors, "seconds": elapsed}
    result |= {f"{q}_ms": percentile(ms, p) if ms else 0.0 for q, p in QUANTILES}
    print(_MARK + json.dumps(result), flush=True)
