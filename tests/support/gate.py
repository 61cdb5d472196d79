"""A loopback front for the demo backend that decides when each child's status line leaves.

Child ``i`` is known by its ``X-Request-Id: i_parent``. The front can hold a child until the test
opens its gate, make children start in a given order (each after the previous one's first body
bytes went out), and counts how many children are in flight at once.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web


class Gate:
    def __init__(self, backend_url: str) -> None:
        self.backend_url = backend_url
        self.held: set[int] = set()  # children whose status line waits for ``opened[i]``
        self.opened: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.answered: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.first_body: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.order: list[int] | None = None  # start order: order[k] waits for order[k-1]'s body
        self.active = 0
        self.peak = 0  # the most children in flight at once
        self.closed: set[int] = set()  # children whose connection the proxy closed
        self.url = ""
        self._session: aiohttp.ClientSession | None = None
        self._changed = asyncio.Event()

    async def wait_for(self, predicate: Callable[[Gate], bool], timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate(self):
                self._changed.clear()
                await self._changed.wait()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "")
        i = int(rid.split("_", 1)[0]) if "_" in rid else 0
        body = await request.read()
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if self.order is not None and self.order.index(i):
                await self.first_body[self.order[self.order.index(i) - 1]].wait()
            if i in self.held:
                await self.opened[i].wait()
            assert self._session is not None
            async with self._session.post(
                self.backend_url + request.rel_url.raw_path_qs,
                data=body,
                headers={"Content-Type": "application/json", "X-Request-Id": rid},
            ) as upstream:
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={"Content-Type": upstream.headers.get("Content-Type", "")},
                )
                await response.prepare(request)
                self.answered[i].set()
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                    self.first_body[i].set()
                await response.write_eof()
                return response
        except asyncio.CancelledError:
            self.closed.add(i)
            raise
        finally:
            self.active -= 1
            self._changed.set()


@asynccontextmanager
async def gate_in_front(backend_url: str) -> AsyncIterator[Gate]:
    gate = Gate(backend_url)
    app = web.Application()
    app.router.add_post("/{tail:.*}", gate.handle)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    gate.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    async with aiohttp.ClientSession() as session:
        gate._session = session
        try:
            yield gate
        finally:
            for event in gate.opened.values():
                event.set()
            await runner.cleanup()
