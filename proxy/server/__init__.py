"""The process: the aiohttp app, the listeners and client connections, the admin endpoints, drain on
SIGTERM, workers and memory.
"""

from proxy.server.backlog import listen_backlog
from proxy.server.process import Server, install_uvloop, run
from proxy.server.startup import FAILED, USAGE, NotStarted, report, start
from proxy.server.workers import (
    WORKER_MEMORY_BYTES,
    MiB,
    auto_workers,
    check_worker_count,
    max_workers,
    run_workers,
)

__all__ = [
    "FAILED",
    "USAGE",
    "WORKER_MEMORY_BYTES",
    "MiB",
    "NotStarted",
    "Server",
    "auto_workers",
    "check_worker_count",
    "install_uvloop",
    "listen_backlog",
    "max_workers",
    "report",
    "run",
    "run_workers",
    "start",
]
