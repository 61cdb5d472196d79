"""The upstreams the proxy sends to: admission (slots), replicas and placement, retries and their
budget, health checks, DNS discovery, and one exchange per upstream request.
"""

from proxy.upstream.discovery import Resolver
from proxy.upstream.service import (
    Exchange,
    Ticket,
    Tickets,
    UpstreamRequest,
    Upstreams,
    upstream_error,
)

__all__ = [
    "Exchange",
    "Resolver",
    "Ticket",
    "Tickets",
    "UpstreamRequest",
    "Upstreams",
    "upstream_error",
]
