"""Closed-loop load at fixed concurrency, by wrk (C, a fraction of a core) or by ``bench.loadgen``
(which needs about a core itself: the fallback, and the smoke run's tool)."""

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
        return {**asdict(self), "rps": self.rps}


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


def _marked(argv: list[str], timeout: float) -> dict[str, Any]:
    """Run a load tool; the JSON of its result line."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith(_MARK):
            parsed: dict[str, Any] = json.loads(line[len(_MARK) :])
            return parsed
    raise RuntimeError(
        f"{' '.join(argv)}: no result line\n{out.stdout[-1000:]}{out.stderr[-1000:]}"
    )


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
        self.work.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(request.body).hexdigest()[:12]
        if self.tool == "python":
            body = self.work / f"body-{digest}.json"
            body.write_bytes(request.body)
            argv = [sys.executable, "-m", "bench.loadgen", "--url", base_url + request.path]
            argv += ["--body-file", str(body), "--concurrency", str(concurrency)]
            return LoadResult(**_marked([*argv, "--seconds", str(self.seconds)], self.seconds + 60))
        assert self.wrk is not None, "the wrk tool needs the wrk binary"
        script = self.work / f"wrk-{digest}.lua"
        script.write_text(_lua(request))
        seconds = max(1, round(self.seconds))  # wrk takes whole seconds
        # One thread: it keeps up with these servers and leaves the cores to them.
        argv = [self.wrk, "-t1", f"-c{concurrency}", f"-d{seconds}s", "-s", str(script)]
        argv += [f"--timeout={WRK_TIMEOUT_SECONDS}s", base_url + request.path]
        raw = _marked(argv, seconds + WRK_TIMEOUT_SECONDS + 30)
        # wrk counts non-2xx answers in both `requests` and `status`.
        errors = sum(raw[k] for k in ("connect", "read", "write", "status", "timeout"))
        return LoadResult(
            "wrk", raw["requests"] - raw["status"], errors, raw["duration_us"] / 1e6,
            *(raw[p] / 1000 for p in ("p50", "p90", "p99", "max")),
        )  # fmt: skip


def post(base_url: str, request: Request, timeout: float = 30.0) -> tuple[int, bytes]:
    """One blocking POST, for checking a contender's answer before timing it."""
    conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=timeout)
    try:
        conn.request("POST", request.path, request.body, HEADERS)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()
