"""Chaos: clients of every kind leave at random moments, by RST and by FIN, while a probe asks
``/livez`` every 100 ms. The proxy never freezes, keeps serving, and afterwards holds nothing.

n-proxy and the demo backend run as real processes (``python -m proxy``, with uvloop as in
production; ``python -m proxy.devserver``); the clients are raw sockets driven by a seeded
random generator (``N_PROXY_CHAOS_SEED`` replays a run), bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.client import leave
from tests.support.ports import free_port
from tests.support.rawhttp import parse_raw

T = TypeVar("T")
SEED = int(os.environ.get("N_PROXY_CHAOS_SEED", "23"))
CHAOS_SECONDS = 20.0
MAX_VISITS = 4000
CONCURRENCY = 12  # clients at once: enough to queue children past max_concurrency
MAX_CONCURRENCY = 16
PROBE_EVERY = 0.1
PROBE_BOUND = 1.0  # no /livez may wait longer: the bound, kept on a loaded machine
SETTLE_SECONDS = 20.0
VISIT_SECONDS = 30.0  # a whole answer, queued behind others: a few seconds at most
FD_SLACK = 8  # fds beyond the baseline's, once idle pooled upstream connections are set apart
RSS_SLACK = 16 * 1024 * 1024  # trimmed RSS grew about 1.5 MiB over a run

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
KINDS = ("n1_json", "n1_stream", "fanout_json", "fanout_stream", "upload", "prompts")
# When the client leaves: partway through its request head, partway through its body, at a
# random moment once the request is sent (children queued, connecting, waiting for headers or
# generating), partway through the answer, or never (it reads the whole answer).
MOMENTS = ("before_headers", "mid_body", "after_request", "mid_answer", "complete")


@dataclass(frozen=True)
class Visit:
    kind: str
    moment: str
    rst: bool  # leaves with a reset (SO_LINGER 0), else with a FIN
    request: bytes
    head_bytes: int
    stream: bool
    choices: int
    cut: int  # bytes of the request sent (before_headers, mid_body) or of the answer read
    wait: float  # after_request: seconds before leaving


def plan_visit(rng: random.Random, kind: str | None = None, moment: str | None = None) -> Visit:
    """A random visit (of ``kind``, leaving at ``moment``, when given)."""
    kind = kind or rng.choice(KINDS)
    moment = moment or rng.choice(MOMENTS)
    knobs: dict[str, float] = {"token_delay": rng.choice((0.002, 0.005, 0.01, 0.02))}
    if rng.random() < 0.3:
        knobs["headers_delay"] = round(rng.uniform(0, 0.3), 3)  # a child slow to answer
    body: dict[str, Any] = {"model": "m", "seed": rng.randrange(10_000), "x_demo": knobs}
    n = 1 if kind.startswith("n1") else rng.randint(2, 4)
    stream = kind.endswith("stream") or (kind in ("upload", "prompts") and rng.random() < 0.5)
    prompts = 1
    if kind == "upload":
        path = COMPLETIONS
        n = rng.choice((1, 2))
        body["prompt"] = "word " * rng.randint(10_000, 200_000)  # 50 KB to 1 MB
    elif kind == "prompts":
        path = COMPLETIONS
        n = 2
        prompts = rng.randint(2, 3)
        body["prompt"] = [f"prompt {i}" for i in range(prompts)]
    else:
        path = CHAT
        body["messages"] = [{"role": "user", "content": "hi"}]
    body.update(max_tokens=rng.randint(2, 120), stream=stream)
    if n > 1:
        body["n"] = n
    head, data = request(path, body)
    if moment == "before_headers":
        cut = rng.randint(1, len(head) - 1)
    elif moment == "mid_body":
        cut = len(head) + rng.randint(0, len(data) - 1)
    else:
        cut = rng.randint(1, 4000)
    return Visit(
        kind, moment, rng.random() < 0.5, head + data, len(head), stream, n * prompts, cut,
        rng.uniform(0, 0.2),
    )  # fmt: skip


def request(path: str, body: dict[str, Any]) -> tuple[bytes, bytes]:
    """A POST's head and JSON body; the proxy closes the connection after its answer."""
    data = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head, data


async def run_visit(port: int, visit: Visit) -> str | None:
    """One client's visit; a ``complete`` one returns what was wrong with its answer, if any."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if visit.moment in ("before_headers", "mid_body"):
            sent = visit.request[: visit.cut]
            for at in range(0, len(sent), 64 * 1024):
                writer.write(sent[at : at + 64 * 1024])
                await writer.drain()
            await asyncio.sleep(0.01)
            return None
        writer.write(visit.request)
        await writer.drain()
        if visit.moment == "after_request":
            await asyncio.sleep(visit.wait)
            return None
        answer = b""
        while visit.moment == "complete" or len(answer) < visit.cut:
            chunk = await reader.read(65536)
            if not chunk:
                break
            answer += chunk
        if visit.moment == "complete":
            return check_answer(visit, answer)
        return None
    except (ConnectionError, OSError):
        return None if visit.moment != "complete" else "connection broke"
    finally:
        await leave(writer, visit.rst)


def check_answer(visit: Visit, answer: bytes) -> str | None:
    status, _, body = parse_raw(answer)
    if not status.startswith("HTTP/1.1 200"):
        return f"{visit.kind}: {status} {body[:200]!r}"
    if visit.stream:
        if not body.endswith(b"data: [DONE]\n\n") or b'"error"' in body:
            return f"{visit.kind}: stream cut or failed: {body[-200:]!r}"
        return None
    choices = orjson.loads(body)["choices"]
    if len(choices) != visit.choices:
        return f"{visit.kind}: {len(choices)} choices, not {visit.choices}"
    return None


class Probe(threading.Thread):
    """Asks ``/livez`` every ``PROBE_EVERY`` on a fresh connection, from a thread of its own (its
    clock is not held up by the clients' event loop), and keeps how long each one waited.

    A wait past ``PROBE_BOUND`` sets ``late`` on the test's loop (each probe gives up at 5 s)."""

    def __init__(self, port: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.loop = loop
        self.waits: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.late = asyncio.Event()

    def run(self) -> None:
        while not self.stop.wait(PROBE_EVERY):
            started = time.monotonic()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
                    sock.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    data = b""
                    while chunk := sock.recv(65536):
                        data += chunk
                if not data.startswith(b"HTTP/1.1 200"):
                    self.failures.append(repr(data[:100]))
            except OSError as exc:
                self.failures.append(repr(exc))
            waited = time.monotonic() - started
            self.waits.append(waited)
            if waited >= PROBE_BOUND:
                self.loop.call_soon_threadsafe(self.late.set)


@dataclass
class Rig:
    proxy: subprocess.Popen[bytes]
    backend: subprocess.Popen[bytes]
    port: int
    admin: int
    backend_port: int
    log: Path


def wait_for_port(
    port: int, process: subprocess.Popen[bytes], log: Path, seconds: float = 20
) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text(errors="replace")[-2000:]
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port} after {seconds} s")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    backend_port, port, admin = free_port(), free_port(), free_port()
    config = tmp_path / "n-proxy.yaml"
    config.write_text(
        f"""
listen: {{host: 127.0.0.1, port: {port}}}
admin: {{host: 127.0.0.1, port: {admin}}}
log_level: warning
drain_seconds: 2
drain_grace_seconds: 0.05
upstreams:
  - name: demo
    url: http://127.0.0.1:{backend_port}
    max_concurrency: {MAX_CONCURRENCY}
"""
    )
    log = tmp_path / "proxy.observe.log"
    backend_log_path = tmp_path / "backend.log"
    with backend_log_path.open("wb") as backend_log, log.open("wb") as proxy_log:
        backend = subprocess.Popen(
            [sys.executable, "-m", "proxy.devserver", "--port", str(backend_port)],
            stdout=backend_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_for_port(backend_port, backend, backend_log_path)
            proxy = subprocess.Popen(
                [sys.executable, "-m", "proxy", "--config", str(config)],
                stdout=proxy_log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                wait_for_port(admin, proxy, log)
                wait_for_port(port, proxy, log)
                yield Rig(proxy, backend, port, admin, backend_port, log)
            finally:
                stop(proxy)
        finally:
            stop(backend)


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        async with asyncio.timeout(30):
            answer = await reader.read()
    finally:
        writer.close()
    _, _, body = parse_raw(answer)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


HELD = (
    "n_proxy_requests_in_flight",
    "n_proxy_fanout_children",
    "n_proxy_upstream_connections_in_use",
    "n_proxy_slots_in_use",
    "n_proxy_queue_depth",
    "n_proxy_children_in_flight",
    "n_proxy_replica_outstanding",
    "n_proxy_client_connections",
)


async def held(rig: Rig) -> dict[str, float]:
    """Every lifecycle count the proxy exports, summed over its labels, and what the backend
    still generates."""
    values = await scrape(rig.admin)
    out = {name: 0.0 for name in HELD}
    for (name, _), value in values.items():
        if name in out:
            out[name] += value
    backend = await scrape(rig.backend_port)
    out["devserver_requests_running"] = backend[("devserver_requests_running", ())]
    out["idle"] = values[("n_proxy_upstream_connections_idle", ())]
    return out


async def settled(rig: Rig) -> dict[str, float]:
    """The counts once they are all 0 at once (idle connections aside), or at the deadline."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        counts = await held(rig)
        if not any(v for k, v in counts.items() if k != "idle") or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.1)


def resident(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return 1024 * next(int(line.split()[1]) for line in status.splitlines() if line[:6] == "VmRSS:")


async def resources(rig: Rig) -> tuple[int, int]:
    """Resident memory in bytes, once trimmed, and open file descriptors, from /proc.

    glibc keeps freed pages until ``malloc_trim``, which the proxy calls shortly after a large
    request (proxy.server.memory): one is sent, and the lowest RSS of the next two seconds is
    kept."""
    head, data = request(COMPLETIONS, {"model": "m", "prompt": "word " * 250_000, "max_tokens": 1})
    visit = Visit("upload", "complete", False, head + data, len(head), False, 1, 0, 0.0)
    async with asyncio.timeout(VISIT_SECONDS):
        assert await run_visit(rig.port, visit) is None
    lowest = resident(rig.proxy.pid)
    for _ in range(20):
        await asyncio.sleep(0.1)
        lowest = min(lowest, resident(rig.proxy.pid))
    return lowest, len(os.listdir(f"/proc/{rig.proxy.pid}/fd"))


async def every_kind_once(rig: Rig, rng: random.Random) -> list[str]:
    """Two complete visits of each kind: what was wrong with any answer."""
    problems = []
    for kind in KINDS:
        for _ in range(2):
            visit = plan_visit(rng, kind, "complete")
            try:
                async with asyncio.timeout(VISIT_SECONDS):
                    problem = await run_visit(rig.port, visit)
            except TimeoutError:
                problem = f"{kind}: no whole answer within {VISIT_SECONDS} s"
            if problem is not None:
                problems.append(problem)
    return problems


@pytest.fixture
async def probe(rig: Rig) -> AsyncIterator[Probe]:
    probe = Probe(rig.admin, asyncio.get_running_loop())
    probe.start()
    yield probe
    probe.stop.set()
    await asyncio.to_thread(probe.join, 15)


async def unless_frozen(probe: Probe, rig: Rig, work: Awaitable[T], visits: Callable[[], int]) -> T:
    """``work``'s result, or the test fails the moment a probe waits past its bound: a frozen
    proxy would leave every client and check to its own timeout."""
    task = asyncio.ensure_future(work)
    late = asyncio.ensure_future(probe.late.wait())
    await asyncio.wait([task, late], return_when=asyncio.FIRST_COMPLETED)
    late.cancel()
    if not task.done():
        task.cancel()
    await asyncio.gather(task, late, return_exceptions=True)
    if probe.late.is_set():
        cpu = await cpu_share(rig.proxy.pid)
        log = rig.log.read_text(errors="replace")[-2000:]
        pytest.fail(
            f"/livez waited {max(probe.waits):.1f} s (bound {PROBE_BOUND} s) after {visits()} "
            f"visits; the proxy uses {cpu:.0%} of a CPU now\n{log}"
        )
    return task.result()


async def test_clients_leaving_at_any_moment_never_freeze_the_proxy_or_strand_what_they_held(
    rig: Rig, probe: Probe
) -> None:
    rng = random.Random(SEED)
    warm = await every_kind_once(rig, rng)
    assert not warm, warm
    before = await settled(rig)
    assert not any(v for k, v in before.items() if k != "idle"), before
    rss_before, fds_before = await resources(rig)

    seen: Counter[tuple[str, str, bool]] = Counter()
    problems: list[str] = []
    stuck: list[Visit] = []
    deadline = time.monotonic() + CHAOS_SECONDS

    async def client() -> None:
        while time.monotonic() < deadline and sum(seen.values()) < MAX_VISITS:
            visit = plan_visit(rng)
            seen[visit.kind, visit.moment, visit.rst] += 1
            try:
                async with asyncio.timeout(VISIT_SECONDS):
                    problem = await run_visit(rig.port, visit)
            except TimeoutError:
                stuck.append(visit)
                continue
            if problem is not None:
                problems.append(problem)

    async def chaos_then_checks() -> tuple[list[str], dict[str, float], tuple[int, int]]:
        await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
        after_chaos = await every_kind_once(rig, rng)  # the proxy goes on serving everyone
        return after_chaos, await settled(rig), await resources(rig)

    after_chaos, counts, (rss_after, fds_after) = await unless_frozen(
        probe, rig, chaos_then_checks(), lambda: sum(seen.values())
    )
    metrics = await scrape(rig.admin)
    probe.stop.set()
    await asyncio.to_thread(probe.join, 15)

    log = rig.log.read_text(errors="replace")[-4000:]
    assert rig.proxy.poll() is None, log
    assert len(probe.waits) >= CHAOS_SECONDS / PROBE_EVERY / 2, len(probe.waits)
    assert not probe.failures, probe.failures[:5]
    assert max(probe.waits) < PROBE_BOUND, sorted(probe.waits)[-5:]
    # Every kind left at every moment, by RST and by FIN: the run did what it says.
    assert {(k, m) for k, m, _ in seen} == {(k, m) for k in KINDS for m in MOMENTS}, seen
    assert {rst for _, _, rst in seen} == {True, False}
    aborted = sum(v for (name, _), v in metrics.items() if name == "n_proxy_children_aborted_total")
    assert aborted > 0  # children were cut short, not all left to finish
    assert not stuck, stuck[:5]
    assert not problems, problems[:10]
    assert not after_chaos, after_chaos
    left = {k: v for k, v in counts.items() if v and k != "idle"}
    assert not left, f"still held {SETTLE_SECONDS:g} s after the chaos: {left}\n{log}"
    # Idle pooled upstream connections are kept for reuse, each an fd: set them apart.
    fds_held = fds_after - counts["idle"] - (fds_before - before["idle"])
    assert fds_held <= FD_SLACK, (fds_before, before["idle"], fds_after, counts["idle"])
    assert rss_after <= rss_before + RSS_SLACK, (rss_before, rss_after)
    # A client that leaves is never the proxy's error: no warning or error line (the proxy
    # logs at warning here), no traceback from a write to a socket that is gone.
    loud = [
        line
        for line in rig.log.read_text(errors="replace").splitlines()
        if '"level":"error"' in line or '"level":"warning"' in line or "Traceback" in line
    ]
    assert not loud, loud[:5]


async def cpu_share(pid: int, seconds: float = 1.0) -> float:
    """The share of one CPU ``pid`` uses over ``seconds`` (from /proc: user + system ticks)."""

    def ticks() -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[11]) + int(fields[12])  # utime, stime

    start = ticks()
    await asyncio.sleep(seconds)
    return (ticks() - start) / os.sysconf("SC_CLK_TCK") / seconds
