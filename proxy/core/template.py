"""Byte templates: a child's plain token chunks stitched by splicing one value into learned
bytes (``Template``). A speed-up only: a template gives exactly the bytes the full path
(``proxy.core.stitch``) would, or refuses the chunk, which then takes the full path. Pure.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

LESSONS = 8  # template lessons per child: learning parses twice, so it stops after a few
_NOT_SLOTS = frozenset(
    {("id",), ("request_id",), ("object",), ("created",), ("model",), ("usage",), ("error",)}
)
_SLOT = "\x00n-proxy template slot\x00"
_SLOT_JSON = orjson.dumps(_SLOT)
_MAX_DEPTH = 32
# Read from a C static when compiled (docs/architecture.md#working-on-a-compiled-module).
_json_loads: Final = orjson.loads
_json_dumps: Final = orjson.dumps

Slot = tuple[str | int, ...]
"""Where a value sits in a payload: keys and list positions from the top."""


class Template:
    """A child's plain chunk as ``child_head + <one JSON value> + child_tail``, and the same
    chunk stitched as ``head + <that value> + tail``.

    Learned from a chunk that took the full path, where that value was the only one to
    change since the child's previous plain chunk. Parsing a chunk of this form gives the
    learned payload with only that value replaced, and the full path's rewrite neither
    touches that value nor looks at it, so the full path would send ``head + v + tail`` with
    ``v`` the value as orjson writes it. The template sends exactly that: the value is parsed
    and written again, never copied, so JSON whitespace around it (the line breaks of a
    multi-line ``data:`` event), escapes and number spellings come out as the full path's.
    Anything else takes the full path: ``[DONE]``, the finishing chunk, usage, a role, a
    second changed value, any byte around the value that is not the learned one.

    A plain class, not a NamedTuple: compiled, ``fill`` is then a direct call, once a chunk.
    """

    __slots__ = ("child_head", "child_tail", "head", "tail")

    def __init__(self, child_head: bytes, child_tail: bytes, head: bytes, tail: bytes) -> None:
        self.child_head = child_head
        self.child_tail = child_tail
        self.head = head
        self.tail = tail

    def fill(self, data: bytes) -> bytes | None:
        value = _respelled(data, self.child_head, self.child_tail)
        return None if value is None else self.head + value + self.tail


class Lesson:
    """What one plain chunk taught: where its one changed value sits, and the child's own
    bytes around it."""

    __slots__ = ("child_head", "child_tail", "slot")

    def __init__(self, slot: Slot, child_head: bytes, child_tail: bytes) -> None:
        self.slot = slot
        self.child_head = child_head
        self.child_tail = child_tail

    def template(self, stitched: dict[str, Any]) -> Template | None:
        """The template, given the same chunk as the full path rewrote it."""
        parent = _split_at(stitched, self.slot)
        if parent is None:
            return None
        head, tail = parent
        return Template(self.child_head, self.child_tail, b"data: " + head, tail + b"\n\n")


class Learner:
    """One child's schooling: its previous plain chunk, and how many lessons are left."""

    __slots__ = ("_left", "_previous")

    def __init__(self) -> None:
        self._previous: bytes | None = None
        self._left = LESSONS

    def study(self, data: bytes, payload: dict[str, Any]) -> Lesson | None:
        """A lesson from a chunk about to take the full path (``payload`` is ``data`` parsed,
        not yet rewritten): the one value it changed since the child's previous plain chunk,
        when ``data`` is orjson's bytes around that value."""
        if not self._left or not _plain(payload):
            return None
        previous = self._previous
        self._previous = data
        if previous is None:
            return None
        self._left -= 1
        if not self._left:
            self._previous = None
        slot = _one_change(previous, payload)
        child = None if slot is None else _split_at(payload, slot)
        if slot is None or child is None:
            return None
        head, tail = child
        if not (data.startswith(head) and data.endswith(tail)):
            self._left = 0  # the child does not write JSON as orjson does: no template would match
            self._previous = None
            return None
        if _respelled(data, head, tail) is None:
            return None  # a value no template takes (not UTF-8): a later one may do
        return Lesson(slot, head, tail)


def _respelled(data: bytes, head: bytes, tail: bytes) -> bytes | None:
    """The value between ``head`` and ``tail`` in ``data``, written as orjson writes it, when it
    is one JSON string or number; None for anything else (more than one value, not UTF-8: the
    full path decides). Never the child's own bytes: whitespace around the value, ``\\u00e9``
    or ``1.500000`` would differ from what the full path sends."""
    end = len(data) - len(tail)
    if end < len(head) or not data.startswith(head) or not data.endswith(tail):
        return None
    try:
        value = _json_loads(data[len(head) : end])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        return None
    return _json_dumps(value)


def _plain(payload: dict[str, Any]) -> bool:
    """One choice, no role, not finishing, no usage or error: only its values can vary."""
    if "error" in payload or payload.get("usage") is not None:
        return False
    choices = payload.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta")
    return choice.get("finish_reason") is None and not (isinstance(delta, dict) and "role" in delta)


def _one_change(previous: bytes, payload: dict[str, Any]) -> Slot | None:
    """Where ``payload`` differs from the ``previous`` chunk, when that is one string or number
    that the stitcher neither rewrites nor reads."""
    try:
        before = _json_loads(previous)
    except orjson.JSONDecodeError:
        return None
    found: list[Slot] = []
    if not _differences(before, payload, (), found) or len(found) != 1:
        return None
    slot = found[0]
    if slot[:1] in _NOT_SLOTS or (slot[:1] == ("choices",) and slot[2:3] == ("index",)):
        return None  # a value the stitcher rewrites, or that decides how it rewrites
    leaf = _leaf(payload, slot)
    if not isinstance(leaf, str | int | float) or isinstance(leaf, bool):
        return None
    return slot


def _differences(a: Any, b: Any, path: Slot, found: list[Slot]) -> bool:
    """Collect the paths of the scalar values that differ (stopping at two); False when the
    two differ in shape (keys, their order, lengths, a container against a scalar)."""
    if len(path) > _MAX_DEPTH:
        return False
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return False
        return all(_differences(a[k], b[k], (*path, k), found) for k in a)
    if isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            return False
        return all(
            _differences(x, y, (*path, i), found) for i, (x, y) in enumerate(zip(a, b, strict=True))
        )
    if isinstance(b, dict | list):
        return False
    if type(a) is not type(b) or a != b:
        found.append(path)
    return len(found) < 2


def _leaf(payload: Any, path: Slot) -> Any:
    for key in path:
        payload = payload[key]
    return payload


def _split_at(payload: dict[str, Any], path: Slot) -> tuple[bytes, bytes] | None:
    """The payload serialized around the value at ``path``: the bytes before and after it."""
    parent = _leaf(payload, path[:-1])
    value = parent[path[-1]]
    parent[path[-1]] = _SLOT
    try:
        raw = _json_dumps(payload)
    finally:
        parent[path[-1]] = value
    head, found, tail = raw.partition(_SLOT_JSON)
    if not found or _SLOT_JSON in tail:
        return None
    return head, tail
