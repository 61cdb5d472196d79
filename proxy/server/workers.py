"""Several worker processes on one listening port (SO_REUSEPORT), to use more than one core.

The parent only supervises: it forwards SIGTERM and SIGINT (and SIGHUP: each worker reloads the
config itself, ``proxy.server.process``), waits while the workers drain (a
worker still there ``EXIT_MARGIN`` past ``drain_seconds`` is killed), and exits non-zero if a
worker dies. Worker 0 alone serves the admin port; its ``/metrics`` adds up
every worker through prometheus-client's multiprocess mode. The configured limits are the
proxy's, not each worker's: every worker enforces its share of them (``worker_config``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from types import FrameType

from proxy.config import Config, ConfigError
from proxy.observe import setup_logging
from proxy.server.process import Loader, Server, install_uvloop, run
from proxy.server.startup import NotStarted, check_listen, report, start

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
MiB = 1024 * 1024
# What ``--workers auto`` budgets per worker against the cgroup memory limit. One worker idles at
# about 54 MiB RSS and stays near 63 MiB through 512 concurrent stream children (measured against
# the demo backend); the rest is room for bodies up to max_body_bytes and max_response_bytes.
WORKER_MEMORY_BYTES = 256 * MiB
SUPERVISOR_MEMORY_BYTES = 64 * MiB  # the parent process: Python, the imports, no requests
_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
# Past drain_seconds, what a stopping worker may take to exit (its listeners closed, the last
# spans sent: a few seconds) before it is killed; a worker that hangs must not hold the exit.
EXIT_MARGIN = 10.0
_POLL = 1.0  # seconds between the supervisor's looks at its workers


def auto_workers(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """``--workers auto``: one worker per CPU of the cgroup quota, as many as its memory limit
    holds at ``WORKER_MEMORY_BYTES`` each (after the supervisor's share), and at least one.

    A pod with a memory limit and no CPU limit (the usual way to run a latency-sensitive proxy)
    would otherwise start one worker per CPU of the node, and be OOM-killed under load.
    """
    cpus = available_cpus(cgroup)
    limit = memory_limit(cgroup)
    if limit is None:
        return cpus
    return max(1, min(cpus, (limit - SUPERVISOR_MEMORY_BYTES) // WORKER_MEMORY_BYTES))


def memory_limit(cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """This cgroup's memory limit in bytes (a pod's memory limit), or None when there is none.

    cgroup v2 ``memory.max`` ("max" or bytes), else v1 ``memory/memory.limit_in_bytes``.
    """
    with contextlib.suppress(OSError, ValueError):
        text = (cgroup / "memory.max").read_text().strip()
        return None if text == "max" else int(text)
    with contextlib.suppress(OSError, ValueError):
        limit = int((cgroup / "memory" / "memory.limit_in_bytes").read_text())
        return None if limit <= 0 or limit >= _UNLIMITED else limit
    return None


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


def worker_config(config: Config, index: int, count: int) -> Config:
    """The config of worker ``index`` of ``count``: its share of every proxy-wide limit.

    ``max_connections`` and each upstream's ``max_concurrency`` and ``max_queue`` are divided so
    that the shares add up to the configured value: the first ``total % count`` workers take one
    more than ``total // count``. The retry budget's floor (``min_per_second``) is split evenly;
    its ``percent`` is of each worker's own requests, so it holds for the sum as it is. Worker 0
    alone serves the admin port. A process cannot see
    another's connections or slots without shared state on the hot path, so the limits are
    divided, not shared: a worker whose share is taken queues or refuses (429) even if another
    has room (the kernel spreads connections over the workers, not requests).
    """
    check_worker_count(config, count)
    upstreams = tuple(
        upstream.model_copy(
            update={
                "max_concurrency": _share(upstream.max_concurrency, index, count),
                "max_queue": _share(upstream.max_queue, index, count),
                "retry_budget": upstream.retry_budget.model_copy(
                    update={"min_per_second": upstream.retry_budget.min_per_second / count}
                ),
            }
        )
        for upstream in config.upstreams
    )
    update: dict[str, object] = {
        "upstreams": upstreams,
        "max_connections": _share(config.max_connections, index, count),
    }
    if index > 0:
        update["admin"] = None
    return config.model_copy(update=update)


def max_workers(config: Config) -> int:
    """The most workers the limits can be divided among (``check_worker_count``)."""
    return min([config.max_connections, *(u.max_concurrency for u in config.upstreams)])


def check_worker_count(config: Config, count: int) -> None:
    """Every worker needs at least one connection and one upstream slot of its own."""
    limits = [("max_connections", config.max_connections)] + [
        (f"upstreams[{i}].max_concurrency", u.max_concurrency)
        for i, u in enumerate(config.upstreams)
    ]
    for key, total in limits:
        if total < count:
            raise ConfigError(
                f"{key}: {total} cannot be divided among {count} workers (each needs at least "
                f"one); run at most {total} workers or raise it"
            )


def _share(total: int, index: int, count: int) -> int:
    return total // count + (1 if index < total % count else 0)


def run_workers(config: Config, count: int, loader: Loader | None = None) -> int:
    """``loader`` (picklable: the workers are spawned) reads the config again on SIGHUP.
    ``NotStarted`` when the proxy's or the admin address cannot be bound: no worker starts."""
    check_worker_count(config, count)
    check_listen(config)
    metrics_dir = tempfile.mkdtemp(prefix="n-proxy-metrics-")
    os.environ[METRICS_DIR_ENV] = metrics_dir  # inherited by the spawned workers
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(
            target=_work, args=(config, index, count, loader), name=f"n-proxy-worker-{index}"
        )
        for index in range(count)
    ]
    stopping_since: float | None = None

    def stop(signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        nonlocal stopping_since
        if stopping_since is None:
            stopping_since = time.monotonic()
        for worker in workers:
            if worker.pid is not None and worker.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGTERM)

    def reload(signum: int, frame: FrameType | None) -> None:
        for worker in workers:
            if worker.pid is not None and worker.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGHUP)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, reload)
    failed = False
    try:
        for worker in workers:
            worker.start()
        while running := [w for w in workers if w.exitcode is None]:
            wait([w.sentinel for w in running], _POLL)
            died = [w for w in workers if w.exitcode not in (None, 0)]
            if died and stopping_since is None:
                failed = True
                stop()  # one worker gone: stop the rest and let the orchestrator restart us
            if stopping_since is None:
                continue
            if time.monotonic() - stopping_since > config.drain_seconds + EXIT_MARGIN:
                for worker in running:
                    if worker.exitcode is None:
                        worker.kill()  # it outlived its drain: the exit is not held for it
                        failed = True
        return 1 if failed or any(w.exitcode for w in workers) else 0
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def announce(line: str) -> None:
    """``line`` and its newline to stdout in one write: the workers share the stream, and
    ``print`` writes the two apart when unbuffered (``PYTHONUNBUFFERED``), so one worker's
    banner could land between another's and its newline."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _work(config: Config, index: int, count: int, loader: Loader | None) -> None:
    config = worker_config(config, index, count)
    reload: Callable[[], Config] | None = None
    if loader is not None:
        source = loader

        def reload() -> Config:
            return worker_config(source(), index, count)  # this worker's share, as at start

    setup_logging(config.log_format, config.log_level)
    install_uvloop()
    # The parent decides when to stop; a terminal's Ctrl-C reaches us through it as SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A SIGHUP the supervisor forwards before this worker serves must not end it (the default
    # action); once it serves, the reload handler replaces this.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # The supervisor holds its end of this pipe open while it lives. Killed (SIGKILL, the OOM
    # killer), it forwards no SIGTERM: its end closing stops the worker as a SIGTERM would, or the
    # worker would serve on, unsupervised, on the shared port.
    parent = multiprocessing.parent_process()
    supervisor = None if parent is None else parent.sentinel

    async def serve() -> None:
        server = Server(config, reuse_port=True, loader=reload)
        await start(server)
        where = f"http://{config.listen.host}:{server.proxy_port}"
        banner = f"n-proxy: worker {index} (pid {os.getpid()}) listening on {where}"
        await run(
            server, signals=(signal.SIGTERM,), ready=lambda: announce(banner), supervisor=supervisor
        )

    try:
        asyncio.run(serve())
    except NotStarted as failure:
        # One line, no traceback; the supervisor sees the status, stops the others and fails.
        sys.exit(report(failure, worker=index))
