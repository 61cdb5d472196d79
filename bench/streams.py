"""The manystream scenario's Python client: ``bench/native/streams.c``'s arguments, lines and
result, read the way an SDK reads a stream. One asyncio process (uvloop) holds every stream, a
task each on asyncio's streams: the chunked framing undone line by line (``readline`` for a
chunk's size, ``readexactly`` for its data), each SSE event split off by line and decoded as JSON,
as OpenAI's Python SDK does with every event it yields. It takes a fraction of a core for 20,000
chunks a second, where the C client takes almost none: a reader with an interpreter's pace, whose
reads come later and hold more than the C client's.

    python -m bench.streams PORT REQUESTS N STEP RAMP WARMUP SECONDS < request
"""

import asyncio
import contextlib
import json
import math
import socket
import sys
import time
from dataclasses import dataclass, field

import orjson

from bench.stats import percentile
from bench.workload import OPEN_BATCH, run_async

MAX_ERRORS = 3
ERROR_BYTES = 200


@dataclass
class Client:
    """What every stream shares: whether chunks are counted now, and what was counted."""

    measuring: bool = False
    latencies: list[float] = field(default_factory=list)
    flowing: int = 0  # streams whose first event came, or that failed before it
    failed: int = 0  # of those, the ones that failed
    errors: list[str] = field(default_factory=list)  # the first few failures
    all_flowing: asyncio.Event = field(default_factory=asyncio.Event)
    count: int = 0

    def settle(self, error: str | None = None) -> None:
        self.flowing += 1
        if error is not None:
            self.failed += 1
        if error is not None and len(self.errors) < MAX_ERRORS:
            self.errors.append(error[:ERROR_BYTES])
        if self.flowing == self.count:
            self.all_flowing.set()


async def stream(port: int, request: bytes, client: Client, open_slot: asyncio.Semaphore) -> None:
    """One request on a connection of its own, its SSE answer read to the end (or the reset)."""
    settled = False
    try:
        async with open_slot:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            client.settle(head.decode(errors="replace"))
            settled = True
            return
        pending = b""  # an event not yet ended
        while True:
            size = int((await reader.readline()).split(b";", 1)[0], 16)
            data = await reader.readexactly(size + 2)  # the chunk's data and its CRLF
            if size == 0:
                return
            now = time.monotonic()
            lines = (pending + data[:-2]).split(b"\n")
            pending = lines.pop()
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                event = orjson.loads(line[6:])
                if not settled:
                    client.settle()
                    settled = True
                if client.measuring and "ts" in event:
                    client.latencies.append(now - event["ts"])
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        if not settled:
            client.settle(f"{type(exc).__name__}: {exc}")
            settled = True
    finally:
        if not settled:
            client.settle("closed before the first event")


async def run(
    port: int, count: int, n: int, step: float, ramp_limit: float, warmup: float, seconds: float,
    request: bytes,
) -> dict[str, object]:  # fmt: skip
    client = Client(count=count)
    open_slot = asyncio.Semaphore(OPEN_BATCH)  # a listen backlog is not what is measured
    started = time.monotonic()
    tasks = [asyncio.create_task(stream(port, request, client, open_slot)) for _ in range(count)]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(client.all_flowing.wait(), ramp_limit)
    ramp = time.monotonic() - started
    await asyncio.sleep(warmup)
    print("start", flush=True)
    client.measuring = True
    window_start = time.monotonic()
    await asyncio.sleep(seconds)
    client.measuring = False
    window = time.monotonic() - window_start
    print("end", flush=True)
    for task in tasks:
        task.cancel()  # the connections close as their tasks end
    await asyncio.gather(*tasks, return_exceptions=True)
    ms = sorted(latency * 1000 for latency in client.latencies)
    offered = count * n * window / step
    result: dict[str, object] = {
        "requests": count, "ramp_s": ramp, "not_started": count - client.flowing
        + client.failed, "errors": client.errors, "window_s": window, "chunks": len(ms),
        "offered": offered, "delivered": len(ms) / offered if offered else math.nan,
    }  # fmt: skip
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100)):
        result[f"{name}_ms"] = percentile(ms, q)
    return result


def main() -> None:
    if len(sys.argv) != 8:
        raise SystemExit(f"usage: {sys.argv[0]} PORT REQUESTS N STEP RAMP WARMUP SECONDS < request")
    port, count, n = (int(a) for a in sys.argv[1:4])
    step, ramp, warmup, seconds = (float(a) for a in sys.argv[4:8])
    request = sys.stdin.buffer.read()
    result = run_async(run(port, count, n, step, ramp, warmup, seconds, request))
    print("result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
