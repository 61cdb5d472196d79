"""One upstream request of a client request (docs/architecture.md#one-request-two-ways): what
it carries, the ticket admission gave it, and the ``Exchange`` from the wait for its place to the
end of its body, which gives back in one place everything it took; and how an upstream client
failure becomes the proxy's own error. ``Upstreams`` (``proxy.upstream.service``) makes both.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Final, Literal, Protocol, final

from multidict import CIMultiDict
from mypy_extensions import mypyc_attr

from proxy.config import Config, Upstream
from proxy.core import ClientLimited, Overloaded, UpstreamTimeout, UpstreamUnavailable
from proxy.http import (
    BodyTooLong,
    ClientClosed,
    ConnectFailed,
    ConnectionPool,
    Disconnected,
    HTTPClientError,
    UpstreamResponse,
)
from proxy.observe import ChildRecord, Metrics
from proxy.upstream.replicas import Replica
from proxy.upstream.slots import Place, Tab, Tabs
from proxy.upstream.state import UpstreamState

# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_monotonic: Final = time.monotonic
_perf_counter: Final = time.perf_counter
_fnmatchcase: Final = fnmatch.fnmatchcase


@final
class UpstreamRequest:
    """What one upstream request carries: the same on every try, so the same seed and id. A
    compiled class, not a ``NamedTuple``: one is made for each request, and a ``NamedTuple``'s
    ``__new__`` is Python code, ten times the cost."""

    __slots__ = ("body", "headers", "inflate", "method", "path_qs", "read_bufsize")

    def __init__(
        self,
        method: str,
        path_qs: str,
        headers: CIMultiDict[str],
        body: bytes | None,
        inflate: bool = False,  # undo a gzip or deflate Content-Encoding (children parse it)
        read_bufsize: int | None = None,  # bytes read ahead of the consumer
    ) -> None:
        self.method = method
        self.path_qs = path_qs
        self.headers = headers
        self.body = body
        self.inflate = inflate
        self.read_bufsize = read_bufsize

    def with_headers(self, headers: CIMultiDict[str]) -> UpstreamRequest:
        """The same request with other headers (a fallback upstream's)."""
        return UpstreamRequest(
            self.method, self.path_qs, headers, self.body, self.inflate, self.read_bufsize
        )


@final
class Ticket:
    """One admitted upstream request (a pass-through's, a fan-out child's): its upstream, the
    replica it goes to, its place in the upstream's line, when it joined the line and whose it
    is (the client's id: a fallback's place joins that client's line there). Compiled, as
    ``UpstreamRequest``."""

    __slots__ = ("client", "joined", "place", "state", "url")

    def __init__(
        self, state: UpstreamState, url: str, place: Place, joined: float, client: str = ""
    ) -> None:
        self.state = state
        self.url = url
        self.place = place
        self.joined = joined  # perf_counter seconds, the record's clock
        self.client = client


class Tickets:
    """What admission gave one client request: a ticket per upstream request, in child order.
    Holds its tuple rather than being one: mypyc compiles no subclass of ``tuple``."""

    __slots__ = ("_tickets",)

    def __init__(self, tickets: tuple[Ticket, ...]) -> None:
        self._tickets = tickets

    def __getitem__(self, index: int) -> Ticket:
        return self._tickets[index]

    def __len__(self) -> int:
        return len(self._tickets)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(self._tickets)

    def release(self) -> None:
        """Every place back, granted or still queued: a child cancelled before it ran holds one
        too. A place already given back (its exchange ended) is left as it is."""
        for ticket in self._tickets:
            ticket.place.release()


def admission(
    state: UpstreamState, count: int, client: str, tab: Tab | None, cap: int, metrics: Metrics
) -> Tickets:
    """``Upstreams.admit``'s work, compiled: ``count`` places in ``client``'s line (refused with
    a 429 when ``tab`` is at ``cap`` or the line is full), then a replica each."""
    if tab is not None and tab.places + count > cap:
        metrics.client_limited.labels(state.upstream.name).inc()
        raise ClientLimited(
            f"this client has {tab.places} upstream requests queued or running and this"
            f" request needs {count} more; at most {cap} are allowed at once: retry shortly",
            retry_after=1,
        )
    try:
        places = state.slots.join(count, client if state.fair else None, tab)
    except Overloaded:
        metrics.rejected.labels(state.upstream.name).inc()
        raise
    urls = state.replicas.place(count, _monotonic())
    joined = _perf_counter()
    # By index, not zip: compiled, a builtin is looked up on its module at every call. As
    # zip(strict=True) did, a replica for each place, or a ValueError.
    if len(urls) != len(places):
        raise ValueError(f"{len(urls)} replicas placed for {len(places)} places")
    return Tickets(
        tuple([Ticket(state, urls[i], places[i], joined, client) for i in range(len(places))])
    )


# The response to relay, the replica it came from (its ``outstanding`` counts it until the
# exchange ends), and the fallback upstream's place in line when the fallback sent it.
Answered = tuple[UpstreamResponse, Replica, Place | None]


class Answerer(Protocol):
    """The tries of an upstream request (``proxy.upstream.tries``, which imports this module)."""

    async def answer(
        self,
        state: UpstreamState,
        url: str,
        request: UpstreamRequest,
        child: ChildRecord,
        fallback: bool = True,
        client: str = "",
    ) -> Answered: ...


class Exchange:
    """One upstream request of a client request, from its place in line to the end of its body:
    ``async with upstreams.exchange(ticket, request, child) as exchange``.

    Entering waits for the place, then sends the request, with retries and fallback, until a
    response head is in; the response is then ``exchange.response``, its body read whole with
    ``read`` or relayed with ``response.relay``. Leaving gives back, in one place and whatever
    happened, the connection (pooled when its body was read to the end, closed otherwise), the
    replica's ``outstanding`` count, the fallback's place and its own, and the upstream's count
    of requests in flight. The steps go to ``child``, the request's record of it.

    A class, not an ``asynccontextmanager``: it is on every request's path, and a generator
    behind two awaits per request costs more than these few lines.
    """

    __slots__ = ("_fallback", "_replica", "_request", "_ticket", "_upstreams", "child",
                 "response")  # fmt: skip
    response: UpstreamResponse  # its head in once entered

    def __init__(
        self, upstreams: Front, ticket: Ticket, request: UpstreamRequest, child: ChildRecord
    ) -> None:
        self._upstreams = upstreams
        self._ticket = ticket
        self._request = request
        self.child = child
        self._replica: Replica | None = None  # the replica that answered, once one did
        self._fallback: Place | None = None

    async def __aenter__(self) -> Exchange:
        ticket = self._ticket
        place = ticket.place
        if place.state != "held":  # most places are granted at once: no coroutine to wait on
            await place.wait()  # cancelled, the place is given back there
        child = self.child
        child.admitted(ticket.joined)
        ticket.state.exchanges += 1
        tries = self._upstreams.tries
        assert tries is not None
        try:
            self.response, self._replica, self._fallback = await tries.answer(
                ticket.state, ticket.url, self._request, child, client=ticket.client
            )
        except BaseException as exc:
            self._release(exc)
            raise
        child.head(self.response.status)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Never awaits: a compiled caller's ``async with`` awaits this inside its exception
        # handler (docs/architecture.md#working-on-a-compiled-module).
        self._release(exc)

    def _release(self, failure: BaseException | None) -> None:
        ticket = self._ticket
        replica = self._replica
        try:
            if replica is not None:
                # Read to its end: back to the pool. Left unread: closed, so the upstream stops.
                self._upstreams.connections.release(self.response)
        finally:
            if replica is not None:
                replica.outstanding -= 1
            if self._fallback is not None:
                self._fallback.release()
            ticket.place.release()
            ticket.state.exchanges -= 1
            self.child.ended(failure)

    async def read(self) -> bytes:
        """The whole body; a read that fails is the proxy's 502 or 504 (docs/behaviour.md#errors).

        Past ``max_response_bytes`` the read stops at once and the request fails with 502;
        leaving the body unread makes the exchange drop the connection, so the upstream stops
        too."""
        response = self.response
        upstream = self._ticket.state.upstream
        limit = self._ticket.state.max_response_bytes
        length = response.content_length
        try:
            if length is not None and length > limit:
                raise BodyTooLong(length)
            data: bytes = await response.read(limit)
        except BodyTooLong:
            raise UpstreamUnavailable(
                f"upstream {upstream.name} sent a body larger than {limit} bytes"
            ) from None
        except (TimeoutError, HTTPClientError) as exc:
            raise upstream_error(exc, upstream) from None
        return data


def upstream_error(exc: BaseException, upstream: Upstream) -> UpstreamTimeout | UpstreamUnavailable:
    """Map an upstream client failure to the proxy's own error (docs/behaviour.md#errors: 502
    or 504)."""
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"upstream {upstream.name} timed out")
    return UpstreamUnavailable(f"upstream {upstream.name} failed: {type(exc).__name__}")


def failure_kind(exc: BaseException) -> Literal["connect", "reset"] | None:
    """``connect``: the request never reached a server (its connect timing out included).
    ``reset``: the connection closed before a status line came back, or the client was closed
    under it. Anything else (a timeout waiting for the answer, a malformed answer) is neither."""
    match exc:
        case ConnectFailed():
            return "connect"
        case Disconnected() | ClientClosed():
            return "reset"
    return None


@mypyc_attr(allow_interpreted_subclasses=True)  # proxy.upstream.service.Upstreams
class Front:
    """What every request asks of the upstreams: where it goes (``route``), its places in line
    (``admit``) and its exchanges (``exchange``). Compiled, with what they read as fields of this
    class; ``proxy.upstream.service.Upstreams`` subclasses it with the rest (health checks,
    discovery, a reload's hand-over), as a Python class the tests can patch."""

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        states: dict[str, UpstreamState],
        connections: ConnectionPool,
        tabs: Tabs,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._states = states
        self.connections = connections
        self.tries: Answerer | None = None  # the service's (proxy.upstream.tries), once made
        # Each route as (path prefix or None, model glob or None, its upstream), in config order.
        self._routes = [
            (r.path_prefix, r.model, config.upstream(r.upstream)) for r in config.routes
        ]
        self._default = config.upstream(config.default_upstream)
        # Each client's places over every upstream (clients.max_children), one for every config.
        self.tabs = tabs
        self._max_children = config.clients.max_children

    def route(self, path: str, model: str | None) -> Upstream:
        """Where a request goes: the first route whose path prefix and model glob (case-sensitive)
        it matches, else the default upstream. Configuration alone decides, never the request's
        ``Host`` or an absolute URI: no open proxy."""
        for prefix, glob, upstream in self._routes:
            if prefix is not None and not path.startswith(prefix):
                continue
            if glob is not None and (model is None or not _fnmatchcase(model, glob)):
                continue
            return upstream
        return self._default

    def admit(self, upstream: Upstream, count: int, client: str = "") -> Tickets:
        """``count`` requests of ``client`` (its id) into the upstream, in one step: a place each
        in the client's line (429 on arrival when the client is at ``clients.max_children`` or
        the upstream's line is full), then a replica each by its ``placement``, over the healthy
        replicas that are not ejected (docs/behaviour.md#admission, #failover)."""
        cap = self._max_children
        tab = self.tabs.tab(client) if cap else None  # counted only for a cap
        return admission(self._states[upstream.name], count, client, tab, cap, self.metrics)

    def exchange(self, ticket: Ticket, request: UpstreamRequest, child: ChildRecord) -> Exchange:
        """One upstream request, once its place is granted: ``async with`` it (``Exchange``).

        Failures listed in ``retry_on`` are retried before the answer is given out: nothing of a
        retried answer can have reached the client (docs/behaviour.md#failover). The response is
        closed (never reused) if its body is left unread.
        """
        return Exchange(self, ticket, request, child)
