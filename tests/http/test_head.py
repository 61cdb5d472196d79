"""Tests for proxy.http.connection.request_head: the head of a request sent upstream, built from
literal parts; a line break anywhere in it is refused, never sent."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from proxy.http import connection
from proxy.http.connection import request_head


def test_the_head_carries_the_headers_in_order_with_the_proxys_own_host_and_framing() -> None:
    headers = CIMultiDict(
        [("Content-Type", "application/json"), ("content-length", "9"), ("X-A", "1"),
         ("Transfer-Encoding", "chunked"), ("Connection", "close"), ("X-A", "2")]
    )  # fmt: skip
    head = request_head("POST", "/v1/chat/completions?x=1", "up:8000", headers, b"{}")
    assert head == (
        b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: up:8000\r\n"
        b"Content-Type: application/json\r\nX-A: 1\r\nX-A: 2\r\nContent-Length: 2\r\n\r\n"
    )


def test_a_configured_host_header_names_the_host() -> None:
    head = request_head("GET", "/", "10.0.0.1:8000", {"host": "api.example"}, None)
    assert head == b"GET / HTTP/1.1\r\nHost: api.example\r\n\r\n"


@pytest.mark.parametrize(
    ("name", "value"),
    [("X-A", "a\r\nX-Injected: 1"), ("X-A", "a\nb"), ("X-A", "a\rb"), ("X-A\r\nX-B", "1"),
     ("X-A\n", "1"), ("Host", "h\r\n")],
)  # fmt: skip
def test_a_header_with_a_line_break_is_refused_by_name(name: str, value: str) -> None:
    with pytest.raises(ValueError, match="has a line break") as refused:
        request_head("POST", "/v1/completions", "up", CIMultiDict([(name, value)]), b"{}")
    assert repr(name) in str(refused.value)


@pytest.mark.parametrize(
    ("method", "target", "host"),
    [("GET", "/a\r\nX: 1", "up"), ("GET\n", "/", "up"), ("GET", "/", "up\r\nX: 1")],
)
def test_a_line_break_in_the_request_line_or_the_host_is_refused(
    method: str, target: str, host: str
) -> None:
    with pytest.raises(ValueError, match="line break"):
        request_head(method, target, host, {"Accept": "*/*"}, None)


def test_header_names_a_client_makes_up_are_judged_but_not_all_kept() -> None:
    """Names are the client's to choose: past a bound, each is judged and not kept."""
    for batch in range(3):
        names = [f"X-Made-Up-{batch}-{i}" for i in range(400)]
        head = request_head("GET", "/", "up", {name: "v" for name in names}, None)
        assert head.count(b": v\r\n") == 400
    assert len(connection._parts) <= 512
