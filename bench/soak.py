"""The soak: minutes of mixed and hostile traffic through n-proxy, its RSS, fds and slots sampled.

All must stay flat: a leak of a few hundred bytes per request shows as a steady climb here
long before it shows in production. Beside the well-behaved clients run queued requests whose
clients leave, large batches (and batches past ``max_children``), gzip bodies, clients that
trickle their headers or body, idle connections and bursts past ``max_connections``. Before the
mix, one large request shows whether RSS returns to its baseline; after it, a request that
needs every upstream slot proves none leaked. Writes bench/results/soak.{json,md}; not in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.load import HEADERS
from bench.main import RESULTS
from bench.procs import Fleet, ProcSample, Server, free_port, machine, wait_ready
from bench.stack import start_backend
from bench.stats import median
from bench.streams import run_async
from bench.workload import CHAT_PATH, MODEL, chat_body

MAX_MINUTES = 120.0
RSS_FLAT_KIB = 4096  # idle after the mix vs idle after the warm-up rounds
FDS_FLAT = 64  # open fds swing with the requests in flight; a leak climbs past this
COMPLETIONS_PATH = "/v1/completions"
SLOTS = 64  # the upstream's max_concurrency: small, so that requests queue
MAX_CONNECTIONS = 100  # above the soak's own clients (about 30), below a burst
CLIENT_SECONDS = 2.0  # client_timeouts.headers and .body: slow clients are cut often
SLOW_CLIENTS = 8
BURST_EVERY = 15.0  # seconds between bursts of connections past max_connections

_PROXY_CONFIG = """\
admin: {{host: 127.0.0.1, port: {admin}}}
max_connections: {max_connections}
client_timeouts: {{headers: {seconds}, body: {seconds}}}
drain_seconds: 1
upstreams:
  - name: demo
    url: {url}
    max_concurrency: {slots}
    max_queue: 100000
"""


def _completions(prompts: int, n: int) -> bytes:
    body = {"model": MODEL, "prompt": [f"p{i}" for i in range(prompts)], "n": n}
    return orjson.dumps({**body, "max_tokens": 4, "ignore_eos": True, "seed": 1})


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
    # Wait in the upstream's queue (n = 10 of 64 slots, behind the others), then hang up.
    (
        "n=10 queued, client leaves",
        orjson.dumps(chat_body(10, stream=True, max_tokens=32, x_demo={"token_delay": 0.02})),
    ),
    ("batch 128 prompts x 4", _completions(128, 4)),
    ("batch past max_children", _completions(1025, 2)),
    ("n=4 gzip body", gzip.compress(orjson.dumps(chat_body(4)))),
]
_PATHS = {"batch 128 prompts x 4": COMPLETIONS_PATH, "batch past max_children": COMPLETIONS_PATH}
_GZIP = {**HEADERS, "Content-Encoding": "gzip"}


async def _client(
    session: aiohttp.ClientSession, base: str, deadline: float, counts: Counter[str], offset: int
) -> None:
    turn = offset
    while time.monotonic() < deadline and sum(counts.values()) < 50_000_000:
        label, body = _MIX[turn % len(_MIX)]
        turn += 1
        url = base + _PATHS.get(label, CHAT_PATH)
        headers = _GZIP if "gzip" in label else HEADERS
        try:
            if label.startswith("n=10 queued"):
                # Leave at a random moment: queued, just admitted, or mid-stream.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(random.uniform(0.0, 0.3)):
                        async with session.post(url, data=body, headers=headers) as response:
                            await response.read()
                counts[label] += 1
                continue
            async with session.post(url, data=body, headers=headers) as response:
                if label.endswith("client leaves"):
                    await response.content.readany()
                    response.close()
                else:
                    await response.read()
            counts[f"{label}: {response.status}"] += 1
        except (aiohttp.ClientError, TimeoutError):
            # Mostly a new connection refused while a burst holds max_connections: back off.
            counts[f"{label}: client error"] += 1
            await asyncio.sleep(0.5)


async def _raw(port: int, data: bytes, wait: float) -> bytes:
    """Send ``data`` and read until the proxy closes; b"" if it closed before answering."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(-1), wait)
    except TimeoutError:
        return b"timeout"
    except ConnectionError:
        return b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


_SLOW = [
    ("slow headers", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"),
    (
        "slow body",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"n": 2, ',
    ),
    ("idle connection", b""),
]


async def _slow_client(port: int, deadline: float, counts: Counter[str], offset: int) -> None:
    """Trickles a request and never finishes it: the proxy must cut it, with a 408 or a close."""
    turn = offset
    while time.monotonic() < deadline:
        label, data = _SLOW[turn % len(_SLOW)]
        turn += 1
        began = time.monotonic()
        answer = await _raw(port, data, CLIENT_SECONDS * 10)
        status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "closed"
        counts[f"{label}: {'not cut' if answer == b'timeout' else status}"] += 1
        if time.monotonic() - began < CLIENT_SECONDS / 2:
            await asyncio.sleep(CLIENT_SECONDS / 2)  # refused during a burst: do not spin


async def _bursts(port: int, deadline: float, counts: Counter[str]) -> None:
    """Every BURST_EVERY s, more connections at once than max_connections: the rest are closed."""
    while time.monotonic() + BURST_EVERY < deadline:
        await asyncio.sleep(BURST_EVERY)
        tries = await asyncio.gather(
            *(asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS + 50)),
            return_exceptions=True,
        )
        opened = [t for t in tries if not isinstance(t, BaseException)]
        counts["burst: connect failed"] += len(tries) - len(opened)
        ends = await asyncio.gather(*(_end(reader) for reader, _ in opened))
        counts.update(f"burst: {end}" for end in ends)
        for _, writer in opened:
            writer.close()


async def _end(reader: asyncio.StreamReader) -> str:
    """How the proxy ended one idle connection of a burst."""
    try:
        answer = await asyncio.wait_for(reader.read(-1), CLIENT_SECONDS * 10)
    except ConnectionError:
        return "refused at accept"
    except TimeoutError:
        return "never closed"
    if not answer:
        return "refused at accept"
    return "408 after the header deadline" if b" 408 " in answer[:16] else "other answer"


async def _metrics(session: aiohttp.ClientSession, admin: str) -> dict[str, float]:
    async with session.get(admin + "/metrics") as response:
        text = await response.text()
    wanted = (
        "n_proxy_children_in_flight",
        "n_proxy_client_connections",
        "n_proxy_connections_refused_total",
        "n_proxy_client_timeouts_total",
    )
    out = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        match = re.match(r"(\w+)(?:\{[^}]*\})? (\S+)$", line)
        if match and match.group(1) in out:
            out[match.group(1)] += float(match.group(2))
    return out


async def _large_request_memory(
    proxy: Server, session: aiohttp.ClientSession, rounds: int = 4
) -> dict[str, Any]:
    """RSS around rounds of one 2,048-child batch and one 15 MiB body, 3 s apart.

    The first round warms the proxy up (its upstream connection pool grows to the slot count,
    code paths and caches fill); the later rounds must each end where the first one did.
    """
    cold = proxy.sample().rss_bytes
    big = orjson.dumps({**chat_body(2), "pad": "x" * (15 << 20)})
    peaks, afters = [], []
    for _ in range(rounds):
        peak = 0
        for path, body in ((COMPLETIONS_PATH, _completions(1024, 2)), (CHAT_PATH, big)):
            async with session.post(proxy.url + path, data=body, headers=HEADERS) as response:
                await response.read()
                assert response.status == 200, response.status
            peak = max(peak, proxy.sample().rss_bytes)
        await asyncio.sleep(3)
        peaks.append(peak // 1024)
        afters.append(proxy.sample().rss_bytes // 1024)
    return {
        "cold_kib": cold // 1024,
        "peak_kib": peaks,
        "after_kib": afters,
        "kept_after_warmup_kib": afters[-1] - afters[0],
    }


async def _every_slot_free(proxy: Server, session: aiohttp.ClientSession) -> bool:
    """A request that needs every upstream slot at once: it hangs if the mix leaked one."""
    url = proxy.url + COMPLETIONS_PATH
    whole = _completions(SLOTS // 2, 2)
    stream = orjson.dumps({**orjson.loads(whole), "stream": True})
    statuses = []
    try:
        async with asyncio.timeout(60):
            for body in (whole, stream):
                async with session.post(url, data=body, headers=HEADERS) as response:
                    await response.read()
                    statuses.append(response.status)
    except TimeoutError:
        print(f"  a request needing every slot hung (answers before it: {statuses})")
        return False
    print(f"  requests needing every slot: {statuses}")
    return statuses == [200, 200]


async def soak(
    proxy: Server, admin: str, minutes: float, every: float, concurrency: int
) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    samples: list[ProcSample] = []
    gauges: list[dict[str, float]] = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        memory = await _large_request_memory(proxy, session)
        print(f"  large request: {memory}", flush=True)
        started = time.monotonic()
        deadline = started + minutes * 60
        clients = [
            asyncio.create_task(_client(session, proxy.url, deadline, counts, i))
            for i in range(concurrency)
        ]
        clients += [
            asyncio.create_task(_slow_client(proxy.port, deadline, counts, i))
            for i in range(SLOW_CLIENTS)
        ]
        clients.append(asyncio.create_task(_bursts(proxy.port, deadline, counts)))
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(min(every, max(0.0, deadline - time.monotonic())))
                sample = proxy.sample()
                samples.append(sample)
                gauges.append(await _metrics(session, admin))
                print(
                    f"  soak {sample.at - started:6.0f} s  RSS {sample.rss_bytes // 1024:8,} KiB"
                    f"  fds {sample.fds:4}  children in flight"
                    f" {gauges[-1]['n_proxy_children_in_flight']:4.0f}"
                    f"  requests {sum(counts.values()):9,}",
                    flush=True,
                )
        finally:
            await asyncio.gather(*clients, return_exceptions=True)
        await asyncio.sleep(CLIENT_SECONDS + 1)  # the last slow clients are cut
        idle = await _metrics(session, admin)
        idle_sample = proxy.sample()
        slots_free = await _every_slot_free(proxy, session)
    # The first fifth is warm-up (pools, caches, allocator arenas): compare against its end.
    fifth = max(1, len(samples) // 5)
    early, late = samples[fifth : 2 * fifth] or samples[:1], samples[-fifth:]
    busy_rss = (
        int(median(s.rss_bytes for s in early)) // 1024,
        int(median(s.rss_bytes for s in late)) // 1024,
    )
    # In-flight RSS swings with the batches running at the sample; idle RSS does not: compare
    # the proxy idle after the mix with the proxy idle after the warm-up rounds.
    rss_growth = idle_sample.rss_bytes // 1024 - memory["after_kib"][-1]
    fds_growth = median(s.fds for s in late) - median(s.fds for s in early)
    children_left = idle["n_proxy_children_in_flight"]
    return {
        "minutes": minutes,
        "concurrency": concurrency,
        "slow_clients": SLOW_CLIENTS,
        "large_request": memory,
        "requests": dict(counts),
        "samples": [
            {
                "t": round(s.at - started, 1),
                "rss_kib": s.rss_bytes // 1024,
                "fds": s.fds,
                "children_in_flight": g["n_proxy_children_in_flight"],
                "client_connections": g["n_proxy_client_connections"],
            }
            for s, g in zip(samples, gauges, strict=True)
        ],
        "idle": {**idle, "rss_kib": idle_sample.rss_bytes // 1024, "fds": idle_sample.fds},
        "every_slot_free": slots_free,
        "busy_rss_kib": busy_rss,
        "rss_growth_kib": round(rss_growth),
        "fds_growth": fds_growth,
        "failed": [
            name
            for name, ok in (
                ("RSS grew", rss_growth <= RSS_FLAT_KIB),
                ("fds grew", fds_growth <= FDS_FLAT),
                ("children left in flight", children_left == 0),
                ("a slot leaked", slots_free),
            )
            if not ok
        ],
    }


def _verdict(result: dict[str, Any]) -> str:
    return "NOT FLAT: " + ", ".join(result["failed"]) if result["failed"] else "flat"


def _markdown(result: dict[str, Any], meta: dict[str, Any], note: str) -> str:
    memory = result["large_request"]
    idle = result["idle"]
    lines = [
        "# n-proxy soak",
        "",
        *([note, ""] if note else []),
        f"{result['minutes']} min, {result['concurrency']} clients cycling through"
        f" {len(_MIX)} kinds of request, {result['slow_clients']} clients trickling headers or"
        f" bodies or idling (client_timeouts {CLIENT_SECONDS} s), a burst of"
        f" {MAX_CONNECTIONS + 50} connections every {BURST_EVERY:.0f} s (max_connections"
        f" {MAX_CONNECTIONS}), {SLOTS} upstream slots; {meta['cpus']} x {meta['cpu_model']}.",
        "",
        f"Idle RSS after the mix minus idle RSS after the warm-up rounds:"
        f" {result['rss_growth_kib']:+,} KiB (flat: <= {RSS_FLAT_KIB:,}; under load, medians of"
        f" the second and last fifths: {result['busy_rss_kib'][0]:,} and"
        f" {result['busy_rss_kib'][1]:,} KiB); open fds growth: {result['fds_growth']}"
        f" (flat: <= {FDS_FLAT}); children in flight once idle:"
        f" {idle['n_proxy_children_in_flight']:.0f}; a request needing all {SLOTS} slots"
        f" afterwards: {'served' if result['every_slot_free'] else 'HUNG'}"
        f" -> **{_verdict(result)}**",
        "",
        f"Large requests first, in {len(memory['after_kib'])} rounds of a 2,048-child batch and"
        f" a 15 MiB body: RSS {memory['cold_kib']:,} KiB cold; 3 s after each round"
        f" {', '.join(f'{k:,}' for k in memory['after_kib'])} KiB (peaks"
        f" {', '.join(f'{k:,}' for k in memory['peak_kib'])}): after the warm-up round,"
        f" {memory['kept_after_warmup_kib']:+,} KiB kept.",
        "",
        "| t s | RSS KiB | fds | children in flight | client connections |",
        "|---|---|---|---|---|",
        *(
            f"| {s['t']} | {s['rss_kib']:,} | {s['fds']} | {s['children_in_flight']:.0f}"
            f" | {s['client_connections']:.0f} |"
            for s in result["samples"]
        ),
        "",
        "Requests (a client error is mostly a connection refused while a burst holds"
        " max_connections): "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(result["requests"].items())),
    ]
    return "\n".join(lines) + "\n"


def _start_proxy(fleet: Fleet, work: Path, upstream: Server) -> tuple[Server, str]:
    port, admin = free_port(), free_port()
    config = work / "n-proxy-soak.yaml"
    config.write_text(
        _PROXY_CONFIG.format(
            admin=admin,
            max_connections=MAX_CONNECTIONS,
            seconds=CLIENT_SECONDS,
            url=upstream.url,
            slots=SLOTS,
        )
    )
    argv = [sys.executable, "-m", "proxy", "--config", str(config)]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    return fleet.launch("n-proxy", argv, port, "/health"), f"http://127.0.0.1:{admin}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--note", default="", help="a line for the report: what was run")
    args = parser.parse_args(argv)
    minutes = min(max(args.minutes, 0.1), MAX_MINUTES)
    raw = RESULTS / "raw" / "soak"
    raw.mkdir(parents=True, exist_ok=True)
    with Fleet(raw / "logs") as fleet:
        backend = start_backend(fleet)
        proxy, admin = _start_proxy(fleet, raw, backend)
        for server in (backend, proxy):
            wait_ready(server)
        result = run_async(soak(proxy, admin, minutes, args.every, args.concurrency))
    meta = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps({"meta": meta, **result}, indent=1) + "\n")
    (args.out / "soak.md").write_text(_markdown(result, meta, args.note))
    verdict = _verdict(result)
    print(f"soak: RSS {result['rss_growth_kib']:+,} KiB, fds {result['fds_growth']:+} -> {verdict}")
    return 0 if not result["failed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
