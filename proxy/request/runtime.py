"""Live state shared by the proxy and admin listeners: draining, in-flight requests, health."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiohttp import web

from proxy.config.models import Config
from proxy.observe.clienterrors import ClientErrors
from proxy.observe.metrics import Metrics
from proxy.upstream.service import UpstreamPool

if TYPE_CHECKING:
    from proxy.observe.tracing import Tracing

T = TypeVar("T")


class Cuttable(Protocol):
    def cut(self, reason: str) -> None: ...


@dataclass
class Runtime:
    config: Config
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
    in_flight: int = 0
    children: int = 0  # fan-out children running as tasks (``spawn_child``)
    healthy: dict[str, bool] = field(default_factory=dict)  # upstream name -> last health check
    replicas: dict[str, dict[str, bool]] = field(default_factory=dict)  # name -> url -> takes work
    streams: set[Cuttable] = field(default_factory=set)  # fan-out streams a drain can cut
    health_checked: asyncio.Event = field(default_factory=asyncio.Event)  # after the first round
    tracing: Tracing | None = None  # None unless OTEL_* asks for traces (proxy.observe.tracing)
    client_errors: ClientErrors = field(init=False)  # requests the HTTP parser refused
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()
        self.metrics.known(self.config)
        self.client_errors = ClientErrors(self.metrics)

    def health_reported(self, upstream: str, healthy: bool, replicas: dict[str, bool]) -> None:
        """An upstream's health round: ``/readyz`` reports it."""
        self.healthy[upstream] = healthy
        self.replicas[upstream] = replicas
        if len(self.healthy) == len(self.config.upstreams):
            self.health_checked.set()

    @property
    def ready(self) -> bool:
        return not self.draining and any(self.healthy.values())

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def spawn_child(self, child: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A fan-out child as a task, counted until it is done, however it ends: a task
        cancelled before it ever ran has no ``finally`` of its own to count it out."""
        task = asyncio.ensure_future(child)
        self.children += 1
        task.add_done_callback(self._child_done)
        return task

    def _child_done(self, task: asyncio.Task[Any]) -> None:
        self.children -= 1

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def cut_streams(self, reason: str) -> None:
        for stream in list(self.streams):
            stream.cut(reason)


class Trims(Protocol):
    """What the handler tells the memory trimmer (``proxy.server.memory``) as a request ends."""

    def request_ended(self, body_bytes: int, children: int) -> None: ...


# What the request layer reads from its app; ``proxy.server.app`` puts them there.
RUNTIME = web.AppKey("runtime", Runtime)
POOL = web.AppKey("pool", UpstreamPool)
TRIMMER = web.AppKey("trimmer", Trims)
