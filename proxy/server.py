"""Running the proxy and admin listeners, and draining them gracefully on SIGTERM or SIGINT.

Drain: readiness fails at once; new connections are still served for ``drain_grace_seconds``
(load balancers take a moment to notice); in-flight requests then get up to ``drain_seconds`` in
all, after which fan-out streams are cut cleanly (one error event and ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

from aiohttp import web

from proxy.admin import build_admin_app
from proxy.app import build_app
from proxy.config import Config
from proxy.log import log_event
from proxy.runtime import Runtime

_CUT_GRACE = 1.0  # seconds for cut streams to write their last event before sockets close


class Server:
    def __init__(self, config: Config, *, reuse_port: bool = False) -> None:
        self.config = config
        self.reuse_port = reuse_port
        self.runtime = Runtime(config)
        self._proxy = web.AppRunner(
            build_app(config, self.runtime),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=_CUT_GRACE,
        )
        self._admin = web.AppRunner(build_admin_app(self.runtime), access_log=None)
        self._proxy_site: web.TCPSite | None = None
        self.proxy_port = 0
        self.admin_port = 0

    async def start(self) -> None:
        await self._proxy.setup()
        listen = self.config.listen
        self._proxy_site = web.TCPSite(
            self._proxy, listen.host, listen.port, reuse_port=self.reuse_port or None
        )
        await self._proxy_site.start()
        self.proxy_port = _port(self._proxy)
        if self.config.admin is not None:
            await self._admin.setup()
            admin = self.config.admin
            await web.TCPSite(self._admin, admin.host, admin.port).start()
            self.admin_port = _port(self._admin)

    async def drain(self) -> None:
        runtime = self.runtime
        runtime.draining = True
        grace = min(self.config.drain_grace_seconds, self.config.drain_seconds)
        log_event("draining", in_flight=runtime.in_flight, drain_seconds=self.config.drain_seconds)
        await asyncio.sleep(grace)
        if self._proxy_site is not None:
            await self._proxy_site.stop()
        try:
            await asyncio.wait_for(runtime.wait_idle(), self.config.drain_seconds - grace)
        except TimeoutError:
            log_event("drain time is up; cutting streams", in_flight=runtime.in_flight)
            runtime.cut_streams("the proxy is shutting down")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(runtime.wait_idle(), _CUT_GRACE)

    async def close(self) -> None:
        await self._proxy.cleanup()
        await self._admin.cleanup()


async def run(
    server: Server, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
) -> None:
    """Serve until one of ``signals``, then drain and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        await server.drain()
    finally:
        await server.close()


def install_uvloop() -> None:
    """uvloop when installed (the ``fast`` extra): a quicker event loop, same behaviour."""
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _port(runner: web.AppRunner) -> int:
    address = runner.addresses[0]
    return int(address[1])
