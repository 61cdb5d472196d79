"""Which headers cross the proxy (docs/behaviour.md#headers). Pure.

Hop-by-hop headers (``Proxy-*`` among them), and any named in ``Connection``, never cross;
``Host`` is the upstream's and ``Content-Length`` is recomputed, so neither is copied either.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeAlias

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core.encoding import INFLATED

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


def _connection_tokens(headers: Headers) -> set[str]:
    tokens: set[str] = set()
    for value in headers.getall("Connection", ()):
        tokens.update(t.strip().lower() for t in value.split(",") if t.strip())
    return tokens


def _filtered(headers: Headers, drop: frozenset[str]) -> CIMultiDict[str]:
    named = _connection_tokens(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower not in drop and lower not in named and not lower.startswith("proxy-"):
            out.add(name, value)
    return out


def request_headers(incoming: Headers, injected: Mapping[str, str]) -> CIMultiDict[str]:
    """End-to-end request headers for the upstream; configured headers replace the client's."""
    out = _filtered(incoming, _REQUEST_DROP)
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


def response_headers(incoming: Headers) -> CIMultiDict[str]:
    return _filtered(incoming, _RESPONSE_DROP)


def client_request_id(header: str | None, body_request_id: object) -> str | None:
    """The client's id for its request, when it is safe to forward; None: make one up.

    vLLM names a request by its ``X-Request-Id`` header, or else by the body's ``request_id``
    (``_base_request_id``), so a native-n answer's id is built from that one.
    """
    chosen = header if header is not None else body_request_id
    if isinstance(chosen, str) and _REQUEST_ID.fullmatch(chosen):
        return chosen
    return None
