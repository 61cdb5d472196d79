"""The soak: minutes of mixed and hostile traffic through n-proxy; its RSS, fds, children in flight
and upstream slots must stay flat (not in CI: ``python -m bench soak``)."""

import asyncio
import contextlib
import gzip
import random
import re
import time
from collections import Counter
from typing import Any

import aiohttp
import orjson

from bench.procs import Server, free_port
from bench.report import Row, cell, table, target
from bench.scenario import Context, Scenario
from bench.stack import start_backend, start_proxy
from bench.stats import median
from bench.workload import CHAT_PATH, HEADERS, MODEL, chat_body, client, open_raw, run_async

MAX_SECONDS = 7200.0
LARGE_ROUNDS = 4  # of large requests before the mix
SAMPLES = 60  # RSS, fds and gauges this many times over the soak (at most once a second)
RSS_FLAT_KIB = 4096  # idle after the mix vs idle after the warm-up rounds
FDS_FLAT = 64  # open fds swing with the requests in flight; a leak climbs past this
COMPLETIONS_PATH = "/v1/completions"
SLOTS = 64  # the upstream's max_concurrency: small, so that requests queue
MAX_CONNECTIONS = 100  # above the soak's own clients (about 30), below a burst
CLIENT_SECONDS = 2.0  # client_timeouts.headers and .body: slow clients are cut often
SLOW_CLIENTS = 8
BURST_EVERY = 15.0  # seconds between bursts of connections past max_connections

_PROXY_CONFIG = f"""\
max_connections: {MAX_CONNECTIONS}
client_timeouts: {{headers: {CLIENT_SECONDS}, body: {CLIENT_SECONDS}}}
drain_seconds: 1
upstreams:
  - name: demo
    url: {{url}}
    max_concurrency: {SLOTS}
    max_queue: 100000
"""


def _completions(prompts: int, n: int, **fields: Any) -> bytes:
    body = {"model": MODEL, "prompt": [f"p{i}" for i in range(prompts)], "n": n, **fields}
    return orjson.dumps({**body, "max_tokens": 4, "ignore_eos": True, "seed": 1})


def _chat(n: int = 1, **options: Any) -> bytes:
    return orjson.dumps(chat_body(n, **options))


# What each soak client cycles through: the paths that allocate, and the ones that clean up.
# "client leaves": read one chunk, then hang up (every child must be aborted and forgotten);
# "queued": wait in the upstream's queue (n = 10 of 64 slots, behind the others), then hang up.
_MIX = [
    ("n=1", CHAT_PATH, _chat()),
    ("n=4", CHAT_PATH, _chat(4)),
    ("n=4 stream", CHAT_PATH, _chat(4, stream=True, max_tokens=64)),
    ("n=2 child fails", CHAT_PATH, _chat(2, x_demo={"fault": "status_500"})),
    ("n=4 stream, child breaks", CHAT_PATH,
     _chat(4, stream=True, x_demo={"fault": "reset_mid_stream"})),
    ("n=4 stream, client leaves", CHAT_PATH,
     _chat(4, stream=True, max_tokens=64, x_demo={"token_delay": 0.01})),
    ("n=10 queued, client leaves", CHAT_PATH,
     _chat(10, stream=True, max_tokens=32, x_demo={"token_delay": 0.02})),
    ("batch 128 prompts x 4", COMPLETIONS_PATH, _completions(128, 4)),
    ("batch past max_children", COMPLETIONS_PATH, _completions(1025, 2)),
    ("n=4 gzip body", CHAT_PATH, gzip.compress(_chat(4))),
]  # fmt: skip
_GZIP = {**HEADERS, "Content-Encoding": "gzip"}


async def _client(
    session: aiohttp.ClientSession, base: str, deadline: float, counts: Counter[str], offset: int
) -> None:
    turn = offset
    while time.monotonic() < deadline and counts.total() < 50_000_000:
        label, path, body = _MIX[turn % len(_MIX)]
        turn += 1
        post = session.post(base + path, data=body, headers=_GZIP if "gzip" in label else HEADERS)
        try:
            if label.startswith("n=10 queued"):
                # Leave at a random moment: queued, just admitted, or mid-stream.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(random.uniform(0.0, 0.3)), post as response:
                        await response.read()
                counts[label] += 1
                continue
            async with post as response:
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


async def _cut(port: int, data: bytes) -> str:
    """Send ``data``, a request never finished, on a connection of its own: how the proxy ended
    it (its status, "closed" without one, or "not cut" when it kept the connection open)."""
    try:
        [stream] = await open_raw(port, data)
    except OSError:
        return "refused at connect"  # mostly while a burst holds max_connections
    try:
        async with asyncio.timeout(CLIENT_SECONDS * 10):
            await stream.ended
    except TimeoutError:
        return "not cut"
    finally:
        assert stream.transport is not None
        stream.transport.abort()
    return str(stream.status) if stream.status else "closed"


_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
_BODY = b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"n": 2, '
_SLOW = [("slow headers", _HEAD), ("slow body", _HEAD + _BODY), ("idle connection", b"")]


async def _slow_client(port: int, deadline: float, counts: Counter[str], offset: int) -> None:
    """Trickles a request and never finishes it: the proxy must cut it, with a 408 or a close."""
    turn = offset
    while time.monotonic() < deadline:
        label, data = _SLOW[turn % len(_SLOW)]
        turn += 1
        began = time.monotonic()
        counts[f"{label}: {await _cut(port, data)}"] += 1
        if time.monotonic() - began < CLIENT_SECONDS / 2:
            await asyncio.sleep(CLIENT_SECONDS / 2)  # refused during a burst: do not spin


async def _bursts(port: int, deadline: float, counts: Counter[str]) -> None:
    """Every BURST_EVERY s, more idle connections at once than max_connections: the proxy must
    close those past it at once, and the rest with a 408 at the header deadline."""
    while time.monotonic() + BURST_EVERY < deadline:
        await asyncio.sleep(BURST_EVERY)
        ends = await asyncio.gather(*(_cut(port, b"") for _ in range(MAX_CONNECTIONS + 50)))
        counts.update(f"burst: {end}" for end in ends)


GAUGES = ("n_proxy_children_in_flight", "n_proxy_client_connections",
          "n_proxy_connections_refused_total", "n_proxy_client_timeouts_total")  # fmt: skip
SAMPLED = ("children_in_flight", "client_connections")  # of GAUGES, in every sample


async def _metrics(session: aiohttp.ClientSession, admin: str) -> dict[str, float]:
    async with session.get(admin + "/metrics") as response:
        text = await response.text()
    out = dict.fromkeys(GAUGES, 0.0)
    for line in text.splitlines():
        match = re.match(r"(\w+)(?:\{[^}]*\})? (\S+)$", line)
        if match and match.group(1) in out:
            out[match.group(1)] += float(match.group(2))
    return out


async def _large_request_memory(proxy: Server, session: aiohttp.ClientSession) -> dict[str, Any]:
    """RSS around LARGE_ROUNDS rounds of one 2,048-child batch and one 15 MiB body, 3 s apart.

    The first round warms the proxy up (its upstream connection pool grows to the slot count,
    code paths and caches fill); the later rounds must each end where the first one did.
    """
    cold = proxy.sample().rss_bytes
    big = orjson.dumps({**chat_body(2), "pad": "x" * (15 << 20)})
    peaks, afters = [], []
    for _ in range(LARGE_ROUNDS):
        peak = 0
        for path, body in ((COMPLETIONS_PATH, _completions(1024, 2)), (CHAT_PATH, big)):
            async with session.post(proxy.url + path, data=body, headers=HEADERS) as response:
                await response.read()
                assert response.status == 200, response.status
            peak = max(peak, proxy.sample().rss_bytes)
        await asyncio.sleep(3)
        peaks.append(peak // 1024)
        afters.append(proxy.sample().rss_bytes // 1024)
    return {"cold_kib": cold // 1024, "peak_kib": peaks, "after_kib": afters,
            "kept_after_warmup_kib": afters[-1] - afters[0]}  # fmt: skip


async def _every_slot_free(proxy: Server, session: aiohttp.ClientSession) -> int:
    """A request that needs every upstream slot at once: it hangs if the mix leaked one."""
    url = proxy.url + COMPLETIONS_PATH
    statuses: list[int | str] = []
    try:
        async with asyncio.timeout(60):
            for body in (_completions(SLOTS // 2, 2), _completions(SLOTS // 2, 2, stream=True)):
                async with session.post(url, data=body, headers=HEADERS) as response:
                    await response.read()
                    statuses.append(response.status)
    except TimeoutError:
        statuses.append("hung")
    print(f"  requests needing every slot: {statuses}")
    return statuses.count(200)


async def soak(proxy: Server, admin: str, seconds: float, concurrency: int) -> Row:
    counts: Counter[str] = Counter()
    samples: list[Row] = []
    async with client(60) as session:
        memory = await _large_request_memory(proxy, session)
        print(f"  large request: {memory}", flush=True)
        started = time.monotonic()
        deadline = started + seconds
        work = [_client(session, proxy.url, deadline, counts, i) for i in range(concurrency)]
        work += [_slow_client(proxy.port, deadline, counts, i) for i in range(SLOW_CLIENTS)]
        clients = [asyncio.create_task(c) for c in [*work, _bursts(proxy.port, deadline, counts)]]
        try:
            while (left := deadline - time.monotonic()) > 0:
                await asyncio.sleep(min(max(1.0, seconds / SAMPLES), left))
                s, gauges = proxy.sample(), await _metrics(session, admin)
                samples.append(
                    {
                        "t": round(s.at - started, 1),
                        "rss_kib": s.rss_bytes // 1024,
                        "fds": s.fds,
                        **{k: gauges["n_proxy_" + k] for k in SAMPLED},
                    }
                )
                print(f"  soak {samples[-1]}, requests {counts.total():,}", flush=True)
        finally:
            await asyncio.gather(*clients, return_exceptions=True)
        await asyncio.sleep(CLIENT_SECONDS + 1)  # the last slow clients are cut
        idle, idle_sample = await _metrics(session, admin), proxy.sample()
        slots_free = await _every_slot_free(proxy, session)
    # The first fifth is warm-up (pools, caches, allocator arenas): compare against its end.
    fifth = max(1, len(samples) // 5)
    early, late = samples[fifth : 2 * fifth] or samples[:1], samples[-fifth:]
    return {
        "seconds": seconds, "concurrency": concurrency, "slow_clients": SLOW_CLIENTS,
        "large_request": memory, "requests": dict(counts), "samples": samples,
        "idle": {**idle, "rss_kib": idle_sample.rss_bytes // 1024, "fds": idle_sample.fds},
        "slots_served": slots_free,
        "busy_rss_kib": [int(median(s["rss_kib"] for s in part)) for part in (early, late)],
        # In-flight RSS swings with the batches running at the sample; idle RSS does not: compare
        # the proxy idle after the mix with the proxy idle after the warm-up rounds.
        "rss_growth_kib": idle_sample.rss_bytes // 1024 - memory["after_kib"][-1],
        "fds_growth": median(s["fds"] for s in late) - median(s["fds"] for s in early),
    }  # fmt: skip


def _run(ctx: Context) -> Row:
    backend = start_backend(ctx.fleet)
    ctx.ready({"backend": backend})
    seconds, rows = min(ctx.options.seconds, MAX_SECONDS), []
    for label, (tree, env) in ctx.trees(backend.url).items():  # one after the other
        admin = free_port()
        config = f"admin: {{host: 127.0.0.1, port: {admin}}}\n" + _PROXY_CONFIG
        proxy = start_proxy(ctx.fleet, ctx.work, backend.url, label, checkout=tree, config=config,
                            env=env)  # fmt: skip
        ctx.ready({label: proxy})
        admin_url, clients = f"http://127.0.0.1:{admin}", ctx.options.concurrency[0]
        rows.append({"proxy": label, **run_async(soak(proxy, admin_url, seconds, clients))})
        ctx.fleet.stop(proxy)
    return {"summary": rows}


def _render(data: Row) -> list[str]:
    out = []
    for r in data["summary"]:
        memory = r["large_request"]
        out += [
            "", f"### {r['proxy']}", "",
            f"{r['seconds']:g} s: {r['concurrency']} clients cycling through {len(_MIX)} kinds of"
            f" request, {r['slow_clients']} trickling or idle ones (client_timeouts"
            f" {CLIENT_SECONDS} s), a burst of {MAX_CONNECTIONS + 50} connections every"
            f" {BURST_EVERY:.0f} s (max_connections {MAX_CONNECTIONS}), {SLOTS} upstream slots."
            f" RSS under load, medians of the second and last fifths:"
            f" {cell(r['busy_rss_kib'], '{:,}')} KiB.",
            "",
            f"Large requests first, {len(memory['after_kib'])} rounds of a 2,048-child batch and a"
            f" 15 MiB body: RSS {memory['cold_kib']:,} KiB cold, 3 s after each round"
            f" {cell(memory['after_kib'], '{:,}')} KiB (peaks {cell(memory['peak_kib'], '{:,}')}),"
            f" kept after the warm-up round {memory['kept_after_warmup_kib']:+,} KiB.",
            *table([("t s", "t", ""), ("RSS KiB", "rss_kib", "{:,}"), ("fds", "fds", ""),
                    ("children in flight", "children_in_flight", "{:.0f}"),
                    ("client connections", "client_connections", "{:.0f}")], r["samples"]),
            "",
            "Requests (a client error is mostly a connection refused while a burst holds"
            " max_connections): "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(r["requests"].items())),
        ]  # fmt: skip
    return out


def _targets(data: Row) -> list[Row]:
    out = []
    for r in data["summary"]:
        at = f" ({r['proxy']})"
        out += [
            target("soak: idle RSS after the mix over after warm-up" + at, r["rss_growth_kib"],
                   "<=", RSS_FLAT_KIB, "{:+,.0f} KiB"),
            target("soak: open fds growth" + at, r["fds_growth"], "<=", FDS_FLAT, "{:+.0f}"),
            target("soak: children in flight once idle" + at,
                   r["idle"]["n_proxy_children_in_flight"], "<=", 0, "{:.0f}"),
            target("soak: requests needing every slot, served afterwards" + at, r["slots_served"],
                   ">=", 2, "{:.0f} of 2"),
        ]  # fmt: skip
    return out


SOAK = Scenario(
    "soak", "Soak: minutes of mixed and hostile traffic", _run, _render, _targets,
    full={"seconds": 600.0, "concurrency": (16,)}, smoke={"seconds": 20.0, "concurrency": (8,)},
)  # fmt: skip
