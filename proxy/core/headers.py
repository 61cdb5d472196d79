"""Which headers cross the proxy (docs/behaviour.md#headers). Pure.

Hop-by-hop headers (``Proxy-*`` among them), and any named in ``Connection``, never cross;
``Host`` is the upstream's and ``Content-Length`` is recomputed, so neither is copied either.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Final, TypeAlias

from multidict import CIMultiDict, CIMultiDictProxy, istr

from proxy.core.encoding import INFLATED
from proxy.core.remembered import Remembered

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# The proxy holds the whole body before it sends anything, so `Expect` is answered here.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}
_RESPONSE_DROP = HOP_BY_HOP | {"content-length"}


# Declared an alias: where multidict is not installed (the build's isolated environment, where
# mypyc type-checks the stream path) its classes are Any, and only a declared alias stays a type.
Headers: TypeAlias = CIMultiDictProxy[str] | CIMultiDict[str]

# Visible ASCII and inner spaces, as vLLM echoes: safe to send on, to prefix, to put in an id.
# An edge space would not survive a header (parsers strip it), so it is not taken either.
_REQUEST_ID = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]{0,198}[\x21-\x7e])?")
# The name as multidict's own string: its lower case, for a lookup, is made once.
X_REQUEST_ID: Final = istr("X-Request-Id")


# A header name's verdict: sent on, dropped, or dropped as ``Connection`` (whose tokens name more
# to drop), remembered by the name as it came: a dict lookup where a ``str.lower`` and two set
# lookups were, 16,000 instructions a pass-through with the tokens' below.
_KEEP: Final = 0
_DROP: Final = 1
_CONNECTION: Final = 2
_NAMES = 512  # names remembered a direction, of at most _LONGEST characters
_LONGEST = 128


def _verdict(name: str, drop: frozenset[str]) -> int:
    lower = name.lower()
    if lower == "connection":
        return _CONNECTION
    if lower in drop or lower.startswith("proxy-"):
        return _DROP
    return _KEEP


def _request_verdict(name: str) -> int:
    return _verdict(name, _REQUEST_DROP)


def _response_verdict(name: str) -> int:
    return _verdict(name, _RESPONSE_DROP)


_request_verdicts: Final = Remembered(_request_verdict, _NAMES, _LONGEST)
_response_verdicts: Final = Remembered(_response_verdict, _NAMES, _LONGEST)


def _filtered(headers: Iterable[tuple[str, str]], verdicts: Remembered[int]) -> CIMultiDict[str]:
    kept: list[tuple[str, str]] = []  # made a CIMultiDict in one call, not an add a header
    named: list[str] = []  # what Connection names, dropped too, wherever it stands
    for pair in headers:
        verdict = verdicts.of(pair[0])
        if verdict == _KEEP:
            kept.append(pair)
        elif verdict == _CONNECTION:
            named += _named.of(pair[1])
    out = CIMultiDict(kept)
    for token in named:
        out.popall(token, None)
    return out


def _named_in(connection: str) -> tuple[str, ...]:
    """The header names a ``Connection`` value lists, lower-cased, but for those dropped in
    both directions anyway (``close`` and ``keep-alive`` are the usual values)."""
    tokens = {token.strip().lower() for token in connection.split(",")}
    return tuple(
        sorted(t for t in tokens if t and t not in HOP_BY_HOP and not t.startswith("proxy-"))
    )


_named: Final = Remembered(_named_in, _NAMES, 64)


def request_headers(incoming: Headers, injected: Mapping[str, str]) -> CIMultiDict[str]:
    """End-to-end request headers for the upstream; configured headers replace the client's."""
    out = _filtered(incoming.items(), _request_verdicts)
    for name, value in injected.items():
        out[name] = value
    return out


def child_headers(incoming: Headers, injected: Mapping[str, str]) -> CIMultiDict[str]:
    """Request headers for fan-out children: they carry plain JSON (no ``Content-Encoding``)
    and may answer only in codings the proxy inflates (gzip, deflate), or as they are."""
    out = request_headers(incoming, injected)
    out.popall("Content-Encoding", None)
    accepted = [
        token.strip()
        for value in out.popall("Accept-Encoding", ())
        for token in value.split(",")
        if token.split(";", 1)[0].strip().lower() in INFLATED
    ]
    if accepted:
        out["Accept-Encoding"] = ", ".join(accepted)
    return out


def rebased_headers(
    sent: Mapping[str, str] | CIMultiDict[str],
    configured: Mapping[str, str],
    other: Mapping[str, str],
) -> CIMultiDict[str]:
    """Headers sent to one upstream, made for another (a fallback): what the first one's
    configuration set is removed, so its credentials never reach the other, and the other's
    configured headers are set."""
    out = CIMultiDict(sent)
    for name in configured:
        out.popall(name, None)
    for name, value in other.items():
        out[name] = value
    return out


def response_headers(incoming: Headers | list[tuple[str, str]]) -> CIMultiDict[str]:
    """End-to-end response headers for the client, from a head's headers or their fields (a
    list is iterated without an iterator object per header)."""
    if isinstance(incoming, list):
        return _filtered(incoming, _response_verdicts)
    return _filtered(incoming.items(), _response_verdicts)


def client_request_id(header: str | None, body_request_id: object) -> str | None:
    """The client's id for its request, when it is safe to forward; None: make one up.

    vLLM names a request by its ``X-Request-Id`` header, or else by the body's ``request_id``
    (``_base_request_id``), so a native-n answer's id is built from that one.
    """
    chosen = header if header is not None else body_request_id
    if isinstance(chosen, str) and _REQUEST_ID.fullmatch(chosen):
        return chosen
    return None
