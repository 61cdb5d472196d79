"""Memory: n-proxy's RSS with many open streams (it must not grow with stream length), and the bytes
it holds behind a client that stops reading (read minus written, /proc/PID/io)."""

import asyncio
import time
from typing import Any

from bench.procs import ProcSample, Server
from bench.report import Column, Row, pick, say, table, target
from bench.scenario import PROXY, Context, Scenario
from bench.stack import start_backend
from bench.stats import numbers
from bench.workload import chat_request, open_raw, raw_post, run_async, stream_events

KIB = 1024
OPEN_TOKENS = 40  # per open stream, paced to last --seconds
STALL_SHARE = 0.4  # the slow client stalls for this share of --seconds
CLIENT_RCVBUF = 4096  # the slow client's receive buffer: the kernel holds little for it
FLAT_KIB = 1024  # "flat": less than this much growth between early and late in a stream's life


async def open_streams(proxy: Server, streams: int, n: int, life: float) -> dict[str, Any]:
    """``streams`` concurrent n-choice streams of OPEN_TOKENS tokens, each ``life`` seconds long."""
    x_demo = {"token_delay": life / OPEN_TOKENS}
    request = chat_request(n, stream=True, max_tokens=OPEN_TOKENS, x_demo=x_demo)
    idle = proxy.sample()
    warm_up = raw_post(chat_request(n, stream=True, max_tokens=2), close=True)
    await (await open_raw(proxy.port, warm_up))[0].ended
    warm, opened = proxy.sample(), time.perf_counter()
    held = await open_raw(proxy.port, raw_post(request, close=True), streams)
    await asyncio.wait([s.flowing for s in held], timeout=life / 2)
    flowing = sum(s.flowing.done() and not s.error for s in held)
    # Early (every stream flowing), middle and late in the streams' life.
    first = time.perf_counter()
    samples = []
    for moment in (first, (first + opened + 0.9 * life) / 2, opened + 0.9 * life):
        if (wait := moment - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        samples.append(proxy.sample())
    await asyncio.wait([s.ended for s in held], timeout=life + 120)
    done = proxy.sample()
    failed = [s for s in held if not s.ended.done() or s.events != stream_events(n, OPEN_TOKENS)]
    early, late = samples[0].rss_bytes, samples[-1].rss_bytes
    result = {
        "streams": streams, "flowing_at_first_sample": flowing, "n": n, "stream_seconds": life,
        "failed": len(failed), "rss_idle_kib": idle.rss_bytes // KIB,
        "rss_warm_kib": warm.rss_bytes // KIB, "rss_after_kib": done.rss_bytes // KIB,
        "rss_open_kib": [s.rss_bytes // KIB for s in samples],
        "fds_open": samples[-1].fds, "fds_after": done.fds,
        "per_stream_kib": (late - warm.rss_bytes) / streams / KIB,
        # Late minus early while every stream is open: memory that tracks stream length.
        "growth_early_to_late_kib": (late - early) // KIB,
    }  # fmt: skip
    for stream in held:  # the failed ones, if any: their connections go too
        assert stream.transport is not None
        stream.transport.abort()
    say(f"memory, {streams} open streams", result, "per_stream_kib", "growth_early_to_late_kib",
        "failed")  # fmt: skip
    return result


async def slow_client(
    proxy: Server, backend: Server, n: int, tokens: int, stall: float
) -> dict[str, Any]:
    """One stream the client stops reading while the backend generates with no delay."""
    before, backend_before = proxy.sample(), backend.sample()
    request = raw_post(chat_request(n, stream=True, max_tokens=tokens))
    [stream] = await open_raw(proxy.port, request, rcvbuf=CLIENT_RCVBUF)
    assert stream.transport is not None
    try:
        async with asyncio.timeout(10):
            await stream.flowing
        if stream.error:
            raise RuntimeError(f"slow client: {stream.error!r}")
        stream.transport.pause_reading()
        # Reading stops here. Let the buffers fill, then watch whether anything still grows.
        await asyncio.sleep(stall / 2)
        settled, backend_settled = proxy.sample(), backend.sample()
        await asyncio.sleep(stall / 2)
        late, backend_late = proxy.sample(), backend.sample()
    finally:
        stream.transport.abort()

    def held(sample: ProcSample) -> int:
        read = sample.read_bytes - before.read_bytes
        return read - (sample.written_bytes - before.written_bytes)

    sent = backend_late.written_bytes - backend_before.written_bytes
    sent_late = backend_late.written_bytes - backend_settled.written_bytes
    result = {
        "n": n, "stall_seconds": stall, "backend_sent_kib": sent // KIB,
        "backend_sent_late_kib": sent_late // KIB, "proxy_held_kib": held(late) // KIB,
        "proxy_held_per_child_kib": held(late) / n / KIB,
        "proxy_held_growth_late_kib": (held(late) - held(settled)) // KIB,
        "rss_before_kib": before.rss_bytes // KIB, "rss_late_kib": late.rss_bytes // KIB,
        "rss_growth_kib": (late.rss_bytes - before.rss_bytes) // KIB,
        "rss_growth_late_kib": (late.rss_bytes - settled.rss_bytes) // KIB,
    }  # fmt: skip
    say(f"memory, slow client n={n}", result, "proxy_held_per_child_kib", "rss_growth_kib",
        "backend_sent_late_kib")  # fmt: skip
    return result


async def _measure(ctx: Context, backend: Server, proxies: dict[str, Server]) -> Row:
    """A row of each table per proxy: its open streams, then its slow client."""
    o, data = ctx.options, {"open_streams": list[Row](), "slow_client": list[Row]()}
    for label, proxy in proxies.items():
        opened = await open_streams(proxy, o.streams[0], o.n[0], o.seconds)
        stalled = await slow_client(proxy, backend, o.n[-1], o.max_tokens, o.seconds * STALL_SHARE)
        data["open_streams"].append({"proxy": label, **opened})
        data["slow_client"].append({"proxy": label, **stalled})
    return data


def _run(ctx: Context) -> Row:
    backend = start_backend(ctx.fleet)
    proxies = ctx.proxies(backend.url)
    ctx.ready({"backend": backend})
    return run_async(_measure(ctx, backend, ctx.ready(proxies)))


OPEN: list[Column] = [
    ("proxy", "proxy", ""), ("open streams", "streams", ""), ("n", "n", ""),
    ("RSS warm KiB", "rss_warm_kib", "{:,}"),
    ("RSS all flowing / mid / at 90 % of life KiB", "rss_open_kib", "{:,}"),
    ("KiB per stream", "per_stream_kib", "{:.1f}"),
    ("growth early to late KiB", "growth_early_to_late_kib", "{:,}"),
    ("open fds", "fds_open", ""), ("failed", "failed", ""),
]  # fmt: skip
SLOW: list[Column] = [
    ("proxy", "proxy", ""), ("slow client, n", "n", ""), ("stall s", "stall_seconds", "{:g}"),
    ("held in proxy per child KiB", "proxy_held_per_child_kib", "{:.1f}"),
    ("held growth, 2nd half of stall KiB", "proxy_held_growth_late_kib", "{:,}"),
    ("RSS growth KiB", "rss_growth_kib", "{:,}"), ("backend sent KiB", "backend_sent_kib", "{:,}"),
    ("backend sent, 2nd half of stall KiB", "backend_sent_late_kib", "{:,}"),
]  # fmt: skip


def _render(data: Row) -> list[str]:
    return [
        *table(OPEN, data["open_streams"]),
        *table(SLOW, data["slow_client"]),
        "",
        "Held in proxy = bytes it read minus bytes it wrote (/proc/PID/io), i.e. what sits in"
        " its user-space buffers; kernel socket buffers are not counted.",
    ]


def _targets(data: Row) -> list[Row]:
    opened, stalled = (pick(data[part], proxy=PROXY) for part in ("open_streams", "slow_client"))
    growth = max(numbers([opened.get("growth_early_to_late_kib"),
                          stalled.get("proxy_held_growth_late_kib")]), default=None)  # fmt: skip
    held = stalled.get("proxy_held_per_child_kib")
    return [
        target("memory growth with stream length", growth, "<=", FLAT_KIB, "{:,.0f} KiB"),
        target("bytes held per child behind a slow client", held, "<=", 64, "{:.1f} KiB"),
    ]


MEMORY = Scenario(
    "memory", "Memory: many open streams, and one client that stops reading", _run, _render,
    _targets, full={"seconds": 10.0, "streams": (1000,), "n": (2, 8), "max_tokens": 100_000},
    smoke={"seconds": 1.0, "streams": (20,), "n": (2,), "max_tokens": 20_000},
)  # fmt: skip
