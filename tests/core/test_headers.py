"""Tests for proxy.core.headers: literal header lists in, the headers that cross out
(docs/behaviour.md#headers)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from proxy.core import headers as headers_module
from proxy.core.headers import (
    child_headers,
    client_request_id,
    rebased_headers,
    request_headers,
    response_headers,
)

REQUEST_DROP = headers_module._REQUEST_DROP
RESPONSE_DROP = headers_module._RESPONSE_DROP

HOP_BY_HOP = [
    ("Connection", "keep-alive"),
    ("Keep-Alive", "timeout=5"),
    ("Proxy-Authorization", "Basic cHJveHk6cHc="),
    ("Proxy-Authenticate", "Basic"),
    ("Proxy-Connection", "keep-alive"),
    ("TE", "trailers"),
    ("Trailer", "X-Checksum"),
    ("Transfer-Encoding", "chunked"),
    ("Upgrade", "websocket"),
]
# docs/behaviour.md#headers names the whole ``Proxy-*`` family hop-by-hop, not only the
# registered three.
DROPPED = [*HOP_BY_HOP, ("Proxy-Anything", "x"), ("proxy-client-ip", "10.0.0.9")]

END_TO_END_REQUEST = [
    ("Authorization", "Bearer sk-123"),
    ("Content-Type", "application/json"),
    ("Accept", "text/event-stream"),
    ("Accept-Encoding", "gzip"),
    ("User-Agent", "OpenAI/Python 1.50.0"),
    ("X-Request-Id", "abc"),
    ("OpenAI-Organization", "org-1"),
    ("Traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    ("Cookie", "a=1"),
]

END_TO_END_RESPONSE = [
    ("Content-Type", "text/event-stream"),
    ("Cache-Control", "no-cache"),
    ("X-Request-Id", "abc"),
    ("Set-Cookie", "a=1"),
    ("Set-Cookie", "b=2"),
    ("Server", "uvicorn"),
]


def headers(pairs: list[tuple[str, str]]) -> CIMultiDict[str]:
    return CIMultiDict(pairs)


def names(out: CIMultiDict[str]) -> list[str]:
    return [name.lower() for name in out]


@pytest.mark.parametrize(("name", "value"), DROPPED)
def test_request_drops_hop_by_hop_header(name: str, value: str) -> None:
    out = request_headers(headers([(name, value), ("Authorization", "Bearer k")]), {})
    assert list(out.items()) == [("Authorization", "Bearer k")]


@pytest.mark.parametrize(("name", "value"), DROPPED)
def test_response_drops_hop_by_hop_header(name: str, value: str) -> None:
    out = response_headers(headers([(name, value), ("Content-Type", "application/json")]))
    assert list(out.items()) == [("Content-Type", "application/json")]


@pytest.mark.parametrize(
    "name", ["connection", "CONNECTION", "transfer-encoding", "Transfer-encoding", "te"]
)
def test_hop_by_hop_names_match_case_insensitively(name: str) -> None:
    assert list(request_headers(headers([(name, "x")]), {}).items()) == []
    assert list(response_headers(headers([(name, "x")])).items()) == []


@pytest.mark.parametrize(
    "connection",
    [
        pytest.param("X-Hop, keep-alive", id="list"),
        pytest.param(" x-hop ,close", id="spaces-and-case"),
        pytest.param("close,,X-HOP", id="empty-token"),
    ],
)
def test_headers_named_in_connection_are_dropped_both_ways(connection: str) -> None:
    pairs = [("Connection", connection), ("X-Hop", "1"), ("X-Keep", "2")]
    assert list(request_headers(headers(pairs), {}).items()) == [("X-Keep", "2")]
    assert list(response_headers(headers(pairs)).items()) == [("X-Keep", "2")]


def test_headers_named_in_any_of_several_connection_headers_are_dropped() -> None:
    pairs = [("Connection", "X-One"), ("Connection", "X-Two"), ("X-One", "1"), ("X-Two", "2")]
    assert list(request_headers(headers(pairs), {}).items()) == []
    assert list(response_headers(headers(pairs)).items()) == []


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("Host", "evil.example:443"),
        ("host", "x"),
        ("Content-Length", "42"),
        ("content-length", "0"),
    ],
)
def test_request_drops_host_and_content_length(name: str, value: str) -> None:
    out = request_headers(headers([(name, value), ("Accept", "*/*")]), {})
    assert list(out.items()) == [("Accept", "*/*")]


def test_request_keeps_authorization_and_every_end_to_end_header_in_order() -> None:
    out = request_headers(headers(END_TO_END_REQUEST + HOP_BY_HOP + [("Host", "h")]), {})
    assert list(out.items()) == END_TO_END_REQUEST


def test_response_keeps_every_end_to_end_header_including_repeated_ones() -> None:
    out = response_headers(headers(HOP_BY_HOP + END_TO_END_RESPONSE))
    assert list(out.items()) == END_TO_END_RESPONSE


def test_injected_headers_replace_the_clients() -> None:
    incoming = headers(
        [
            ("authorization", "Bearer client"),
            ("X-Tenant", "a"),
            ("X-Tenant", "b"),
            ("Accept", "*/*"),
        ]
    )
    out = request_headers(incoming, {"Authorization": "Bearer upstream", "x-tenant": "ops"})
    assert out.getall("Authorization") == ["Bearer upstream"]
    assert out.getall("X-Tenant") == ["ops"]
    assert out["Accept"] == "*/*"
    assert sorted(names(out)) == ["accept", "authorization", "x-tenant"]


def test_injected_headers_are_added_when_the_client_sent_none() -> None:
    out = request_headers(headers([("Accept", "*/*")]), {"Authorization": "Bearer upstream"})
    assert list(out.items()) == [("Accept", "*/*"), ("Authorization", "Bearer upstream")]


def test_filtering_does_not_mutate_the_incoming_headers() -> None:
    pairs = [("Connection", "X-Hop"), ("X-Hop", "1"), ("Host", "h"), ("Authorization", "k")]
    incoming = headers(pairs)
    request_headers(incoming, {"Authorization": "other"})
    response_headers(incoming)
    assert list(incoming.items()) == pairs


@pytest.mark.parametrize(
    ("sent", "asked"),
    [
        (["br, zstd"], None),
        (["gzip, deflate, br, zstd"], "gzip, deflate"),
        (["br;q=1.0, GZIP;q=0.5", "x-gzip"], "GZIP;q=0.5, x-gzip"),
        (["identity", "*"], None),
        ([], None),
    ],
)
def test_children_ask_only_for_codings_the_proxy_inflates(
    sent: list[str], asked: str | None
) -> None:
    incoming = CIMultiDict([("Content-Encoding", "gzip"), ("Authorization", "Bearer k")])
    for value in sent:
        incoming.add("Accept-Encoding", value)
    out = child_headers(incoming, {})
    assert out.getall("Accept-Encoding", []) == ([asked] if asked else [])
    assert "Content-Encoding" not in out  # children carry plain JSON
    assert out["Authorization"] == "Bearer k"


def test_rebased_headers_drop_what_the_first_upstream_configured_and_set_the_others() -> None:
    sent = CIMultiDict(
        [("Authorization", "Bearer first"), ("X-Tenant", "7"), ("X-Request-Id", "0_r"),
         ("Accept", "text/event-stream")]
    )  # fmt: skip
    rebased = rebased_headers(
        sent, {"authorization": "Bearer first", "X-Tenant": "7"}, {"Authorization": "Bearer other"}
    )
    assert list(rebased.items()) == [
        ("X-Request-Id", "0_r"),
        ("Accept", "text/event-stream"),
        ("Authorization", "Bearer other"),
    ]
    assert sent["Authorization"] == "Bearer first"  # the first upstream's copy is untouched


@pytest.mark.parametrize(
    ("header", "body", "expected"),
    [
        pytest.param("abc", None, "abc", id="header"),
        pytest.param("a b  c", None, "a b  c", id="inner-spaces-as-vllm-echoes"),
        pytest.param(None, "mine", "mine", id="body-request-id"),
        pytest.param("head", "body", "head", id="header-wins-as-in-vllm"),
        pytest.param("x" * 200, None, "x" * 200, id="200-chars"),
        pytest.param("x" * 201, None, None, id="too-long"),
        pytest.param(" abc", None, None, id="edge-space"),
        pytest.param("abc\t", None, None, id="tab"),
        pytest.param("caf\u00e9", None, None, id="non-ascii"),
        pytest.param("a\x7fb", None, None, id="del"),
        pytest.param("", None, None, id="empty"),
        pytest.param("caf\u00e9", "mine", None, id="unsafe-header-not-replaced-by-body"),
        pytest.param(None, 17, None, id="body-not-a-string"),
        pytest.param(None, "a\r\nb", None, id="body-crlf"),
        pytest.param(None, None, None, id="none"),
    ],
)
def test_client_request_id_is_what_vllm_would_name_the_request_when_safe(
    header: str | None, body: object, expected: str | None
) -> None:
    assert client_request_id(header, body) == expected


# --- the verdicts kept by name -------------------------------------------------------------------


def _reference(pairs: list[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    """The rule as docs/behaviour.md#headers states it, computed afresh for every header."""
    named = {
        token.strip().lower()
        for name, value in pairs
        if name.lower() == "connection"
        for token in value.split(",")
    }
    return [
        (name, value)
        for name, value in pairs
        if name.lower() not in drop | named and not name.lower().startswith("proxy-")
    ]


_NAMES = st.sampled_from(
    ["Connection", "connection", "CONNECTION", "Keep-Alive", "keep-alive", "TE", "Trailer",
     "Transfer-Encoding", "Upgrade", "Proxy-Authorization", "proxy-x", "Host", "host",
     "Content-Length", "Expect", "X-Foo", "x-foo", "X-Bar", "Authorization", "Accept"]
)  # fmt: skip
_CONNECTION_VALUES = st.lists(
    st.sampled_from(["close", "keep-alive", "X-Foo", " x-bar ", "Upgrade", "", "Authorization"]),
    max_size=4,
).map(",".join)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(_NAMES, st.sampled_from(["1", "a, b", ""])),
            st.tuples(st.just("Connection"), _CONNECTION_VALUES),
        ),
        max_size=12,
    )
)
def test_filtering_with_verdicts_kept_by_name_is_the_rule_applied_afresh(
    pairs: list[tuple[str, str]],
) -> None:
    """Each name's verdict, and each Connection value's tokens, are kept from one request to
    the next: the headers that cross are still those the rule gives, whatever came before."""
    incoming = headers(pairs)
    assert list(request_headers(incoming, {}).items()) == _reference(pairs, REQUEST_DROP)
    assert list(response_headers(incoming).items()) == _reference(pairs, RESPONSE_DROP)


def test_names_a_client_makes_up_are_judged_but_not_all_kept() -> None:
    """Header names are the client's to choose: past a bound, a name is judged and not kept."""
    for batch in range(4):
        pairs = [(f"X-Made-Up-{batch}-{i}", "v") for i in range(300)]
        pairs += [("Proxy-Made-Up-" + str(batch), "v"), ("Connection", f"x-made-up-{batch}-7")]
        expected = [p for p in pairs[:300] if p[0] != f"X-Made-Up-{batch}-7"]
        assert list(request_headers(headers(pairs), {}).items()) == expected
    assert len(headers_module._request_verdicts) <= headers_module._NAMES
    assert len(headers_module._named) <= headers_module._NAMES
