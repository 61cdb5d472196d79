"""The pure core: planning children, SSE, stitching, byte templates, usage, the header and JSON
rules, the proxy's errors. No I/O: bytes and dicts in and out.
"""

from proxy.core.answer import TAIL_BYTES, answer_facts, body_facts
from proxy.core.encoding import INFLATED, Inflater, content_codings, inflate
from proxy.core.errors import (
    BodyTooLarge,
    ChildFailed,
    ClientGone,
    ClientLimited,
    InvalidRequest,
    Overloaded,
    ProxyError,
    RequestTimeout,
    UnsupportedEncoding,
    UpstreamTimeout,
    UpstreamUnavailable,
    error_body,
    status_type,
)
from proxy.core.headers import (
    X_REQUEST_ID,
    child_headers,
    client_request_id,
    rebased_headers,
    request_headers,
    response_headers,
)
from proxy.core.plan import (
    Endpoint,
    Plan,
    endpoint_of,
    is_int,
    is_number,
    parse_body,
    plan_request,
)
from proxy.core.remembered import Remembered
from proxy.core.sse import MAX_EVENT_BYTES, RawEvent, SSEDecoder
from proxy.core.stitch import StreamError, StreamStitcher, error_event, finish_reasons, stitch_json
from proxy.core.url import Origin, at_address, authority, check_url, parse_origin, tls_name
from proxy.core.usage import token_counts

__all__ = [
    "INFLATED",
    "MAX_EVENT_BYTES",
    "TAIL_BYTES",
    "X_REQUEST_ID",
    "BodyTooLarge",
    "ChildFailed",
    "ClientGone",
    "ClientLimited",
    "Endpoint",
    "Inflater",
    "InvalidRequest",
    "Origin",
    "Overloaded",
    "Plan",
    "ProxyError",
    "RawEvent",
    "Remembered",
    "RequestTimeout",
    "SSEDecoder",
    "StreamError",
    "StreamStitcher",
    "UnsupportedEncoding",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "answer_facts",
    "at_address",
    "authority",
    "body_facts",
    "check_url",
    "child_headers",
    "client_request_id",
    "content_codings",
    "endpoint_of",
    "error_body",
    "error_event",
    "finish_reasons",
    "inflate",
    "is_int",
    "is_number",
    "parse_body",
    "parse_origin",
    "plan_request",
    "rebased_headers",
    "request_headers",
    "response_headers",
    "status_type",
    "stitch_json",
    "tls_name",
    "token_counts",
]
