"""vLLM's native n against n-proxy's fan-out on the same vLLM (its CPU build, N_PROXY_VLLM_PYTHON):
tokens/s in a closed loop and n-proxy's CPU per token, then first token and whole stream."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import orjson

from bench.procs import sample
from bench.report import Row, table
from bench.scenario import Context, Scenario
from bench.stats import median, over, paired
from bench.workload import HEADERS, client, read_stream, run_async
from tests.support.vllmserver import PYTHON_ENV, build_model, vllm_python, vllm_server

CHAT = "/v1/chat/completions"
NATIVE = "native"
REQUEST_SECONDS = 300
TOKENS_RATIO = over("tokens_per_s")


@dataclass(frozen=True)
class Route:
    name: str
    url: str
    pids: tuple[int, ...]  # whose CPU is counted: vLLM's process tree, and n-proxy's


def _body(n: int, max_tokens: int, stream: bool, seed: int) -> bytes:
    messages = [{"role": "user", "content": "say something"}]
    return orjson.dumps({"model": "tiny", "messages": messages, "n": n, "max_tokens": max_tokens,
                         "ignore_eos": True, "seed": seed, "stream": stream})  # fmt: skip


async def throughput(session: aiohttp.ClientSession, route: Route, n: int, ctx: Context) -> Row:
    """Closed loop: generated tokens (usage.completion_tokens) per second, and the CPU each
    process spent (from /proc: other load on the machine does not count in it)."""
    o, tokens, requests = ctx.options, 0, 0
    deadline = time.perf_counter() + o.seconds

    async def worker(w: int) -> None:
        nonlocal tokens, requests
        seed = w * 1000
        while time.perf_counter() < deadline:
            seed += 1
            body = _body(n, o.max_tokens, False, seed)
            async with session.post(route.url + CHAT, data=body, headers=HEADERS) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            tokens += answer["usage"]["completion_tokens"]
            requests += 1

    before = [sample(pid, tree=True).cpu_seconds for pid in route.pids]
    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(o.concurrency[0])))
    elapsed = time.perf_counter() - started  # the last requests end past the deadline
    cpu = [
        sample(pid, tree=True).cpu_seconds - b for pid, b in zip(route.pids, before, strict=True)
    ]
    # cpu_s: vLLM's tree, then n-proxy's when it is on the path.
    return {"tokens": tokens, "tokens_per_s": tokens / elapsed,
            "requests_per_s": requests / elapsed, "cpu_s": cpu}  # fmt: skip


async def streams(
    session: aiohttp.ClientSession, url: str, n: int, max_tokens: int, reps: int
) -> dict[str, list[float]]:
    """One stream at a time: first token and whole stream, ms, for each rep."""
    timings = [await read_stream(session, url + CHAT, _body(n, max_tokens, True, rep))
               for rep in range(reps)]  # fmt: skip
    if failed := [t.status for t in timings if t.status != 200]:
        raise RuntimeError(f"streams answered {failed}")
    return {"first_token_ms": [t.first_token_at * 1e3 for t in timings],
            "stream_ms": [t.end_at * 1e3 for t in timings]}  # fmt: skip


async def _measure(ctx: Context, routes: list[Route]) -> list[Row]:
    o, rows = ctx.options, []
    async with client(REQUEST_SECONDS) as session:
        for route in routes:  # warm-up: the first requests pay for lazy setup
            await streams(session, route.url, 2, 8, 2)
        for n in o.n:
            for turn in range(o.rounds):
                for route in routes if turn % 2 == 0 else routes[::-1]:
                    row: Row = {"n": n, "round": turn, "path": route.name}
                    row |= await throughput(session, route, n, ctx)
                    row |= await streams(session, route.url, n, o.max_tokens, o.reps)
                    rows.append(row)
                    rate = row["tokens_per_s"]
                    print(
                        f"  vllm n={n} round {turn} {route.name}: {rate:.0f} tokens/s", flush=True
                    )
    return rows


def summarize(rows: list[Row]) -> list[Row]:
    """Per n and path: median tokens/s over rounds, pooled medians of the stream timings, CPU ms
    per 1,000 tokens over every round; ratios are over native (tokens/s paired by round)."""
    out = []
    for n in dict.fromkeys(r["n"] for r in rows):
        at_n = [r for r in rows if r["n"] == n]
        for path in dict.fromkeys(r["path"] for r in at_n):
            mine = [r for r in at_n if r["path"] == path]
            tokens = sum(r["tokens"] for r in mine)
            row = {
                "n": n,
                "path": path,
                "tokens_per_s": median(r["tokens_per_s"] for r in mine),
                "tokens_per_s_ratio": median(paired(at_n, "path", path, NATIVE, TOKENS_RATIO)),
                "vllm_cpu_ms_per_1k": sum(r["cpu_s"][0] for r in mine) / tokens * 1e6,
            }
            if path != NATIVE:
                row["proxy_cpu_ms_per_1k"] = sum(r["cpu_s"][-1] for r in mine) / tokens * 1e6
            for key in ("first_token_ms", "stream_ms"):
                row[key] = median(x for r in mine for x in r[key])
            out.append(row)
    return out


def _run(ctx: Context) -> Row:
    python = vllm_python()
    if python is None:
        raise RuntimeError(f"{PYTHON_ENV} must name a Python with vllm-cpu installed")
    model = build_model(python, ctx.work / "model")
    with vllm_server(python, model, ctx.work / "vllm.log") as vllm:
        up = ctx.ready(ctx.proxies(vllm.url))
        routes = [Route(NATIVE, vllm.url, (vllm.pid,))]
        routes += [Route(label, s.url, (vllm.pid, s.pid)) for label, s in up.items()]
        rows = run_async(_measure(ctx, routes))
    return {"runs": rows, "summary": summarize(rows)}


def _render(data: Row) -> list[str]:
    o = data["options"]
    return [
        f"Closed loop at concurrency {o['concurrency'][0]}, non-streaming, {o['max_tokens']}"
        f" tokens per choice, {o['seconds']:g} s per turn; then {o['reps']} streams one at a"
        f" time; {o['rounds']} rounds, native and n-proxy taking turns. Ratio: over native,"
        " paired by round.",
        *table([("n", "n", ""), ("path", "path", ""), ("tokens/s", "tokens_per_s", "{:,.0f}"),
                ("ratio", "tokens_per_s_ratio", "{:.2f}"),
                ("n-proxy CPU ms per 1k tokens", "proxy_cpu_ms_per_1k", "{:.0f}"),
                ("first token ms", "first_token_ms", "{:.0f}"),
                ("whole stream ms", "stream_ms", "{:.0f}")], data["summary"]),
    ]  # fmt: skip


SCENARIO = Scenario(
    "vllm", "vLLM's native n against n-proxy's fan-out", _run, _render,
    full={"rounds": 3, "seconds": 8.0, "concurrency": (4,), "n": (1, 4, 8), "max_tokens": 64},
    smoke={"seconds": 1.0, "concurrency": (2,), "n": (2,), "max_tokens": 8},
)  # fmt: skip
