"""Closed-loop load at fixed concurrency, by wrk (preferred) or by ``bench.loadgen``.

Both return a ``LoadResult``. wrk is C and costs a fraction of a core; the Python generator needs
about as much CPU as the server it measures, which on a 2-core machine skews the result (see
bench/README.md), so it is the fallback and the smoke run's tool (it accepts sub-second runs).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

Tool = Literal["wrk", "python"]
WRK_TIMEOUT_SECONDS = 10
# Every contender gets the same headers. LiteLLM's proxy refuses to start without a master key,
# so it has this one; it guards nothing but a server on 127.0.0.1 for the length of a run.
BENCH_KEY = "sk-bench-loopback-only"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {BENCH_KEY}"}
_MARK = "BENCHJSON "


@dataclass(frozen=True)
class LoadResult:
    tool: str
    requests: int  # completed with a 2xx status
    errors: int  # non-2xx, connection errors and timeouts
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rps": round(self.rps, 1)}


@dataclass(frozen=True)
class Request:
    path: str
    body: bytes  # a JSON body, POSTed


def _lua(request: Request) -> str:
    body = request.body.decode()
    if "]==]" in body:
        raise ValueError("request body cannot be quoted as a Lua long string")
    # wrk calls done() once with the merged statistics of every thread; latency is in µs.
    return f"""
wrk.method = "POST"
wrk.path = "{request.path}"
wrk.headers["Content-Type"] = "{HEADERS["Content-Type"]}"
wrk.headers["Authorization"] = "{HEADERS["Authorization"]}"
wrk.body = [==[{body}]==]
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{_MARK}{{"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,'
    .. '"status":%d,"timeout":%d,"p50":%d,"p90":%d,"p99":%d,"max":%d}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


def run_wrk(
    wrk: str, base_url: str, request: Request, concurrency: int, seconds: int, work: Path
) -> LoadResult:
    work.mkdir(parents=True, exist_ok=True)
    script = work / f"wrk-{hashlib.sha256(request.body).hexdigest()[:12]}.lua"
    script.write_text(_lua(request))
    argv = [
        wrk,
        "-t1",  # one thread: it keeps up with these servers and leaves the cores to them
        f"-c{concurrency}",
        f"-d{max(1, seconds)}s",
        f"--timeout={WRK_TIMEOUT_SECONDS}s",
        "-s",
        str(script),
        base_url + request.path,
    ]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=seconds + WRK_TIMEOUT_SECONDS + 30
    )
    raw = _marked(out.stdout, " ".join(argv), out.stderr)
    errors = sum(raw[k] for k in ("connect", "read", "write", "status", "timeout"))
    # wrk counts non-2xx answers in both `requests` and `status`.
    return LoadResult(
        tool="wrk",
        requests=raw["requests"] - raw["status"],
        errors=errors,
        seconds=raw["duration_us"] / 1e6,
        p50_ms=raw["p50"] / 1000,
        p90_ms=raw["p90"] / 1000,
        p99_ms=raw["p99"] / 1000,
        max_ms=raw["max"] / 1000,
    )


def run_python(
    base_url: str,
    request: Request,
    concurrency: int,
    seconds: float,
    work: Path,
    latencies_out: Path | None = None,
) -> LoadResult:
    work.mkdir(parents=True, exist_ok=True)
    body_file = work / f"body-{hashlib.sha256(request.body).hexdigest()[:12]}.json"
    body_file.write_bytes(request.body)
    argv = [
        sys.executable,
        "-m",
        "bench.loadgen",
        "--url",
        base_url + request.path,
        "--body-file",
        str(body_file),
        "--concurrency",
        str(concurrency),
        "--seconds",
        str(seconds),
    ]
    if latencies_out is not None:
        argv += ["--latencies-out", str(latencies_out)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    raw = _marked(out.stdout, " ".join(argv), out.stderr)
    return LoadResult(**raw)


def _marked(stdout: str, what: str, stderr: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith(_MARK):
            parsed: dict[str, Any] = json.loads(line[len(_MARK) :])
            return parsed
    raise RuntimeError(f"{what}: no result line\n{stdout[-1000:]}\n{stderr[-1000:]}")


def result_line(result: dict[str, Any]) -> str:
    """How ``bench.loadgen`` reports, in the same framing as the wrk script."""
    return _MARK + json.dumps(result)


@dataclass(frozen=True)
class Loader:
    """One load tool with its settings, so scenarios just say where, what and how many."""

    tool: Tool
    seconds: float
    work: Path
    wrk: str | None = None

    def run(self, base_url: str, request: Request, concurrency: int) -> LoadResult:
        if self.tool == "wrk":
            assert self.wrk is not None, "the wrk tool needs the wrk binary"
            return run_wrk(self.wrk, base_url, request, concurrency, round(self.seconds), self.work)
        return run_python(base_url, request, concurrency, self.seconds, self.work)


def post(base_url: str, request: Request, timeout: float = 30.0) -> tuple[int, bytes]:
    """One blocking POST, for checking a contender's answer before timing it."""
    host_port = base_url.removeprefix("http://")
    conn = http.client.HTTPConnection(host_port, timeout=timeout)
    try:
        conn.request("POST", request.path, request.body, HEADERS)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()
