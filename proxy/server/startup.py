"""Start-up failures: whatever keeps the proxy from serving is one error line in the log's format,
never a traceback, and an exit status that says which kind it was (docs/operating.md#exit-status).

A usage or config error (a bad flag value, a config file that cannot be read or does not validate,
a ``--workers`` count the limits cannot be divided among) exits 2, as argparse's own usage errors
do; anything else that stops the start (a port in use, an address that cannot be bound, the demo
backend) exits 1.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from proxy.config import Config, Listen
from proxy.observe import log_event
from proxy.server.process import Server

USAGE: Final = 2  # a bad flag value or config: fix the command or the file
FAILED: Final = 1  # the start failed (or, under --workers, a worker did)


class NotStarted(Exception):
    """Why the proxy did not start: one line's message and fields, and the exit status."""

    def __init__(self, message: str, status: int, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.fields = fields


def report(failure: NotStarted, **more: Any) -> int:
    """``failure`` as one error line (the log set up already: ``setup_logging``); its status."""
    log_event(failure.message, "error", **failure.fields, **more)
    return failure.status


def cannot_listen(listen: Listen, listener: str, exc: OSError) -> NotStarted:
    """A listener that could not be bound: in use, an address not on this host, a host name
    that does not resolve (``socket.gaierror``, an OSError too)."""
    return NotStarted(
        "cannot listen; not started",
        FAILED,
        listener=listener,
        host=listen.host,
        port=listen.port,
        error=str(exc),
    )


async def start(server: Server) -> None:
    """``server.start()``, or ``NotStarted`` naming the listener that could not be bound, with
    whatever the server had opened closed again: nothing is left to log at the exit."""
    try:
        await server.start()
    except OSError as exc:
        # The proxy's port is known once its listener is bound; the admin listener comes after.
        config = server.config
        if server.proxy_port == 0 or config.admin is None:
            failure = cannot_listen(config.listen, "proxy", exc)
        else:
            failure = cannot_listen(config.admin, "admin", exc)
    else:
        return
    await server.close()
    raise failure


async def _bind(listen: Listen, reuse_port: bool) -> None:
    server = await asyncio.get_running_loop().create_server(
        asyncio.Protocol,
        listen.host,
        listen.port,
        reuse_address=True,
        reuse_port=reuse_port or None,
        start_serving=False,  # bound, never listening: no connection lands in its backlog
    )
    server.close()
    await server.wait_closed()


def check_listen(config: Config) -> None:
    """Bind each address once, as the workers will (the proxy's with ``SO_REUSEPORT``, by
    every worker; the admin one by worker 0), and let it go: a port another program holds or
    an address this host does not have is then one line from the supervisor, not one from
    each worker while the others start and are stopped again."""
    listeners = [("proxy", config.listen, True)]
    if config.admin is not None:
        listeners.append(("admin", config.admin, False))
    for listener, listen, reuse_port in listeners:
        try:
            asyncio.run(_bind(listen, reuse_port))
        except OSError as exc:
            raise cannot_listen(listen, listener, exc) from None
