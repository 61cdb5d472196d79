"""The demo backend's side routes: models, health, metrics, embeddings, echo and debug state."""

from __future__ import annotations

import hashlib

import orjson
from aiohttp import web

from proxy.devserver.config import DEV_CONFIG
from proxy.devserver.request import token_ids
from proxy.devserver.responses import decode_json, error_response, header_dict, json_response
from proxy.devserver.state import DEV_STATE


async def models(request: web.Request) -> web.Response:
    model = request.app[DEV_CONFIG].model
    card = {"id": model, "object": "model", "created": 0, "owned_by": "n-proxy-devserver"}
    return json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def metrics(request: web.Request) -> web.Response:
    state = request.app[DEV_STATE]
    text = "".join(
        f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name} {value}\n"
        for name, kind, help_text, value in [
            ("devserver_requests_total", "counter", "Generation requests.", len(state.seen)),
            ("devserver_requests_running", "gauge", "Requests generating.", len(state.active)),
            (
                "devserver_requests_peak",
                "gauge",
                "The most requests generating at once.",
                state.peak,
            ),
        ]
    )
    content_type = "text/plain; version=0.0.4; charset=utf-8"
    return web.Response(body=text.encode(), headers={"Content-Type": content_type})


def _embed(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round((byte - 127.5) / 127.5, 6) for byte in digest[:8]]


async def embeddings(request: web.Request) -> web.Response:
    body = decode_json(await request.read())
    fields = body if isinstance(body, dict) else {}
    raw = fields.get("input")
    if raw is None or raw == []:
        return error_response(400, "input is required", None, "input")
    # A string or a flat list of token ids is one input; any other list holds several.
    items = raw if isinstance(raw, list) and token_ids(raw) is None else [raw]
    texts = [item if isinstance(item, str) else orjson.dumps(item).decode() for item in items]
    data = [
        {"object": "embedding", "index": i, "embedding": _embed(t)} for i, t in enumerate(texts)
    ]
    tokens = sum(len(text.split()) + 1 for text in texts)
    config = request.app[DEV_CONFIG]
    model = (not config.model_override and fields.get("model")) or config.model
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return json_response({"object": "list", "data": data, "model": model, "usage": usage})


async def echo(request: web.Request) -> web.Response:
    status = request.query.get("status", "200")
    if not status.isdigit() or not 200 <= int(status) <= 599:
        return error_response(400, "status must be an HTTP status code", None, "status")
    echo = {
        "method": request.method,
        "path": request.path,
        "query_string": request.query_string,
        "headers": header_dict(request),
        "body": (await request.read()).decode("utf-8", "replace"),
    }
    return json_response(echo, int(status))


async def debug_state(request: web.Request) -> web.Response:
    return json_response(request.app[DEV_STATE].snapshot())
