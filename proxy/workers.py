"""Several worker processes on one listening port (SO_REUSEPORT), to use more than one core.

The parent only supervises: it forwards SIGTERM and SIGINT, waits while the workers drain, and
exits non-zero if a worker dies. Worker 0 alone serves the admin port; its ``/metrics`` adds up
every worker through prometheus-client's multiprocess mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import shutil
import signal
import tempfile
from multiprocessing.connection import wait
from pathlib import Path
from types import FrameType

from proxy.config import Config
from proxy.log import setup_logging
from proxy.server import Server, install_uvloop, run

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def available_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may use: its cgroup quota (a pod's CPU limit) within its affinity.

    cgroup v2 ``cpu.max`` ("max 100000" or "200000 100000"), else v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``; a fractional quota rounds up (1.5 CPUs run two workers), never below 1.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    quota = _cgroup_quota(cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return cpus


def _cgroup_quota(cgroup: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        limit, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if limit == "max" else int(limit) / int(period)
    for folder in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        with contextlib.suppress(OSError, ValueError):
            micros = int((cgroup / folder / "cpu.cfs_quota_us").read_text())
            every = int((cgroup / folder / "cpu.cfs_period_us").read_text())
            return None if micros <= 0 or every <= 0 else micros / every
    return None


def run_workers(config: Config, count: int) -> int:
    metrics_dir = tempfile.mkdtemp(prefix="n-proxy-metrics-")
    os.environ[METRICS_DIR_ENV] = metrics_dir  # inherited by the spawned workers
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=_work, args=(config, index), name=f"n-proxy-worker-{index}")
        for index in range(count)
    ]
    stopping = False

    def stop(signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        nonlocal stopping
        stopping = True
        for worker in workers:
            if worker.pid is not None and worker.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    failed = False
    try:
        for worker in workers:
            worker.start()
        while running := [w for w in workers if w.exitcode is None]:
            wait([w.sentinel for w in running])
            died = [w for w in workers if w.exitcode not in (None, 0)]
            if died and not stopping:
                failed = True
                stop()  # one worker gone: stop the rest and let the orchestrator restart us
        return 1 if failed or any(w.exitcode for w in workers) else 0
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _work(config: Config, index: int) -> None:
    if index > 0:
        config = config.model_copy(update={"admin": None})
    setup_logging(config.log_format, config.log_level)
    install_uvloop()
    # The parent decides when to stop; a terminal's Ctrl-C reaches us through it as SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def serve() -> None:
        server = Server(config, reuse_port=True)
        await server.start()
        where = f"http://{config.listen.host}:{server.proxy_port}"
        print(f"n-proxy: worker {index} (pid {os.getpid()}) listening on {where}", flush=True)
        await run(server, signals=(signal.SIGTERM,))

    asyncio.run(serve())
