"""Upstream URLs, parsed in one place: what the config accepts, where a URL points (``Origin``), the
same URL reaching one of its host's addresses, and the TLS name such a replica checks. Pure.

An upstream URL is ``http`` or ``https`` with a host, an optional port and an optional base path.
User info is accepted and never sent (no request carries it as credentials).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit, urlunsplit


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an upstream URL points: its socket address, Host header, path and TLS."""

    host: str  # a name, lowercased, or an address (IPv6 without its brackets)
    port: int
    host_header: str  # the host (IPv6 bracketed), with the port unless it is the default one
    base_path: str  # "" or "/base": every request path is appended to it
    tls: bool


def default_port(tls: bool) -> int:
    return 443 if tls else 80


def _split(url: str) -> SplitResult | None:
    """``url``'s parts when it is ``http`` or ``https`` with a host; None otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts


def check_url(url: str) -> str:
    """An upstream URL as the config keeps it (no trailing slash); ``ValueError`` unless it is
    ``http`` or ``https`` with a host and without a query or fragment."""
    parts = _split(url)
    if parts is None:
        raise ValueError("not a URL")
    if parts.query or parts.fragment:
        raise ValueError("must not have a query or fragment")
    return url.rstrip("/")


def parse_origin(url: str) -> Origin:
    parts = _split(url)
    if parts is None:
        raise ValueError(f"not an http or https URL: {url}")
    assert parts.hostname is not None  # _split checked it
    tls = parts.scheme == "https"
    default = default_port(tls)
    port = parts.port or default
    name = _bracketed(parts.hostname)
    host_header = name if port == default else f"{name}:{port}"
    return Origin(parts.hostname, port, host_header, parts.path.rstrip("/"), tls)


def authority(url: str) -> str:
    """``url``'s host and port as written, its user info left out: the Host header that a
    replica reached by one of the host's addresses still sends."""
    return urlsplit(url).netloc.rpartition("@")[2]


def at_address(url: str, ip: str) -> str:
    """``url`` reaching the address ``ip`` instead of its host: scheme, user info, a port
    written in it and its path kept (a query or fragment dropped)."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port is not None else ""
    userinfo, at, _ = parts.netloc.rpartition("@")
    ipaddress.ip_address(ip)  # an address, or a ValueError
    return urlunsplit((parts.scheme, userinfo + at + _bracketed(ip) + port, parts.path, "", ""))


def tls_name(url: str, host: str | None) -> str | None:
    """The name an https replica's certificate must carry when ``url`` holds an address reached
    for ``host`` (its configured ``authority``); None for http, or for a URL of its own name."""
    if host is None or not url.startswith("https:"):
        return None
    return urlsplit("//" + host).hostname


def _bracketed(host: str) -> str:
    """A host as a URL or Host header writes it: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host else host
