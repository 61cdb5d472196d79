"""The HTTP edge shared by the demo backend's handlers: JSON and OpenAI error responses, and
reading a request's JSON body and headers.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

ERROR_TYPES = {400: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}


def json_response(
    payload: object, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(payload), status=status, content_type="application/json", headers=headers
    )


def error_response(
    status: int, message: str, rid: str | None = None, param: str | None = None
) -> web.Response:
    error_type = ERROR_TYPES.get(status, "server_error")
    code = None if status == 400 else status
    payload = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return json_response(payload, status, {"X-Request-Id": rid} if rid else None)


def header_dict(request: web.BaseRequest) -> dict[str, str]:
    """All request headers, names lower-cased, repeated ones joined as HTTP allows."""
    headers: dict[str, str] = {}
    for name, value in request.headers.items():
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return headers


def decode_json(raw: bytes) -> object:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
