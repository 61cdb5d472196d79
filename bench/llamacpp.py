"""llama.cpp's own server behind n-proxy: first chunk and whole stream at -np 1 vs -np 4.

Uses the test suite's tiny GGUF and xllamacpp launcher (tests/support/tinymodel.py,
tests/support/llamacpp.py), so it needs no download. Run from the repository root:

    python -m bench.llamacpp            # 20 reps per row; prints a Markdown table
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from proxy.config.models import single_upstream_config
from proxy.server.app import build_app
from tests.support.llamacpp import start_llama_server
from tests.support.tinymodel import build_tiny_gguf

CHAT = "/v1/chat/completions"


RETRIED: list[str] = []
RETRY_RESET = True


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, float]:
    """(first data chunk, whole stream) in ms; a request that failed is counted and sent again.

    llama-server closes a kept-alive connection after each stream (despite its Keep-Alive
    header): a proxy that reuses it at that moment gets a 502 (ServerDisconnectedError).
    """
    for _ in range(3):
        try:
            return await _stream_once(session, url, body)
        except AssertionError as exc:
            RETRIED.append(str(exc))
    raise RuntimeError(f"three failures in a row: {RETRIED[-1]}")


async def _stream_once(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, float]:
    started = time.perf_counter()
    first = float("nan")
    async with session.post(url + CHAT, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if first != first and line.startswith(b"data: {"):
                first = time.perf_counter() - started
    return first * 1e3, (time.perf_counter() - started) * 1e3


async def _proxy(upstream: str, stream_start: str) -> tuple[web.AppRunner, str]:
    config = single_upstream_config(upstream).model_copy(update={"stream_start": stream_start})
    if RETRY_RESET:
        # What deploy/kubernetes/overlays/llamacpp sets for llama-server's closed keep-alives.
        (u,) = config.upstreams
        u = u.model_copy(update={"retry_on": ("connect", "reset")})
        config = config.model_copy(update={"upstreams": (u,)})
    runner = web.AppRunner(build_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def run(reps: int, max_tokens: int, n: int) -> list[dict[str, Any]]:
    model = build_tiny_gguf(Path(tempfile.mkdtemp()) / "tiny.gguf", eos_reachable=True)
    rows = []
    for slots in (1, 4):
        n_ctx = max(512, slots * (max_tokens + 64))
        async with start_llama_server(model, n_parallel=slots, n_ctx=n_ctx) as server:
            for start in ("first", "all"):
                runner, proxy_url = await _proxy(server.base_url, start)
                # A new connection per request: llama-server drops a kept-alive connection after
                # a stream, and the same rule for both paths keeps them comparable.
                connector = aiohttp.TCPConnector(force_close=True)
                async with aiohttp.ClientSession(connector=connector) as session:
                    cases = [("direct", server.base_url, 1), ("n-proxy", proxy_url, n)]
                    for name, url, k in cases:
                        if name == "direct" and start == "all":
                            continue
                        body = {
                            "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": max_tokens, "ignore_eos": True, "seed": 1,
                            "stream": True, "n": k,
                        }  # fmt: skip
                        await _stream(session, url, body)  # warm-up
                        timings = [await _stream(session, url, body) for _ in range(reps)]
                        rows.append(
                            {
                                "np": slots, "path": name, "stream_start": start, "n": k,
                                "first_chunk_ms": statistics.median(t[0] for t in timings),
                                "total_ms": statistics.median(t[1] for t in timings),
                            }
                        )  # fmt: skip
                        print(rows[-1], flush=True)
                await runner.cleanup()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--no-retry-reset", action="store_true", help="default retry_on only")
    args = parser.parse_args()
    global RETRY_RESET
    RETRY_RESET = not args.no_retry_reset
    rows = asyncio.run(run(args.reps, args.max_tokens, args.n))
    print(f"\nrequests sent again after a failure: {len(RETRIED)} {sorted(set(RETRIED))}")
    print("\n| `-np` | request | first data chunk | whole stream |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        via = "direct" if r["path"] == "direct" else f"n-proxy, `stream_start: {r['stream_start']}`"
        print(
            f"| {r['np']} | n = {r['n']}, {via} | {r['first_chunk_ms']:.0f} ms"
            f" | {r['total_ms']:.0f} ms |"
        )


if __name__ == "__main__":
    main()
