"""One client request: the handler that decides, the pass-through relay, the fan-out and its stream
writer, and the answers the proxy writes itself.
"""

from proxy.request.handler import Handler, InFlight, Requests
from proxy.request.responses import (
    SERVER,
    WholeAnswer,
    error_page,
    server_header,
    status_response,
)

__all__ = [
    "SERVER",
    "Handler",
    "InFlight",
    "Requests",
    "WholeAnswer",
    "error_page",
    "server_header",
    "status_response",
]
