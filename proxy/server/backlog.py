"""The listen backlog of every listener the package opens: the proxy's, the admin's and the
demo backend's."""

from __future__ import annotations

import contextlib
from pathlib import Path

# nginx's. aiohttp's default of 128 overflows when a proxy opens its max_concurrency
# connections to one origin at once: SYN cookies, dropped SYNs, connects retried after 1 s.
FLOOR = 511
SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


def listen_backlog(somaxconn: Path = SOMAXCONN) -> int:
    """Connections the kernel may hold for ``accept``: the system's ``somaxconn`` (Linux caps
    any larger request to it), and at least ``FLOOR`` where it is larger or unknown."""
    with contextlib.suppress(OSError, ValueError):
        return max(FLOOR, int(somaxconn.read_text()))
    return FLOOR
