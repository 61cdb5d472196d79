"""Running the proxy and admin listeners, reloading the config on SIGHUP, and draining them
gracefully on SIGTERM or SIGINT.

Drain: readiness fails at once; new connections are still served for ``drain_grace_seconds``
(load balancers take a moment to notice); in-flight requests then get up to ``drain_seconds`` in
all, after which fan-out streams are cut cleanly (one error event and ``[DONE]``).

Reload: the file is read and validated again, as ``check-config`` does; a config that loads
serves every new request (``proxy.server.generations``) while the requests in flight end on the
old one; one that does not is logged in one line naming its key, and the old one stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import resource
import signal
from collections.abc import Callable

from aiohttp import web

from proxy.config import Config, ConfigError
from proxy.http import stream_path_compiled
from proxy.observe import ClientErrors, Metrics, log_event, tracing_from_env
from proxy.request import InFlight
from proxy.server.admin import build_admin_app
from proxy.server.app import GENERATIONS, build_app
from proxy.server.connection import ClientConnection, ConnectionCap, ErrorPages, Listener
from proxy.server.generations import Generations
from proxy.server.memory import settle_collector
from proxy.upstream import Upstreams

_CUT_GRACE = 1.0  # seconds for cut streams to write their last event before sockets close
_FLUSH_SECONDS = 5.0  # spans batched at shutdown get what is left of the drain, up to this
_SPARE_FDS = 256  # beyond client and upstream connections: admin, logs, DNS, health checks
# What a reload cannot change in a running process: the sockets are bound, the app's body limit
# and the log handlers set. A reloaded file that changes them keeps the running values, and says
# so; the rest (routes, upstreams, limits, headers, placement, timeouts...) takes effect.
RESTART_KEYS = ("listen", "admin", "max_body_bytes", "log_format", "log_level")

Loader = Callable[[], Config]  # reads and validates the config file again; raises ConfigError


class Server:
    def __init__(
        self,
        config: Config,
        *,
        reuse_port: bool = False,
        notice: str | None = None,
        loader: Loader | None = None,
    ) -> None:
        """``loader``: how SIGHUP reloads the config (None: there is no file to read again)."""
        self.config = config
        self.loader = loader
        self.reuse_port = reuse_port
        self.metrics = Metrics()
        self.tracing = tracing_from_env()
        self.in_flight = InFlight()
        self.client_errors = ClientErrors(self.metrics)  # one count and log budget for both
        app = build_app(
            config,
            metrics=self.metrics,
            in_flight=self.in_flight,
            client_errors=self.client_errors,
            tracing=self.tracing,
            notice=notice,
        )
        self.generations: Generations = app[GENERATIONS]
        self._proxy = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=_CUT_GRACE
        )
        self._admin = web.AppRunner(
            build_admin_app(self.in_flight, self.generations, self.metrics),
            access_log=None,
            shutdown_timeout=_CUT_GRACE,
        )
        self._proxy_site: Listener | None = None
        self._cap: ConnectionCap | None = None
        self._reloading = asyncio.Lock()
        self._drain_ends: float | None = None  # loop time by which the drain is to be over
        self.proxy_port = 0
        self.admin_port = 0

    @property
    def upstreams(self) -> Upstreams:
        """The current config's upstreams."""
        return self.generations.upstreams

    async def start(self) -> None:
        if not stream_path_compiled():
            log_event(
                "the stream path runs as pure Python: this build compiled none of it (setup.py)"
            )
        await self._proxy.setup()
        _raise_fd_limit(self.config)
        listen = self.config.listen
        errors = self.client_errors
        cap = self._cap = ConnectionCap(self.config, self.metrics, errors)
        connection = functools.partial(ClientConnection, cap)
        self._proxy_site = Listener(
            self._proxy, listen.host, listen.port, connection, self.reuse_port
        )
        await self._proxy_site.start()
        self.proxy_port = _port(self._proxy)
        if self.config.admin is not None:
            await self._admin.setup()
            admin = self.config.admin
            pages = functools.partial(ErrorPages, errors)
            await Listener(self._admin, admin.host, admin.port, pages).start()
            self.admin_port = _port(self._admin)

    async def reload(self) -> bool:
        """Read and validate the config again (``loader``) and serve new requests with it; True
        when it did. A failure leaves the running config as it was and is logged once, naming
        the key. Reloads run one at a time; none during a drain."""
        async with self._reloading:
            if self.in_flight.draining:
                log_event("config reload ignored: the proxy is draining")
                return False
            if self.loader is None:
                log_event("config reload ignored: no --config file to read again")
                return False
            try:
                loaded = self.loader()
            except ConfigError as exc:
                self.metrics.config_reloads.labels("failed").inc()
                log_event(
                    "config reload failed; the running config is kept",
                    "warning",
                    error=str(exc),
                )
                return False
            running = self.config
            kept = [key for key in RESTART_KEYS if getattr(loaded, key) != getattr(running, key)]
            config = loaded.model_copy(update={key: getattr(running, key) for key in kept})
            await self.generations.replace(config)
            self.config = config
            if self._cap is not None:
                self._cap.limit = config.max_connections
                self._cap.header_seconds = config.client_timeouts.headers
            self.metrics.config_reloads.labels("ok").inc()
            fields: dict[str, object] = {
                "upstreams": len(config.upstreams), "routes": len(config.routes)
            }  # fmt: skip
            if kept:
                fields["restart_needed_for"] = ",".join(kept)
            log_event("config reloaded", **fields)
            return True

    async def drain(self) -> None:
        in_flight = self.in_flight
        in_flight.draining = True
        loop = asyncio.get_running_loop()
        self._drain_ends = loop.time() + self.config.drain_seconds
        grace = min(self.config.drain_grace_seconds, self.config.drain_seconds)
        log_event("draining", in_flight=in_flight.requests, drain_seconds=self.config.drain_seconds)
        await asyncio.sleep(grace)
        if self._proxy_site is not None:
            await self._proxy_site.stop()
        try:
            async with asyncio.timeout_at(self._drain_ends):
                await in_flight.wait_idle()
        except TimeoutError:
            log_event("drain time is up; cutting streams", in_flight=in_flight.requests)
            in_flight.fanouts.cut_streams("the proxy is shutting down")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CUT_GRACE):
                    await in_flight.wait_idle()

    async def close(self) -> None:
        """Every listener closed, then the spans sent: within what is left of the drain (at
        least a second, at most ``_FLUSH_SECONDS``), so that the process exits within about
        ``drain_seconds`` of SIGTERM whatever the trace collector does."""
        await self._proxy.cleanup()
        await self._admin.cleanup()
        if self.tracing is not None:
            left = _FLUSH_SECONDS
            if self._drain_ends is not None:
                left = self._drain_ends - asyncio.get_running_loop().time()
            await self.tracing.close(min(max(left, _CUT_GRACE), _FLUSH_SECONDS))


async def run(
    server: Server,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
    ready: Callable[[], None] | None = None,
    supervisor: int | None = None,
) -> None:
    """Serve until one of ``signals``, reloading the config on each SIGHUP; then drain and stop.

    ``ready`` runs once the signals are ours: a banner printed before that would let a SIGTERM
    that follows it at once kill the process undrained (the default action). ``supervisor``: a
    worker's end of the pipe its supervisor holds open while it lives; readable once the
    supervisor is gone, which stops the worker as a SIGTERM would.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    reloads: set[asyncio.Task[bool]] = set()

    def orphaned(fd: int) -> None:
        loop.remove_reader(fd)  # readable from now on: once is enough
        if not stop.is_set():
            log_event("the supervisor is gone; stopping", "warning")
            stop.set()

    def reload() -> None:
        # One running and one to follow: later SIGHUPs would read the same file. None once
        # stopping (the handler stays: the default action of SIGHUP would end the process).
        if not stop.is_set() and len(reloads) < 2:
            task = loop.create_task(server.reload())
            reloads.add(task)
            task.add_done_callback(reloads.discard)

    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload)
    if supervisor is not None:
        loop.add_reader(supervisor, orphaned, supervisor)
    settle_collector()
    if ready is not None:
        ready()
    try:
        await stop.wait()
        await server.drain()
    finally:
        if supervisor is not None:
            loop.remove_reader(supervisor)
        for task in reloads:
            task.cancel()
        await asyncio.gather(*reloads, return_exceptions=True)
        await server.close()


def install_uvloop() -> None:
    """uvloop when installed (the ``fast`` extra): a quicker event loop, same behaviour."""
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _port(runner: web.AppRunner) -> int:
    address = runner.addresses[0]
    return int(address[1])


def _raise_fd_limit(config: Config) -> None:
    """Room for every allowed connection: past the fd limit, accept() fails and floods the log."""
    needed = config.max_connections + sum(u.max_concurrency for u in config.upstreams) + _SPARE_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < needed:
        log_event(
            "the open-file limit is below max_connections plus upstream connections; "
            "lower max_connections or raise the limit",
            fd_limit=soft,
            needed=needed,
        )
