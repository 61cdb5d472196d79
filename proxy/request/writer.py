"""A fan-out stream's one writer (``merge``): takes what the children put in the mailbox, stitches
it and writes it into the client's sink, then the merged tail or one error event
(docs/behaviour.md#streaming, #errors). Compiled with the rest of the stream path (setup.py).
"""

from __future__ import annotations

from time import perf_counter

from proxy.core import ChildFailed, ProxyError, StreamError, StreamStitcher, error_event
from proxy.observe import RequestRecord
from proxy.request.mailbox import MAX_COMMENT_BYTES, PING, Mailbox, PingTimer
from proxy.request.sink import Sink


async def merge(
    stitcher: StreamStitcher, mailbox: Mailbox, sink: Sink, seconds: float, record: RequestRecord
) -> None:
    """Write chunks as they arrive, then the merged tail or one error event.

    Everything one wake-up finds leaves in one write, straight into the client's transport;
    past its high-water mark the writer waits for the drain, and the children's reads stall
    behind the full mailbox. With nothing written for ``seconds`` (0: never), an SSE
    comment keeps load balancers from cutting a stream whose next child is still queued
    (docs/behaviour.md#keep-alive).
    """
    plan = stitcher.plan
    running = len(plan.children)
    write, drain = sink.write, sink.drain
    keepalive = PingTimer(mailbox, seconds, running)
    stamped = False  # the first stitched chunk's time is on the record

    async def send(data: bytes) -> None:
        now_full = write(data)  # counted for the record by the sink
        keepalive.wrote()
        if now_full:
            await drain()

    try:
        while running:
            out: list[bytes] = []
            pulse: bytes | None = None  # a child's comment, to pass on when nothing else goes
            ended = False
            try:
                items = await mailbox.take()
                if items is None:
                    await send(PING)
                    continue
                if not items:
                    raise StreamError(None, mailbox.cut_reason or "cut")
                for pos, item in items:
                    if isinstance(item, list):
                        for data, event in item:
                            chunk = stitcher.chunk(pos, data, event)
                            if chunk is not None:
                                out.append(chunk)
                    elif item is None:
                        running -= 1
                        if not stitcher.finished(pos):
                            index = plan.children[pos].index
                            raise StreamError(index, "stream ended before finishing")
                    elif isinstance(item, bytes):
                        if keepalive.heard(pos) and pulse is None:
                            pulse = item + b"\n\n" if len(item) <= MAX_COMMENT_BYTES else PING
                    else:
                        raise StreamError(plan.children[pos].index, _reason(item))
            except StreamError as error:
                out.append(error_event(error))
                ended = True
            if ended:  # sent after the handler: a compiled one must not span a suspension
                await send(b"".join(out))  # (docs/architecture.md#working-on-a-compiled-module)
                return
            if out:
                if not stamped:  # a local, not the record's field: a cache line fewer a chunk
                    stamped = True
                    if record.first_chunk_at is None:
                        record.first_chunk_at = perf_counter()
                await send(out[0] if len(out) == 1 else b"".join(out))
            # A pulse is stamped by ``heard``: a ``send`` would stamp it later.
            elif pulse is not None and write(pulse):
                await drain()
        await send(stitcher.tail())
    finally:
        keepalive.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ChildFailed):
        return f"upstream answered {exc.status}"
    if isinstance(exc, TimeoutError):
        return "upstream went idle (timeout)"
    if isinstance(exc, ProxyError):
        return exc.message
    if isinstance(exc, ValueError):
        return f"upstream stream is malformed: {exc}"
    return f"upstream connection broke ({type(exc).__name__})"
