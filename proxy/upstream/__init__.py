"""The upstreams the proxy sends to: admission (slots), replicas and placement, retries and their
budget, health checks, DNS discovery, and one exchange per upstream request.
"""

from proxy.upstream.discovery import Resolver
from proxy.upstream.exchange import Exchange, Ticket, Tickets, UpstreamRequest, upstream_error
from proxy.upstream.service import Upstreams

__all__ = [
    "Exchange",
    "Resolver",
    "Ticket",
    "Tickets",
    "UpstreamRequest",
    "Upstreams",
    "upstream_error",
]
