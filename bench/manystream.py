"""Many streams: hundreds of SSE streams through each contender, one small chunk per decode step.

The upstream is ``bench.pacer`` (one timer writes one ~240 B chunk to every open stream per
step); the client is this module run as its own process (``client`` sub-command), so it does not
share an event loop with the harness. Per contender, in the same run: the proxy's CPU µs per
relayed chunk (/proc, over the measuring window), chunks delivered vs offered, and the latency
each chunk gained on the way (receive time minus the ``ts`` the pacer wrote into it; both
CLOCK_MONOTONIC). "Streams" counts upstream streams: n-proxy n=4 opens streams/4 requests of
4 children each, so every contender relays the same number of chunks per step.

    python -m bench.manystream --nginx /usr/sbin/nginx       # bench/results/manystream.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from bench.procs import CpuWatch, Fleet, Server, free_port, machine, settle, wait_ready
from bench.stack import start_forwarder, start_nginx, start_proxy
from bench.stats import rotated
from bench.streams import run_async

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
_TS = re.compile(rb'"ts":([0-9]+\.[0-9]+)\}')
RAMP_BATCH = 100  # connections opened at once: a listen backlog is not the thing measured
RAMP_LIMIT = 15.0  # seconds for every stream to get its first chunk
CLIENT_TIMEOUT = 120.0


# ---------------------------------------------------------------- the client (its own process)


@dataclass
class _Tally:
    measuring: bool = False
    chunks: int = 0
    bad: int = 0
    latencies: list[float] | None = None


class _StreamClient(asyncio.Protocol):
    """One SSE response read raw: chunks counted and timed by their ``ts``, nothing else parsed."""

    def __init__(self, request: bytes, tally: _Tally, first: asyncio.Future[None]) -> None:
        self.request = request
        self.tally = tally
        self.first = first
        self.transport: asyncio.Transport | None = None
        self.head = True
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.first.done():
            self.first.set_exception(ConnectionError("closed before the first chunk"))

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        buffer = self.buffer + data
        if self.head:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                self.buffer = buffer[-65536:]
                return
            if not buffer.startswith(b"HTTP/1.1 200"):
                self.tally.bad += 1
                if not self.first.done():
                    self.first.set_exception(ConnectionError(buffer[:200].decode(errors="replace")))
                return
            self.head = False
            buffer = buffer[end + 4 :]
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            self.buffer = buffer
            return
        block, self.buffer = buffer[:cut], buffer[cut + 2 :]
        if not self.first.done() and _TS.search(block):
            self.first.set_result(None)
        tally = self.tally
        if tally.measuring and tally.latencies is not None:
            stamps = _TS.findall(block)
            tally.chunks += len(stamps)
            tally.latencies.extend(now - float(s) for s in stamps)


def _request(port: int, n: int, steps: int) -> bytes:
    body = json.dumps(
        {
            "model": "bench-model",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "n": n,
            "max_tokens": steps,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _client(
    port: int, requests: int, n: int, step: float, warmup: float, seconds: float
) -> None:
    loop = asyncio.get_running_loop()
    steps = math.ceil((RAMP_LIMIT + warmup + seconds + 5) / step)
    request = _request(port, n, steps)
    tally = _Tally()
    transports: list[asyncio.Transport] = []
    firsts: list[asyncio.Future[None]] = []
    started = time.monotonic()
    for batch in range(0, requests, RAMP_BATCH):
        opening = []
        for _ in range(min(RAMP_BATCH, requests - batch)):
            first: asyncio.Future[None] = loop.create_future()
            firsts.append(first)
            opening.append(
                loop.create_connection(
                    functools.partial(_StreamClient, request, tally, first), "127.0.0.1", port
                )
            )
        for transport, _ in await asyncio.gather(*opening):
            transports.append(transport)
    left = max(RAMP_LIMIT - (time.monotonic() - started), 0.1)
    done, pending = await asyncio.wait(firsts, timeout=left)
    failed = [f.exception() for f in done if f.exception() is not None]
    ramp = time.monotonic() - started
    await asyncio.sleep(warmup)
    tally.latencies = []
    tally.measuring = True
    print("start", flush=True)
    window_start = time.monotonic()
    await asyncio.sleep(seconds)
    tally.measuring = False
    window = time.monotonic() - window_start
    print("end", flush=True)
    for transport in transports:
        transport.abort()
    latencies = sorted(tally.latencies)
    offered = requests * n * window / step
    result = {
        "requests": requests,
        "ramp_s": round(ramp, 3),
        "not_started": len(pending) + len(failed),
        "errors": [str(e)[:200] for e in failed[:3]],
        "window_s": round(window, 3),
        "chunks": tally.chunks,
        "offered": round(offered),
        "delivered": round(tally.chunks / offered, 4) if offered else None,
        "latency_ms": {
            q: round(_quantile(latencies, p) * 1000, 3)
            for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
        },
    }
    print("result " + json.dumps(result), flush=True)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(int(q * len(values)), len(values) - 1)]


# ---------------------------------------------------------------- the harness


@dataclass(frozen=True)
class Contender:
    name: str
    server: Server
    n: int = 1


def start_pacer(fleet: Fleet, step: float) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "bench.pacer", "--port", str(port), "--step", str(step)]
    return fleet.launch(f"pacer-{int(step * 1000)}ms", argv, port, "/health")


def measure(
    contender: Contender, streams: int, step: float, warmup: float, seconds: float
) -> dict[str, Any]:
    """One client process against one contender; the contender's CPU over the client's window."""
    requests = max(streams // contender.n, 1)
    argv = [sys.executable, "-m", "bench.manystream", "client", "--port"]
    argv += [str(contender.server.port), "--requests", str(requests), "--n", str(contender.n)]
    argv += ["--step", str(step), "--warmup", str(warmup), "--seconds", str(seconds)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert process.stdout is not None
    watch: CpuWatch | None = None
    before = after = None
    result: dict[str, Any] = {}
    deadline = time.monotonic() + CLIENT_TIMEOUT
    try:
        for line in process.stdout:
            if line.startswith("start"):
                before = contender.server.sample()
                watch = CpuWatch([contender.server])
            elif line.startswith("end"):
                after = contender.server.sample()
                use = watch.stop() if watch is not None else None
                result["cpu"] = use.__dict__ if use is not None else None
            elif line.startswith("result "):
                result.update(json.loads(line[7:]))
            if time.monotonic() > deadline:
                break
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if before is not None and after is not None and result.get("chunks"):
        cpu = after.cpu_seconds - before.cpu_seconds
        result["proxy_cores"] = round(cpu / (after.at - before.at), 3)
        result["cpu_us_per_chunk"] = round(cpu / result["chunks"] * 1e6, 2)
    return result


def run(
    nginx: str | None,
    work: Path,
    sizes: tuple[int, ...],
    steps: tuple[float, ...],
    warmup: float,
    seconds: float,
    rounds: int,
    baseline: Path | None = None,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with Fleet(work / "logs") as fleet:
        for step in steps:
            pacer = start_pacer(fleet, step)
            wait_ready(pacer)
            proxy = start_proxy(fleet, work, pacer, name=f"n-proxy-{int(step * 1000)}ms")
            forwarder = start_forwarder(fleet, pacer)
            contenders = [Contender("direct", pacer)]
            if nginx:
                contenders.append(Contender("nginx", start_nginx(fleet, work, nginx, pacer)))
            contenders += [
                Contender("aiohttp forwarder", forwarder),
                Contender("n-proxy n=1", proxy),
                Contender("n-proxy n=4", proxy, n=4),
            ]
            if baseline is not None:
                base = start_proxy(
                    fleet, work, pacer, f"baseline-{int(step * 1000)}ms", 1, baseline
                )
                contenders += [
                    Contender("baseline n=1", base),
                    Contender("baseline n=4", base, n=4),
                ]
            for contender in contenders:
                wait_ready(contender.server)
            names = [c.name for c in contenders]
            by_name = {c.name: c for c in contenders}
            for turn in range(rounds):
                for size in sizes:
                    for name in rotated(names, turn):
                        settle([c.server for c in contenders] + [pacer])
                        row = measure(by_name[name], size, step, warmup, seconds)
                        row.update(contender=name, streams=size, step_ms=step * 1000, round=turn)
                        print(f"   {_line(row)}", flush=True)
                        rows.append(row)
            for server in {id(c.server): c.server for c in contenders}.values():
                fleet.stop(server)
    return {"runs": rows, "summary": summarize(rows)}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per (streams, step, contender); added latency against direct in the same round."""
    out = []
    keys = list(dict.fromkeys((r["streams"], r["step_ms"], r["contender"]) for r in rows))
    for streams, step_ms, name in keys:
        mine = [
            r
            for r in rows
            if (r["streams"], r["step_ms"], r["contender"]) == (streams, step_ms, name)
        ]
        direct = {
            r["round"]: r
            for r in rows
            if r["streams"] == streams and r["step_ms"] == step_ms and r["contender"] == "direct"
        }
        added = {
            q: _median(
                [
                    r["latency_ms"][q] - direct[r["round"]]["latency_ms"][q]
                    for r in mine
                    if r["round"] in direct and r.get("latency_ms")
                ]
            )
            for q in ("p50", "p99")
        }
        out.append(
            {
                "streams": streams,
                "step_ms": step_ms,
                "contender": name,
                "cpu_us_per_chunk": _median([r.get("cpu_us_per_chunk") for r in mine]),
                "proxy_cores": _median([r.get("proxy_cores") for r in mine]),
                "delivered": _median([r.get("delivered") for r in mine]),
                "p50_ms": _median([r.get("latency_ms", {}).get("p50") for r in mine]),
                "p99_ms": _median([r.get("latency_ms", {}).get("p99") for r in mine]),
                "added_p50_ms": added["p50"],
                "added_p99_ms": added["p99"],
                "not_started": max((r.get("not_started", 0) for r in mine), default=0),
            }
        )
    return out


def _median(values: list[Any]) -> float | None:
    numbers = sorted(float(v) for v in values if v is not None and not math.isnan(float(v)))
    if not numbers:
        return None
    mid = len(numbers) // 2
    return numbers[mid] if len(numbers) % 2 else (numbers[mid - 1] + numbers[mid]) / 2


def _line(row: dict[str, Any]) -> str:
    lat = row.get("latency_ms", {})
    return (
        f"{row['streams']:>5} x {row['step_ms']:.0f} ms  {row['contender']:<18}"
        f" cpu/chunk {row.get('cpu_us_per_chunk')} µs  cores {row.get('proxy_cores')}"
        f"  delivered {row.get('delivered')}  p50 {lat.get('p50')} p99 {lat.get('p99')} ms"
        f"  not started {row.get('not_started')}"
    )


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        "# Many streams (bench.manystream)",
        "",
        f"Command: `{meta['command']}`; {meta['cpus']} x {meta['cpu_model']}, Python"
        f" {meta['python']}, n-proxy at {meta['proxy_version']}. Medians of {meta['rounds']}"
        f" round(s) of {meta['seconds']} s. CPU from /proc of the contender's processes only;"
        " added latency = the contender's minus direct's in the same round.",
        "",
        "| streams x step | contender | CPU µs / chunk | cores | delivered | added p50 / p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    last = None
    for row in results["summary"]:
        key = (row["streams"], row["step_ms"])
        label = f"{row['streams']} x {row['step_ms']:.0f} ms" if key != last else ""
        last = key
        added = (
            "-"
            if row["contender"] == "direct"
            else f"{_fmt(row['added_p50_ms'], '+.1f')} / {_fmt(row['added_p99_ms'], '+.1f')}"
        )
        lines.append(
            f"| {label} | {row['contender']} | {_fmt(row['cpu_us_per_chunk'], '.1f')} |"
            f" {_fmt(row['proxy_cores'], '.2f')} | {_fmt(row['delivered'], '.1%')} | {added} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _git_version() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.manystream", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client", help="(internal) one client process")
    client.add_argument("--port", type=int, required=True)
    client.add_argument("--requests", type=int, required=True)
    client.add_argument("--n", type=int, default=1)
    client.add_argument("--step", type=float, required=True)
    client.add_argument("--warmup", type=float, default=1.0)
    client.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--nginx", help="the nginx binary (skipped when absent)")
    parser.add_argument("--streams", default="200,1000")
    parser.add_argument("--steps-ms", default="50,20")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--baseline", type=Path, help="another n-proxy checkout (with .venv) measured beside"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.command == "client":
        run_async(_client(args.port, args.requests, args.n, args.step, args.warmup, args.seconds))
        return 0
    work = RESULTS / "raw" / "manystream"
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {
        "meta": {
            "command": "python -m bench.manystream " + " ".join(argv or sys.argv[1:]),
            **machine(),
            "proxy_version": _git_version(),
            "rounds": args.rounds,
            "seconds": args.seconds,
        }
    }
    results.update(
        run(
            args.nginx,
            work,
            tuple(int(s) for s in args.streams.split(",")),
            tuple(float(s) / 1000 for s in args.steps_ms.split(",")),
            args.warmup,
            args.seconds,
            args.rounds,
            args.baseline,
        )
    )
    results["meta"]["wall_s"] = round(time.monotonic() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "manystream.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "manystream.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
