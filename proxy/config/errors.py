"""Pydantic's validation errors in one line that names the YAML key (``upstreams[1].url: ...``).

Pure: the config models raise, this module only words the first error for people.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError


def keyed(key: str, message: str) -> PydanticCustomError:
    """An error found across sections, reported at the key it is about."""
    return PydanticCustomError("keyed", "{key}: {message}", {"key": key, "message": message})


def first_error(exc: ValidationError, raw: object, root: type[BaseModel]) -> str:
    """The first error as ``yaml.path: what is wrong``, in the proxy's words."""
    error = exc.errors(include_url=False)[0]
    ctx = error.get("ctx") or {}
    if error["type"] == "keyed":
        return f"{ctx['key']}: {ctx['message']}"
    if error["type"] in ("int_type", "greater_than_equal", "less_than_equal"):
        bounds = _field_bounds(root, error["loc"])
        if bounds is not None:
            return (
                f"{_where(error['loc'], raw)}: must be an integer from {bounds[0]} to {bounds[1]}"
            )
    return f"{_where(error['loc'], raw)}: {_say(error['type'], error['msg'], ctx)}"


def _where(loc: tuple[int | str, ...], raw: object) -> str:
    """``('upstreams', 1, 'urls', 0)`` -> ``upstreams[1].urls[0]``, or ``.url`` if so written."""
    out = ""
    node = raw
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "urls" and isinstance(node, dict) and "url" in node and "urls" not in node:
            return out + ".url"
        else:
            out += f".{part}" if out else str(part)
        node = _step(node, part)
    return out or "config"


def _step(node: object, part: int | str) -> object:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return None


_SAYS = {
    "missing": "required",
    "extra_forbidden": "unknown key",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
    "tuple_type": "must be a list",
    "list_type": "must be a list",
}


def _say(kind: str, message: str, ctx: Mapping[str, Any]) -> str:
    if kind in _SAYS:
        return _SAYS[kind]
    if kind == "value_error":
        return str(ctx.get("error", message))
    if kind == "too_short":
        return "must be a list (not empty)" if ctx.get("min_length") == 1 else message
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "greater_than_equal":
        return f"must be at least {ctx['ge']}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    if kind == "greater_than":
        return "must be positive" if ctx.get("gt") == 0 else f"must be greater than {ctx['gt']}"
    return message[:1].lower() + message[1:]


def _field_bounds(
    root: type[BaseModel], loc: tuple[int | str, ...]
) -> tuple[object, object] | None:
    """The ``ge``/``le`` of the integer field at ``loc``, to name the whole range in one error."""
    model: type[BaseModel] | None = root
    field = None
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = _model_in(field.annotation)
    if field is None:
        return None
    ge = next((m.ge for m in field.metadata if hasattr(m, "ge")), None)
    le = next((m.le for m in field.metadata if hasattr(m, "le")), None)
    return (ge, le) if ge is not None and le is not None else None


def _model_in(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if (found := _model_in(arg)) is not None:
            return found
    return None
