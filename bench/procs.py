"""The servers under test as child processes: start, wait until ready, sample, stop; counters
straight from /proc (Linux only), so the bench needs no psutil."""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import platform
import re
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
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


def _one(pid: int) -> tuple[float, int, int, int, int]:
    proc = Path(f"/proc/{pid}")
    # Fields after the parenthesised command name; utime and stime are 14th and 15th overall.
    stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / _CLOCK_TICKS
    rss_pages = int((proc / "statm").read_text().split()[1])
    io = dict(line.split(": ", 1) for line in (proc / "io").read_text().splitlines())
    fds = len(os.listdir(proc / "fd"))
    return cpu, rss_pages * _PAGE_SIZE, fds, int(io["rchar"]), int(io["wchar"])


def _descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (``--workers`` spawns its workers as children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found = [pid]
    for current in found:  # grows as it goes: breadth first
        found += children.get(current, [])[: max(0, 1000 - len(found))]
    return found


def sample(pid: int, tree: bool = False) -> ProcSample:
    """Counters of ``pid``, or summed over it and its descendants when ``tree``."""
    parts = []
    for each in _descendants(pid) if tree else [pid]:
        with contextlib.suppress(OSError):
            parts.append(_one(each))
    if not parts:
        raise ProcessLookupError(pid)
    cpu, rss, fds, read, written = (sum(column) for column in zip(*parts, strict=True))
    return ProcSample(time.monotonic(), cpu, int(rss), int(fds), int(read), int(written))


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

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def sample(self) -> ProcSample:
        return sample(self.pid, self.tree)


def wait_ready(server: Server, timeout: float = READY_TIMEOUT) -> None:
    """Poll its ready path until any HTTP answer; fail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}:\n{tail}")
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=2)
        try:
            conn.request("GET", server.ready_path)
            conn.getresponse().read()
            return
        except OSError:
            time.sleep(0.05)
        finally:
            conn.close()
    raise RuntimeError(f"{server.name} not ready on port {server.port} after {timeout:.0f} s")


class Fleet:
    """Owns every server it starts and stops them all on exit, in reverse order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.servers: list[Server] = []

    def launch(
        self, name: str, argv: Sequence[str], port: int, ready_path: str,
        env: Mapping[str, str] | None = None, cwd: Path | None = None, tree: bool = False,
    ) -> Server:  # fmt: skip
        """Start without waiting (``wait_ready`` does), so servers boot side by side."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                       cwd=cwd, preexec_fn=_die_with_parent)  # fmt: skip
        server = Server(name, port, process, log, ready_path, tree)
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
            _keep_tail(server.log)
            with contextlib.suppress(ValueError):
                self.servers.remove(server)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(*self.servers)


def _keep_tail(log: Path, size: int = LOG_TAIL_BYTES) -> None:
    """The proxy logs a line per request: keep only the end, where a crash would show."""
    with contextlib.suppress(OSError):
        if log.stat().st_size > size:
            with log.open("rb") as f:
                f.seek(-size, os.SEEK_END)
                tail = f.read()
            log.write_bytes(tail)


def settle(servers: Sequence[Server], timeout: float = SETTLE_TIMEOUT) -> float:
    """Wait until the servers are idle; the seconds it took.

    A server can go on working after the load generator has hung up (LiteLLM's proxy finishes
    the requests queued in it): that work must land in its own turn, not in the next one's.
    """
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        before = sum(_cpu_seconds(servers).values())
        time.sleep(SETTLE_WINDOW)
        if sum(_cpu_seconds(servers).values()) - before <= SETTLE_BUSY * SETTLE_WINDOW:
            break
    return time.monotonic() - started


def _cpu_seconds(servers: Sequence[Server]) -> dict[str, float]:
    cpu: dict[str, float] = {}
    for server in servers:
        with contextlib.suppress(OSError):  # a server that died is left out, not counted 0
            cpu[server.name] = server.sample().cpu_seconds
    return cpu


def _machine_seconds() -> tuple[float, float, float]:
    """CPU seconds since boot over all cores: in processes, in interrupts, stolen by the host.

    Interrupt time is mostly the kernel moving our own loopback packets; steal is the hypervisor
    running other machines on our cores.
    """
    ticks = [int(v) / _CLOCK_TICKS for v in Path("/proc/stat").read_text().split()[1:9]]
    return ticks[0] + ticks[1] + ticks[2], ticks[5] + ticks[6], ticks[7]


def _own_and_children_seconds() -> float:
    """CPU of this process plus its finished children (wrk, the Python load generator)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


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
        self._by_server = _cpu_seconds(self._servers)
        self._start = (time.monotonic(), _machine_seconds(), _own_and_children_seconds())

    def stop(self) -> CpuUse:
        wall = max(time.monotonic() - self._start[0], 1e-9)
        machine, interrupts, steal = (
            (now - then) / wall
            for now, then in zip(_machine_seconds(), self._start[1], strict=True)
        )
        harness = (_own_and_children_seconds() - self._start[2]) / wall
        now, then = _cpu_seconds(self._servers), self._by_server
        by_server = {name: (now[name] - then[name]) / wall for name in now if name in then}
        servers = sum(by_server.values())
        foreign = max(0.0, machine - servers - harness)
        return CpuUse(wall, machine, servers, harness, foreign, interrupts, steal, by_server)


def machine() -> dict[str, Any]:
    """What the results were measured on."""
    names = re.findall(r"^model name\s*: (.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    return {
        "cpus": os.cpu_count(),
        "cpu_model": names[0] if names else "unknown",
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
