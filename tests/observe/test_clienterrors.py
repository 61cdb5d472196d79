"""Client protocol errors, literal in and out: the kind each parser error is counted under,
HTTP/0.9's request line, and the log's throttle."""

from __future__ import annotations

import pytest
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    BadStatusLine,
    ContentLengthError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    TransferEncodingError,
)

from proxy.observe.clienterrors import kind_of, lacks_version
from proxy.observe.log import Throttle
from proxy.observe.metrics import PROTOCOL_ERROR_KINDS


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (BadHttpMethod("G@T"), "request_line"),
        (BadStatusLine("Bad status line:\n  Expected HTTP/"), "request_line"),
        (InvalidURLError("Unexpected start char in url:\n\n  b'GET ?q'"), "request_line"),
        (LineTooLong(b"aaa...", 65536), "too_long"),
        (InvalidHeader(b"X-Bad"), "header"),
        (BadHttpMessage("Invalid header token:\n\n  b'Bad Header'\n  ^"), "header"),
        (BadHttpMessage("Duplicate 'Content-Length' header found."), "header"),
        (BadHttpMessage("Missing 'Host' header in request."), "header"),
        (BadHttpMessage("Invalid character in Content-Length:\n\n  b'x'"), "header"),
        (BadHttpMessage("Invalid character in chunk size:\n\n  b'zz'\n  ^"), "body"),
        (TransferEncodingError("Not enough data to satisfy transfer length header."), "body"),
        (ContentLengthError("Not enough data to satisfy content length header."), "body"),
        # The client's own bytes never choose the kind: only the parser's reason before them.
        (BadHttpMessage("Data after `Connection: close`:\n\n  b'chunk header'"), "other"),
    ],
)
def test_each_parser_error_counts_under_a_fixed_kind(exc: HttpProcessingError, kind: str) -> None:
    assert kind_of(exc) == kind
    assert kind in PROTOCOL_ERROR_KINDS


@pytest.mark.parametrize(
    ("line", "http09"),
    [
        (b"GET /", True),
        (b"GET /v1/models\r", True),
        (b"GET http://example.com/", True),
        (b"GET / HTTP/1.1\r", False),
        (b"GET / HTTP/1.0", False),
        (b"POST /x HTTP/2", False),
        (b"GET", False),  # no target: the parser's to refuse
        (b"GET ", False),
        (b"get /", False),  # not a method
        (b"\x16\x03\x01\x02\x00\x01", False),  # TLS on the HTTP port: the parser says so
        (b"", False),
    ],
)
def test_a_request_line_without_a_version_is_http_0_9(line: bytes, http09: bool) -> None:
    assert lacks_version(line) is http09


def test_the_throttle_lets_per_second_lines_through_and_counts_the_rest() -> None:
    throttle = Throttle(per_second=3)
    assert [throttle.admit(10.1) for _ in range(5)] == [0, 0, 0, None, None]
    assert throttle.admit(10.9) is None
    assert throttle.admit(11.0) == 3  # a new second: the line says three were held back
    assert [throttle.admit(11.5) for _ in range(3)] == [0, 0, None]
    assert throttle.admit(500.0) == 1  # however long the silence
