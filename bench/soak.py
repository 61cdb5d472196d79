"""The soak: minutes of mixed traffic through n-proxy while its RSS and open fds are sampled.

Both must stay flat: a leak of a few hundred bytes per request shows as a steady climb here
long before it shows in production. Writes bench/results/soak.{json,md}; not run in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.load import HEADERS
from bench.main import RESULTS
from bench.procs import Fleet, ProcSample, Server, machine, wait_ready
from bench.stack import start_backend, start_proxy
from bench.stats import median
from bench.streams import run_async
from bench.workload import CHAT_PATH, chat_body

MAX_MINUTES = 120.0
RSS_FLAT_KIB = 4096  # last fifth vs first fifth of the run (after warm-up)
FDS_FLAT = 64  # open fds swing with the requests in flight; a leak climbs past this

# What each soak client cycles through: the paths that allocate, and the ones that clean up.
_MIX: list[tuple[str, bytes]] = [
    ("n=1", orjson.dumps(chat_body())),
    ("n=4", orjson.dumps(chat_body(4))),
    ("n=4 stream", orjson.dumps(chat_body(4, stream=True, max_tokens=64))),
    ("n=2 child fails", orjson.dumps(chat_body(2, x_demo={"fault": "status_500"}))),
    (
        "n=4 stream, child breaks",
        orjson.dumps(chat_body(4, stream=True, x_demo={"fault": "reset_mid_stream"})),
    ),
    # Read one chunk, then hang up: every child must be aborted and forgotten.
    (
        "n=4 stream, client leaves",
        orjson.dumps(chat_body(4, stream=True, max_tokens=64, x_demo={"token_delay": 0.01})),
    ),
]


async def _client(
    session: aiohttp.ClientSession, url: str, deadline: float, counts: Counter[str], offset: int
) -> None:
    turn = offset
    while time.monotonic() < deadline and sum(counts.values()) < 50_000_000:
        label, body = _MIX[turn % len(_MIX)]
        turn += 1
        try:
            async with session.post(url, data=body, headers=HEADERS) as response:
                if label.endswith("client leaves"):
                    await response.content.readany()
                    response.close()
                else:
                    await response.read()
            counts[label] += 1
        except (aiohttp.ClientError, TimeoutError):
            counts[f"{label}: client error"] += 1


async def soak(proxy: Server, minutes: float, every: float, concurrency: int) -> dict[str, Any]:
    url = proxy.url + CHAT_PATH
    counts: Counter[str] = Counter()
    samples: list[ProcSample] = []
    started = time.monotonic()
    deadline = started + minutes * 60
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        clients = [
            asyncio.create_task(_client(session, url, deadline, counts, i))
            for i in range(concurrency)
        ]
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(min(every, max(0.0, deadline - time.monotonic())))
                sample = proxy.sample()
                samples.append(sample)
                print(
                    f"  soak {sample.at - started:6.0f} s  RSS {sample.rss_bytes // 1024:8,} KiB"
                    f"  fds {sample.fds:4}  requests {sum(counts.values()):9,}",
                    flush=True,
                )
        finally:
            await asyncio.gather(*clients, return_exceptions=True)
    # The first fifth is warm-up (pools, caches, allocator arenas): compare against its end.
    fifth = max(1, len(samples) // 5)
    early, late = samples[fifth : 2 * fifth] or samples[:1], samples[-fifth:]
    rss_growth = (median(s.rss_bytes for s in late) - median(s.rss_bytes for s in early)) / 1024
    fds_growth = median(s.fds for s in late) - median(s.fds for s in early)
    return {
        "minutes": minutes,
        "concurrency": concurrency,
        "requests": dict(counts),
        "samples": [
            {"t": round(s.at - started, 1), "rss_kib": s.rss_bytes // 1024, "fds": s.fds}
            for s in samples
        ],
        "rss_growth_kib": round(rss_growth),
        "fds_growth": fds_growth,
        "flat": rss_growth <= RSS_FLAT_KIB and fds_growth <= FDS_FLAT,
    }


def _markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        "# n-proxy soak",
        "",
        f"{result['minutes']} min, {result['concurrency']} clients cycling through"
        f" {len(_MIX)} kinds of request; {meta['cpus']} x {meta['cpu_model']}.",
        "",
        f"RSS growth (last fifth vs second fifth): {result['rss_growth_kib']:,} KiB"
        f" (flat: <= {RSS_FLAT_KIB:,}); open fds growth: {result['fds_growth']}"
        f" (flat: <= {FDS_FLAT}) -> **{'flat' if result['flat'] else 'GROWING'}**",
        "",
        "| t s | RSS KiB | fds |",
        "|---|---|---|",
        *(f"| {s['t']} | {s['rss_kib']:,} | {s['fds']} |" for s in result["samples"]),
        "",
        "Requests: " + ", ".join(f"{k} {v:,}" for k, v in sorted(result["requests"].items())),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    minutes = min(max(args.minutes, 0.1), MAX_MINUTES)
    raw = RESULTS / "raw" / "soak"
    raw.mkdir(parents=True, exist_ok=True)
    with Fleet(raw / "logs") as fleet:
        backend = start_backend(fleet)
        proxy = start_proxy(fleet, raw, backend)
        for server in (backend, proxy):
            wait_ready(server)
        result = run_async(soak(proxy, minutes, args.every, args.concurrency))
    meta = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps({"meta": meta, **result}, indent=1) + "\n")
    (args.out / "soak.md").write_text(_markdown(result, meta))
    verdict = "flat" if result["flat"] else "GROWING"
    print(f"soak: RSS {result['rss_growth_kib']:+,} KiB, fds {result['fds_growth']:+} -> {verdict}")
    return 0 if result["flat"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
