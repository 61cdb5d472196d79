"""vLLM's native n against n-proxy's fan-out on the same vLLM: throughput and first-chunk time.

vLLM's CPU build serves the tests' tiny random Llama (tests/support/vllm_model.py); n-proxy runs as
its own process in front of it, as an upstream without native n, so ``n = k`` becomes k
single-choice requests. Every measurement is paired: native and n-proxy take turns within a round.
On 2 cores the absolute numbers are CPU numbers; the ratio is the point.

    N_PROXY_VLLM_PYTHON=../vllm-venv/bin/python python -m bench.vllm --out FILE.json  # ~5 min

- throughput: closed loop, ``--concurrency`` non-streaming requests of ``--max-tokens`` tokens
  per choice (``ignore_eos``) for ``--seconds``; generated tokens per second, and the CPU
  n-proxy spent per 1,000 of them (vLLM's CPU is recorded too, but its engine busy-polls
  both cores whatever the load, so its CPU per token is only the inverse of its throughput);
- first chunk: one streaming request at a time; time to the first ``data:`` chunk (a choice's
  first token: vLLM sends its role chunks with the first token) and to the end of the stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import sample
from tests.support.vllmserver import PYTHON_ENV, build_model, vllm_python, vllm_server

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "say something"}]
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=300)


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    pids: tuple[int, ...]  # whose CPU is counted: vLLM's process tree, and n-proxy's


@contextlib.contextmanager
def proxy_process(upstream: str, port: int, log_path: Path) -> Iterator[tuple[str, int]]:
    """``python -m proxy --upstream`` in its own process, as users run it: (URL, pid)."""
    command = [sys.executable, "-m", "proxy", "--upstream", upstream, "--port", str(port),
               "--workers", "1"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                try:
                    with urllib.request.urlopen(url + "/v1/models", timeout=2):
                        break
                except (urllib.error.URLError, OSError):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"n-proxy did not start: {log_path}") from None
                    time.sleep(0.2)
            yield url, proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)


def _cpu(pids: tuple[int, ...]) -> list[float]:
    return [sample(pid, tree=True).cpu_seconds for pid in pids]


def _body(n: int, max_tokens: int, stream: bool, seed: int) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, "n": n, "max_tokens": max_tokens,
            "ignore_eos": True, "seed": seed, "stream": stream}  # fmt: skip


async def throughput(
    session: aiohttp.ClientSession, target: Target, n: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Closed loop: generated tokens (usage.completion_tokens) per second, and the CPU that
    vLLM and n-proxy spent per 1,000 of them (from /proc: other load on the machine does not
    count, unlike in the wall-clock figures)."""
    tokens = 0
    requests = 0
    deadline = time.perf_counter() + args.seconds

    async def worker(w: int) -> None:
        nonlocal tokens, requests
        seed = w * 1000
        while time.perf_counter() < deadline:
            seed += 1
            body = _body(n, args.max_tokens, False, seed)
            async with session.post(target.url + CHAT, json=body) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            tokens += answer["usage"]["completion_tokens"]
            requests += 1

    cpu_before = _cpu(target.pids)
    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
    elapsed = time.perf_counter() - started  # the last requests end past the deadline
    cpu = [after - before for before, after in zip(cpu_before, _cpu(target.pids), strict=True)]
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "requests_per_s": requests / elapsed,
        "cpu_s": cpu,  # vLLM's tree, then n-proxy's when it is on the path
    }


async def first_chunk(
    session: aiohttp.ClientSession, url: str, n: int, max_tokens: int, reps: int
) -> dict[str, list[float]]:
    """One stream at a time: first data chunk and whole stream, ms, for each rep."""
    firsts, totals = [], []
    for rep in range(reps):
        started = time.perf_counter()
        first = None
        async with session.post(url + CHAT, json=_body(n, max_tokens, True, rep)) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - started
        assert first is not None
        firsts.append(first * 1e3)
        totals.append((time.perf_counter() - started) * 1e3)
    return {"first_chunk_ms": firsts, "stream_ms": totals}


async def measure(args: argparse.Namespace, targets: list[Target]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT) as session:
        for target in targets:  # warm-up: the first requests pay for lazy setup
            await first_chunk(session, target.url, 2, 8, 2)
        for n in args.n:
            for rnd in range(args.rounds):
                order = targets if rnd % 2 == 0 else targets[::-1]
                for target in order:
                    row: dict[str, Any] = {"n": n, "round": rnd, "path": target.name}
                    row |= await throughput(session, target, n, args)
                    row |= await first_chunk(session, target.url, n, args.max_tokens, args.reps)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def _side(rows: list[dict[str, Any]], n: int, path: str) -> list[dict[str, Any]]:
    return sorted((r for r in rows if r["n"] == n and r["path"] == path), key=lambda r: r["round"])


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per n and path: median tokens/s over rounds, pooled medians of the stream timings, and
    CPU ms per 1,000 tokens over every round; ratios are n-proxy over native (tokens/s paired
    by round, then the median)."""
    out = []
    for n in sorted({r["n"] for r in rows}):
        summary: dict[str, Any] = {"n": n}
        sides = {"native": _side(rows, n, "native"), "proxy": _side(rows, n, "n-proxy")}
        for name, side in sides.items():
            tokens = sum(r["tokens"] for r in side)
            summary[f"{name}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in side)
            for key in ("first_chunk_ms", "stream_ms"):
                summary[f"{name}_{key}"] = statistics.median(x for r in side for x in r[key])
            summary[f"{name}_vllm_cpu_ms_per_1k"] = sum(r["cpu_s"][0] for r in side) / tokens * 1e6
        summary["proxy_cpu_ms_per_1k"] = (
            sum(r["cpu_s"][1] for r in sides["proxy"])
            / sum(r["tokens"] for r in sides["proxy"])
            * 1e6
        )
        summary["tokens_per_s_ratio"] = statistics.median(
            f["tokens_per_s"] / a["tokens_per_s"]
            for a, f in zip(sides["native"], sides["proxy"], strict=True)
        )
        for key in ("first_chunk_ms", "stream_ms"):
            summary[f"{key}_ratio"] = summary[f"proxy_{key}"] / summary[f"native_{key}"]
        out.append(summary)
    return out


def markdown(summary: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Closed loop at concurrency {args.concurrency}, non-streaming, {args.max_tokens} tokens "
        f"per choice, {args.seconds:g} s per turn; then {args.reps} streams one at a time; "
        f"{args.rounds} rounds, native and n-proxy taking turns. Ratio: n-proxy / native, "
        "paired by round.",
        "",
        "| n | tokens/s native | tokens/s n-proxy | ratio | n-proxy CPU per 1k tokens | "
        "first chunk native / n-proxy | whole stream native / n-proxy |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['n']} | {s['native_tokens_per_s']:.0f} | {s['proxy_tokens_per_s']:.0f} | "
            f"{s['tokens_per_s_ratio']:.2f} | {s['proxy_cpu_ms_per_1k']:.0f} ms | "
            f"{s['native_first_chunk_ms']:.0f} / {s['proxy_first_chunk_ms']:.0f} ms | "
            f"{s['native_stream_ms']:.0f} / {s['proxy_stream_ms']:.0f} ms |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--port", type=int, default=18090, help="n-proxy's port")
    parser.add_argument("--out", type=Path, help="write the rows and summary here (JSON)")
    parser.add_argument("--render", type=Path, help="print the table of a saved --out file")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        print(markdown(saved["summary"], argparse.Namespace(**saved["args"])), end="")
        return
    python = vllm_python()
    if python is None:
        sys.exit(f"{PYTHON_ENV} must name a Python with vllm-cpu installed")
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = build_model(python, work / "model")
    started = time.monotonic()
    with (
        vllm_server(python, model, work / "vllm.log") as vllm,
        proxy_process(vllm.url, args.port, work / "n-proxy.log") as (proxy_url, proxy_pid),
    ):
        targets = [Target("native", vllm.url, (vllm.pid,)),
                   Target("n-proxy", proxy_url, (vllm.pid, proxy_pid))]  # fmt: skip
        rows = asyncio.run(measure(args, targets))
    summary = summarize(rows)
    table = markdown(summary, args)
    print(f"\n{table}\n({time.monotonic() - started:.0f} s; logs in {work})")
    if args.out:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "summary": summary,
                        "rows": rows, "cpus": os.cpu_count()}, indent=1) + "\n"
        )  # fmt: skip


if __name__ == "__main__":
    main()
