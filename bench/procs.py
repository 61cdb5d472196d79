"""The servers under test as child processes: start, wait until ready, sample, stop; their
counters and the machine's read by psutil (Linux: from /proc)."""

import contextlib
import ctypes
import http.client
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

_PR_SET_PDEATHSIG = 1
READY_TIMEOUT = 60.0  # LiteLLM's proxy takes a while to import
STOP_TIMEOUT = 5.0
LOG_TAIL_BYTES = 256 * 1024
SETTLE_WINDOW = 0.2  # seconds
SETTLE_BUSY = 0.1  # cores: below this, the servers count as idle
SETTLE_TIMEOUT = 30.0


@dataclass(frozen=True)
class ProcSample:
    """One look at a process: CPU seconds so far, memory, open fds and socket byte counts."""

    at: float  # time.monotonic()
    cpu_seconds: float
    rss_bytes: int
    fds: int
    read_bytes: int  # /proc/PID/io rchar: uvloop reads sockets with read(2), so this counts them
    written_bytes: int


def switches(pid: int) -> tuple[int, int]:
    """Voluntary and involuntary context switches of every thread of ``pid`` (the process's own
    /proc status counts its first thread only, and a Rust gateway works in others)."""
    voluntary = involuntary = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    voluntary += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    involuntary += int(line.split()[1])
    return voluntary, involuntary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """Runs in the child before exec: a crashed harness must not leave servers behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Server:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    ready_path: str
    tree: bool = False  # it forks workers: count them in
    ready_ok: bool = False  # only a 2xx answer on ready_path means ready (else: any answer)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def sample(self) -> ProcSample:
        """Its counters, summed over it and every process below it when ``tree`` (``--workers``
        and nginx fork their workers as children)."""
        root = psutil.Process(self.pid)
        parts = []
        for each in [root, *(root.children(recursive=True) if self.tree else [])]:
            with contextlib.suppress(psutil.NoSuchProcess), each.oneshot():  # a worker gone
                cpu, io = each.cpu_times(), each.io_counters()
                rss, fds = each.memory_info().rss, each.num_fds()
                parts.append((cpu.user + cpu.system, rss, fds, io.read_chars, io.write_chars))
        if not parts:
            raise psutil.NoSuchProcess(self.pid)
        cpu_seconds, *counts = (sum(column) for column in zip(*parts, strict=True))
        return ProcSample(time.monotonic(), cpu_seconds, *(int(count) for count in counts))


def wakeups(server: Server) -> int:
    """The voluntary context switches of ``server`` so far (its workers' too, when ``tree``):
    one each time an event loop, or a Tokio worker, sleeps and is woken again."""
    total = 0
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(server.pid)
        for each in [root, *(root.children(recursive=True) if server.tree else [])]:
            total += switches(each.pid)[0]
    return total


def wait_ready(server: Server, timeout: float = READY_TIMEOUT) -> None:
    """Poll its ready path until any HTTP answer (a 2xx one for a server marked ``ready_ok``);
    fail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}:\n{tail}")
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=2)
        try:
            conn.request("GET", server.ready_path)
            answer = conn.getresponse()
            answer.read()
            if not server.ready_ok or 200 <= answer.status < 300:
                return
            time.sleep(0.05)
        except OSError:
            time.sleep(0.05)
        finally:
            conn.close()
    raise RuntimeError(f"{server.name} not ready on port {server.port} after {timeout:.0f} s")


class Fleet(contextlib.AbstractContextManager["Fleet"]):
    """Owns every server it starts and stops them all on exit, in reverse order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.servers: list[Server] = []

    def launch(
        self, name: str, argv: Sequence[str], ready_path: str = "/health", port: int | None = None,
        env: Mapping[str, str] | None = None, cwd: Path | None = None, tree: bool = False,
        ready_ok: bool = False,
    ) -> Server:  # fmt: skip
        """Start without waiting (``wait_ready`` does), so servers boot side by side; on ``port``
        when its config names one, else on a free one given as ``--port``."""
        if port is None:
            port = free_port()
            argv = [*argv, "--port", str(port)]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                       cwd=cwd, preexec_fn=_die_with_parent)  # fmt: skip
        server = Server(name, port, process, log, ready_path, tree, ready_ok)
        self.servers.append(server)
        return server

    def stop(self, *servers: Server) -> None:
        """SIGTERM all at once (each drains for a moment), then wait; SIGKILL stragglers."""
        for server in servers:
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for server in servers:
            try:
                server.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait(STOP_TIMEOUT)
            # The proxy logs a line per request: keep only the end, where a crash would show.
            with contextlib.suppress(OSError):
                if server.log.stat().st_size > LOG_TAIL_BYTES:
                    server.log.write_bytes(server.log.read_bytes()[-LOG_TAIL_BYTES:])
            with contextlib.suppress(ValueError):
                self.servers.remove(server)

    def __exit__(self, *exc: object) -> None:
        self.stop(*self.servers)


def settle(servers: Sequence[Server], timeout: float = SETTLE_TIMEOUT) -> None:
    """Wait until the servers are idle (``timeout`` seconds at most).

    A server can go on working after the load generator has hung up (LiteLLM's proxy finishes
    the requests queued in it): that work must land in its own turn, not in the next one's.
    """
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        before = sum(_cpu_seconds(servers).values())
        time.sleep(SETTLE_WINDOW)
        if sum(_cpu_seconds(servers).values()) - before <= SETTLE_BUSY * SETTLE_WINDOW:
            break


def _cpu_seconds(servers: Sequence[Server]) -> dict[str, float]:
    cpu: dict[str, float] = {}
    for server in servers:
        with contextlib.suppress(psutil.Error):  # a server that died is left out, not counted 0
            cpu[server.name] = server.sample().cpu_seconds
    return cpu


@dataclass(frozen=True)
class CpuUse:
    """CPU used during one measurement, in cores (CPU seconds per wall second)."""

    wall_seconds: float
    machine: float  # every process on the machine
    servers: float  # the servers under test
    harness: float  # this process and the load generator it ran
    foreign: float  # every other process: other work on a shared machine skews the numbers
    interrupts: float  # irq and softirq, mostly loopback networking
    steal: float  # taken by the hypervisor for other virtual machines
    by_server: dict[str, float]


class CpuWatch:
    """Brackets a measurement to tell how much of the machine the bench itself used."""

    def __init__(self, servers: Sequence[Server]) -> None:
        self._servers = list(servers)
        self._start, self._by_server = self._now(), _cpu_seconds(self._servers)

    @staticmethod
    def _now() -> tuple[float, float, float, float, float]:
        """Wall time, then CPU seconds: since boot over all cores in processes, in interrupts
        (mostly the kernel moving our own loopback packets) and stolen by the hypervisor for
        other machines; of this process plus its finished children (wrk, the Python load
        generator: user, system, children's user and system)."""
        t = psutil.cpu_times()
        harness = sum(psutil.Process().cpu_times()[:4])
        return time.monotonic(), t.user + t.nice + t.system, t.irq + t.softirq, t.steal, harness

    def stop(self) -> CpuUse:
        now, then = self._now(), self._start
        wall = max(now[0] - then[0], 1e-9)
        machine, interrupts, steal, harness = (
            (a - b) / wall for a, b in zip(now[1:], then[1:], strict=True)
        )
        after, before = _cpu_seconds(self._servers), self._by_server
        by_server = {name: (after[name] - before[name]) / wall for name in after if name in before}
        servers = sum(by_server.values())
        foreign = max(0.0, machine - servers - harness)
        return CpuUse(wall, machine, servers, harness, foreign, interrupts, steal, by_server)
