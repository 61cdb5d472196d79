"""The generation handler: answers chat, completions and generate (token-in/token-out)
requests, whole or as an SSE stream, and delivers the faults that change how an answer is sent.
"""

from __future__ import annotations

import asyncio
import gzip
import secrets
import zlib
from collections.abc import Sequence

import orjson
from aiohttp import web

from proxy.devserver.config import DEV_CONFIG
from proxy.devserver.faults import (
    ERROR_EVENT,
    FAULT_CAP_SECONDS,
    MID_STREAM_FAULTS,
    STATUS_FAULTS,
    reset_connection,
    shape_generation,
)
from proxy.devserver.model import Generation, generate
from proxy.devserver.reply import Answer, TokensAnswer
from proxy.devserver.request import Job, Kind, RequestError, parse_generate_job, parse_job
from proxy.devserver.responses import decode_json, error_response, header_dict
from proxy.devserver.state import DEV_STATE, DevState

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def _sleep_tokens(delay: float, count: int) -> None:
    if delay > 0:
        for _ in range(count):
            await asyncio.sleep(delay)


def _reply(job: Job) -> Answer | TokensAnswer:
    return TokensAnswer(job) if job.kind == "generate" else Answer(job)


async def handle_generation(request: web.Request, kind: Kind) -> web.StreamResponse:
    state = request.app[DEV_STATE]
    body = decode_json(await request.read())
    fields = body if isinstance(body, dict) else {}
    body_rid = fields.get("request_id")
    rid = request.headers.get("X-Request-Id") or (
        body_rid if isinstance(body_rid, str) and body_rid else secrets.token_hex(16)
    )
    state.record(rid, fields, header_dict(request))
    try:
        config = request.app[DEV_CONFIG]
        if kind == "generate":
            job = parse_generate_job(body, rid, config)
        else:
            job = parse_job(body, kind == "chat", rid, config)
    except RequestError as exc:
        return error_response(400, exc.message, rid, exc.param)
    state.begin(rid, fields)
    try:
        response = await _answer(request, job, state)
    except asyncio.CancelledError:
        state.end(rid, "aborted")
        raise
    state.end(rid, "finished")
    return response


async def _answer(request: web.Request, job: Job, state: DevState) -> web.StreamResponse:
    if job.knobs.headers_delay:
        await asyncio.sleep(job.knobs.headers_delay)  # as a server whose slots are all busy
    fault = job.knobs.fault or ""
    if fault in STATUS_FAULTS:
        state.end(job.rid, "faulted")
        return error_response(STATUS_FAULTS[fault], f"Injected fault {fault}", job.rid)
    if fault == "no_headers":
        await asyncio.sleep(FAULT_CAP_SECONDS)
    if fault in ("reset_before_headers", "no_headers"):
        state.end(job.rid, "faulted")
        reset_connection(request)
        return web.Response()
    gens = [
        shape_generation(generate(job.prompt, seed, job.max_tokens, job.may_stop), job.knobs)
        for seed in job.seeds
    ]
    if job.stream:
        return await _stream(request, job, gens, state)
    return await _complete(request, job, gens, state)


async def _complete(
    request: web.Request, job: Job, gens: Sequence[Generation], state: DevState
) -> web.Response:
    fault = job.knobs.fault
    steps = max(len(gen.tokens) for gen in gens)
    if fault in ("reset_mid_stream", "idle_forever"):
        await _sleep_tokens(job.token_delay, min(job.knobs.after_tokens, steps))
        if fault == "idle_forever":
            await asyncio.sleep(FAULT_CAP_SECONDS)
        state.end(job.rid, "faulted")
        reset_connection(request)
        return web.Response()
    # Choices of a native n generate side by side, so one delay per step.
    await _sleep_tokens(job.token_delay, steps)
    headers = {"X-Request-Id": job.rid}
    if fault == "error_event":
        state.end(job.rid, "faulted")
        return error_response(500, "Injected error event", job.rid)
    if fault == "bad_json":
        return web.Response(body=b"not json", content_type="application/json", headers=headers)
    payload = orjson.dumps(_reply(job).body(gens))
    if fault == "gzip":
        payload = gzip.compress(payload)
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=payload, content_type="application/json", headers=headers)


async def _stream(
    request: web.Request, job: Job, gens: Sequence[Generation], state: DevState
) -> web.StreamResponse:
    reply = _reply(job)
    fault = job.knobs.fault or ""
    eol = {"crlf": b"\r\n", "cr": b"\r"}.get(fault, b"\n")
    ping = b": ping" + eol if fault == "ping" else b""
    steps = max(len(gen.tokens) for gen in gens)
    fault_step = min(job.knobs.after_tokens, steps) if fault in MID_STREAM_FAULTS else -1
    headers = {**SSE_HEADERS, "X-Request-Id": job.rid}
    # gzip on a stream: each event is flushed at once, so compression never delays a token.
    encoder = zlib.compressobj(wbits=31) if fault == "gzip" else None
    if encoder is not None:
        headers["Content-Encoding"] = "gzip"
    response = web.StreamResponse(headers=headers)

    async def send(data: bytes) -> None:
        frame = ping + b"data: " + data + eol + eol
        if encoder is not None:
            frame = encoder.compress(frame) + encoder.flush(zlib.Z_SYNC_FLUSH)
        await response.write(frame)

    async def inject() -> bool:
        """Fire the mid-stream fault; True when the stream goes on afterwards."""
        if fault == "bad_json":
            await send(b"not json")
            return True
        if fault == "idle_forever":
            await asyncio.sleep(FAULT_CAP_SECONDS)
        state.end(job.rid, "faulted")
        if fault == "reset_mid_stream":
            reset_connection(request)
        elif fault == "error_event":
            await send(ERROR_EVENT)
        return False

    try:
        await response.prepare(request)
        for chunk in reply.opening_chunks(gens):
            await send(orjson.dumps(chunk))
        for step in range(steps):
            if step == fault_step and not await inject():
                return response
            await _sleep_tokens(job.token_delay, 1)
            for chunk in reply.step_chunks(gens, step):
                await send(orjson.dumps(chunk))
        if fault_step == steps and not await inject():
            return response
        if job.include_usage:
            await send(orjson.dumps(reply.usage_chunk(gens)))
        # Ended before [DONE] goes out, so a client that has read [DONE] sees it finished.
        state.end(job.rid, "finished")
        await send(b"[DONE]")
        if encoder is not None:
            await response.write(encoder.flush())
    except ConnectionError:
        state.end(job.rid, "aborted")
    return response
