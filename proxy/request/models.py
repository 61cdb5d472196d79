"""``GET /v1/models`` when routes send models to several upstreams: each of them asked at once,
within ``model_list_timeout``, their lists merged by model id (the first upstream to name an id
keeps it: the default upstream, then the routes' in config order); an upstream that fails is left
out, logged and counted (docs/behaviour.md#model-list). LiteLLM's proxy answers the same way.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from proxy.config import Upstream
from proxy.core import ProxyError, UpstreamUnavailable, request_headers
from proxy.observe import Observers, RequestRecord, log_event
from proxy.request.responses import error_response
from proxy.upstream import UpstreamRequest, Upstreams

MODELS_PATH = "/v1/models"
_QUIET = Observers(())  # each upstream's ask is part of the one request the client made


def merges_models(upstreams: Upstreams) -> bool:
    """Whether ``GET /v1/models`` is answered by merging: the routes name several upstreams, and
    no route sends that path to one of them by its prefix."""
    config = upstreams.config
    by_path = any(
        r.model is None and r.path_prefix is not None and MODELS_PATH.startswith(r.path_prefix)
        for r in config.routes
    )
    return len(upstreams.model_lists) > 1 and not by_path


async def list_models(
    request: web.Request, upstreams: Upstreams, record: RequestRecord, client: str
) -> web.Response:
    """Every upstream's list, merged; 502 only when none answered."""
    asked = upstreams.model_lists
    lists = await asyncio.gather(*(_ask(request, upstreams, u, client) for u in asked))
    if all(found is None for found in lists):
        names = ", ".join(u.name for u in asked)
        return error_response(UpstreamUnavailable(f"no upstream answered {MODELS_PATH} ({names})"))
    merged: dict[str, dict[str, Any]] = {}
    for found in lists:
        for card in found or ():
            merged.setdefault(card["id"], card)
    body = orjson.dumps({"object": "list", "data": list(merged.values())})
    record.bytes_out = len(body)
    return web.Response(body=body, content_type="application/json")


async def _ask(
    request: web.Request, upstreams: Upstreams, upstream: Upstream, client: str
) -> list[dict[str, Any]] | None:
    """``upstream``'s model cards (each a mapping with a string id), or None when it failed."""
    headers = request_headers(request.headers, upstream.headers)
    sent = UpstreamRequest("GET", request.rel_url.raw_path_qs, headers, None)
    quiet = RequestRecord(_QUIET, "GET", MODELS_PATH, request.headers)
    reason = ""
    try:
        async with asyncio.timeout(upstreams.config.model_list_timeout):
            (ticket,) = upstreams.admit(upstream, 1, client)
            async with upstreams.exchange(ticket, sent, quiet.child(None)) as exchange:
                status = exchange.response.status
                data = await exchange.read()
        if status == 200:
            cards = _cards(data)
            if cards is not None:
                # The names it serves are what the metrics may label its answers with.
                upstreams.metrics.models.learn(upstream.name, (card["id"] for card in cards))
                return cards
            reason = "not a model list"
        else:
            reason = f"status {status}"
    except TimeoutError:
        reason = "timeout"
    except ProxyError as exc:
        reason = exc.message
    upstreams.metrics.model_list_failures.labels(upstream.name).inc()
    log_event("model list left out", upstream=upstream.name, reason=reason)
    return None


def learn_listed(upstreams: Upstreams, upstream: Upstream, data: bytes) -> None:
    """A model list ``upstream`` answered through a pass-through: the names it serves are what
    the metrics may label its answers with."""
    cards = _cards(data)
    if cards is not None:
        upstreams.metrics.models.learn(upstream.name, (card["id"] for card in cards))


def _cards(data: bytes) -> list[dict[str, Any]] | None:
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    cards = parsed.get("data") if isinstance(parsed, dict) else None
    if not isinstance(cards, list):
        return None
    return [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]
