"""A loopback port for a test's own server or subprocess."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listened on a moment ago (the kernel's pick on 127.0.0.1)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
