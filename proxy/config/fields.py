"""The config's field types: URLs, paths and header values (with ``${ENV}`` expanded at load),
durations, ranges and retry conditions, each with its JSON Schema."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainValidator, ValidationInfo, WithJsonSchema

from proxy.core import check_url, is_int

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand(value: str, info: ValidationInfo) -> str:
    """``${NAME}`` from the environment given at load; code-built configs are taken as they are."""
    env = info.context.get("env") if isinstance(info.context, dict) else None
    if env is None:
        return value

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise ValueError(f"environment variable {name} is not set")
        return str(env[name])

    return _ENV.sub(sub, value)


def _url(value: object, info: ValidationInfo) -> str:
    if not isinstance(value, str):
        raise ValueError("not a URL")
    return check_url(_expand(value, info))


def _header_value(value: object, info: ValidationInfo) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError("must be a string")
    expanded = _expand(str(value), info)
    if "\r" in expanded or "\n" in expanded:
        raise ValueError("contains a line break")
    return expanded


def _path(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError("must be a path starting with /")
    return value


def _retry_condition(value: object) -> str | int:
    if value in ("connect", "reset"):
        return str(value)
    if is_int(value) and 400 <= value <= 599:
        return value
    raise ValueError("must be connect, reset or an HTTP status from 400 to 599")


def ranged(lo: int, hi: int, description: str | None = None) -> Any:
    return Field(strict=True, ge=lo, le=hi, description=description)


Url = Annotated[str, BeforeValidator(_url), WithJsonSchema({"type": "string", "format": "uri"})]
HeaderValue = Annotated[
    str, BeforeValidator(_header_value), WithJsonSchema({"type": ["string", "number"]})
]
UrlPath = Annotated[
    str, BeforeValidator(_path), WithJsonSchema({"type": "string", "pattern": "^/"})
]
Seconds = Annotated[float, Field(strict=True, gt=0)]
RetryCondition = Annotated[
    str | int,
    PlainValidator(_retry_condition),
    WithJsonSchema(
        {
            "anyOf": [
                {"enum": ["connect", "reset"]},
                {"type": "integer", "minimum": 400, "maximum": 599},
            ]
        }
    ),
]
