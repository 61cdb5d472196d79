"""The rig for "a proxy in front of something": every server a test runs, on loopback.

``Servers`` starts each on the running event loop and stops them all, newest first, when the
test is done (or one early, ``stop``): the demo backend (``backend``), n-proxy's app under an
aiohttp ``AppRunner`` (``proxy``), the whole ``proxy.server.process.Server`` with its connection
guard and admin port (``server``), a recording fake upstream (``upstream``, or ``start`` for a
subclass of it) and a raw-bytes one (``start(RawUpstream(...))``). Every proxy runs under an
``AppRunner``, which is what the lifecycle check (``lifecycle.py``) hooks: it sees each one.

``LoopThread`` runs an event loop in a background thread, for synchronous tests (hypothesis's)
that drive servers started there over real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, TypeVar

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.config.models import Config, Upstream, parse_config, single_upstream_config
from proxy.devserver import DevConfig, DevState, start_devserver
from proxy.observe import Metrics
from proxy.observe.tracing import Tracing
from proxy.server.app import GENERATIONS, build_app
from proxy.server.process import Server
from proxy.upstream.discovery import Resolver
from proxy.upstream.service import Upstreams
from tests.support.upstreams import AnswerFn, RecordingUpstream


class Startable(Protocol):
    async def start(self) -> object: ...
    async def stop(self) -> None: ...


T = TypeVar("T")
S = TypeVar("S", bound=Startable)
WITHIN = 30.0  # seconds any one wait on a proxy's state may take: a bound, not a timing


@dataclass
class Backend:
    url: str
    state: DevState
    runner: web.AppRunner | None = None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@dataclass
class Proxy:
    url: str
    config: Config
    app: web.Application
    runner: web.AppRunner

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def pool(self) -> Upstreams:
        return self.app[GENERATIONS].upstreams

    @property
    def upstream(self) -> Upstream:
        """The first upstream (the only one, mostly)."""
        return self.app[GENERATIONS].upstreams.config.upstreams[0]

    def usable(self) -> dict[str, bool]:
        """Each replica of the first upstream: whether children may go there now."""
        return self.pool.replica_health(self.upstream)

    async def until(self, predicate: Callable[[], bool], within: float = WITHIN) -> None:
        """Until ``predicate()`` holds, woken by each change of the first upstream's state."""
        await self.pool.state(self.upstream).wait_for(predicate, within)

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.app[GENERATIONS].upstreams.metrics, name, **labels)


def metric(metrics: Metrics, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``, from /metrics' text."""
    total = 0.0
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def proxy_config(backend: Backend, **overrides: Any) -> Config:
    return single_upstream_config(backend.url).model_copy(update=overrides)


def with_upstream(config: Config, **changes: Any) -> Config:
    """The one-upstream ``config`` with that upstream's fields changed."""
    (upstream,) = config.upstreams
    return config.model_copy(update={"upstreams": (upstream.model_copy(update=changes),)})


async def start_proxy(
    config: Config, resolver: Resolver | None = None, tracing: Tracing | None = None
) -> tuple[web.AppRunner, str]:
    """The proxy's app on a free loopback port; the caller owns ``runner.cleanup()``."""
    app = build_app(config, resolver=resolver, tracing=tracing)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


class Servers:
    def __init__(self) -> None:
        self._running: list[tuple[object, Callable[[], Awaitable[None]]]] = []

    async def __aenter__(self) -> Servers:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    def _keep(self, server: T, stop: Callable[[], Awaitable[None]]) -> T:
        self._running.append((server, stop))
        return server

    async def backend(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> Backend:
        """The demo backend; ``options`` are its ``DevConfig``."""
        runner, bound, state = await start_devserver(DevConfig(**options), host, port)
        return self._keep(Backend(f"http://{host}:{bound}", state, runner), runner.cleanup)

    async def proxy(
        self, config: Config, resolver: Resolver | None = None, tracing: Tracing | None = None
    ) -> Proxy:
        """``tracing``: the test's own (its span exporter, say); None: tracing off."""
        runner, url = await start_proxy(config, resolver, tracing)
        return self._keep(Proxy(url, config, runner.app, runner), runner.cleanup)

    async def server(self, config: Config) -> Server:
        """The whole server of one process: its connection guard, admin port and tracing."""
        server = Server(config)
        await server.start()
        return self._keep(server, server.close)

    async def upstream(self, answer: AnswerFn) -> RecordingUpstream:
        """A ``RecordingUpstream`` that answers every request it files with ``answer``."""
        return await self.start(RecordingUpstream(answer))

    async def start(self, server: S) -> S:
        """Any fake with ``start`` and ``stop``: a ``RecordingUpstream`` subclass, a raw one."""
        await server.start()
        return self._keep(server, server.stop)

    async def stop(self, server: object) -> None:
        """Stop one server now (a replica that dies, a proxy whose end a test awaits)."""
        for at, (running, stop) in enumerate(self._running):
            if running is server:
                del self._running[at]
                await stop()
                return
        raise ValueError(f"{server!r} is not running here")

    async def close(self) -> None:
        """Everything still running, newest first; the first failure raised once all stopped."""
        failure: Exception | None = None
        while self._running:
            _, stop = self._running.pop()
            try:
                await stop()
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure


class LoopThread:
    """An event loop running in a daemon thread; ``run`` waits there for a coroutine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = WITHIN) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@contextlib.asynccontextmanager
async def running_server(
    upstream_url: str, drain_seconds: float = 30, upstream: str = ""
) -> AsyncIterator[Server]:
    """A whole server (proxy and admin listeners, drain) on free loopback ports, in front of
    ``upstream_url``; ``upstream`` adds keys to its one upstream (YAML flow mapping items)."""
    extra = f", {upstream}" if upstream else ""
    config = parse_config(
        f"""
listen: {{host: 127.0.0.1, port: 0}}
admin: {{host: 127.0.0.1, port: 0}}
drain_seconds: {drain_seconds}
drain_grace_seconds: 0.05
upstreams: [{{name: u, url: "{upstream_url}"{extra}}}]
""",
        env={},
    )
    async with serving(config) as server:
        yield server


@contextlib.asynccontextmanager
async def serving(config: Config) -> AsyncIterator[Server]:
    """The whole server of one process for ``config``, closed at the block's end."""
    server = Server(config)
    await server.start()
    try:
        yield server
    finally:
        await server.close()
