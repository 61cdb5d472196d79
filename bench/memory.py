"""Scenario 5: proxy memory with many open streams, and behind one client that stops reading.

Open streams are kept open by a per-token delay (x_demo) and sampled early and late in their
life: memory must not grow with stream length. For the slow client, the bytes held inside the
proxy are what it read from the children minus what it wrote to the client (/proc/PID/io).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

import aiohttp
import orjson

from bench.procs import ProcSample, Server
from bench.streams import read_stream
from bench.workload import CHAT_PATH, chat_body

KIB = 1024
OPEN_BATCH = 100  # streams opened at once: stays under the listen backlog
CLIENT_RCVBUF = 4096  # the slow client's receive buffer: the kernel holds little for it


async def open_streams(
    proxy: Server, streams: int, n: int, tokens: int, token_delay: float
) -> dict[str, Any]:
    """``streams`` concurrent n-choice streams, each ``tokens * token_delay`` seconds long."""
    body = orjson.dumps(
        chat_body(n, stream=True, max_tokens=tokens, x_demo={"token_delay": token_delay})
    )
    url = proxy.url + CHAT_PATH
    life = tokens * token_delay
    idle = proxy.sample()
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=life + 120),
    ) as session:
        await read_stream(session, url, orjson.dumps(chat_body(n, stream=True, max_tokens=2)))
        warm = proxy.sample()
        flowing = 0
        all_flowing = asyncio.Event()

        def one_more() -> None:
            nonlocal flowing
            flowing += 1
            if flowing == streams:
                all_flowing.set()

        tasks: list[asyncio.Task[Any]] = []
        opened = time.perf_counter()
        for start in range(0, streams, OPEN_BATCH):
            batch = min(OPEN_BATCH, streams - start)
            tasks += [
                asyncio.create_task(read_stream(session, url, body, on_first_byte=one_more))
                for _ in range(batch)
            ]
            await asyncio.sleep(0.02)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_flowing.wait(), life / 2)
        # Early (every stream flowing), middle and late in the streams' life.
        first = time.perf_counter()
        samples = []
        for moment in (first, (first + opened + 0.9 * life) / 2, opened + 0.9 * life):
            if (wait := moment - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            samples.append(proxy.sample())
        timings = await asyncio.gather(*tasks, return_exceptions=True)
    done = proxy.sample()
    failed = [t for t in timings if isinstance(t, BaseException) or t.status != 200]
    early, late = samples[0].rss_bytes, samples[-1].rss_bytes
    result = {
        "streams": streams,
        "flowing_at_first_sample": flowing,
        "n": n,
        "stream_seconds": life,
        "failed": len(failed),
        "rss_idle_kib": idle.rss_bytes // KIB,
        "rss_warm_kib": warm.rss_bytes // KIB,
        "rss_open_kib": [s.rss_bytes // KIB for s in samples],
        "rss_after_kib": done.rss_bytes // KIB,
        "fds_open": samples[-1].fds,
        "fds_after": done.fds,
        "per_stream_kib": round((late - warm.rss_bytes) / streams / KIB, 1),
        # Late minus early while every stream is open: memory that tracks stream length.
        "growth_early_to_late_kib": (late - early) // KIB,
    }
    print(
        f"  s5 {streams} open streams: RSS {warm.rss_bytes // KIB} -> {late // KIB} KiB"
        f" ({result['per_stream_kib']} KiB/stream), early->late"
        f" {result['growth_early_to_late_kib']} KiB, failed {len(failed)}",
        flush=True,
    )
    return result


async def slow_client(
    proxy: Server, backend: Server, n: int, tokens: int, stall: float
) -> dict[str, Any]:
    """One stream the client stops reading while the backend generates with no delay."""
    body = orjson.dumps(chat_body(n, stream=True, max_tokens=tokens))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", proxy.port)), 5)
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        before = proxy.sample()
        backend_before = backend.sample()
        writer.write(
            f"POST {CHAT_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"slow client: {head[:200]!r}")
        await asyncio.wait_for(reader.read(1024), 10)
        # Reading stops here. Let the buffers fill, then watch whether anything still grows.
        await asyncio.sleep(stall / 2)
        settled, backend_settled = proxy.sample(), backend.sample()
        await asyncio.sleep(stall / 2)
        late, backend_late = proxy.sample(), backend.sample()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    def held(sample: ProcSample) -> int:
        read = sample.read_bytes - before.read_bytes
        return read - (sample.written_bytes - before.written_bytes)

    result = {
        "n": n,
        "stall_seconds": stall,
        "backend_sent_kib": (backend_late.written_bytes - backend_before.written_bytes) // KIB,
        "backend_sent_late_kib": (backend_late.written_bytes - backend_settled.written_bytes)
        // KIB,
        "proxy_held_kib": held(late) // KIB,
        "proxy_held_per_child_kib": round(held(late) / n / KIB, 1),
        "proxy_held_growth_late_kib": (held(late) - held(settled)) // KIB,
        "rss_before_kib": before.rss_bytes // KIB,
        "rss_late_kib": late.rss_bytes // KIB,
        "rss_growth_kib": (late.rss_bytes - before.rss_bytes) // KIB,
        "rss_growth_late_kib": (late.rss_bytes - settled.rss_bytes) // KIB,
    }
    print(
        f"  s5 slow client n={n}: proxy holds {result['proxy_held_per_child_kib']} KiB/child,"
        f" RSS +{result['rss_growth_kib']} KiB, backend still sending"
        f" {result['backend_sent_late_kib']} KiB late in the stall",
        flush=True,
    )
    return result
