"""Upstream URLs: literal URLs in, literal origins, URLs and names out."""

from __future__ import annotations

import pytest

from proxy.core.url import Origin, at_address, authority, check_url, parse_origin, tls_name


@pytest.mark.parametrize(
    ("url", "origin"),
    [
        ("http://vllm.local:8000", Origin("vllm.local", 8000, "vllm.local:8000", "", False)),
        ("http://vllm.local", Origin("vllm.local", 80, "vllm.local", "", False)),
        ("https://llama.local", Origin("llama.local", 443, "llama.local", "", True)),
        # The scheme's default port, written out, is left out of the Host header.
        ("http://a:80", Origin("a", 80, "a", "", False)),
        ("https://a:443/", Origin("a", 443, "a", "", True)),
        ("https://a:80", Origin("a", 80, "a:80", "", True)),
        ("http://a:443", Origin("a", 443, "a:443", "", False)),
        # A base path, its trailing slashes dropped: request paths are appended to it.
        (
            "https://llama.local:8443/base/",
            Origin("llama.local", 8443, "llama.local:8443", "/base", True),
        ),
        ("http://a/openai/v1", Origin("a", 80, "a", "/openai/v1", False)),
        ("http://a/", Origin("a", 80, "a", "", False)),
        # IPv6 literals: bare to connect to, bracketed in the Host header.
        ("http://[::1]:8000", Origin("::1", 8000, "[::1]:8000", "", False)),
        ("https://[fd00::1]/v1", Origin("fd00::1", 443, "[fd00::1]", "/v1", True)),
        ("http://10.0.0.1:8080", Origin("10.0.0.1", 8080, "10.0.0.1:8080", "", False)),
        # Names are case-insensitive: lowercased. User info is never sent.
        ("http://VLLM.Local:8000", Origin("vllm.local", 8000, "vllm.local:8000", "", False)),
        ("http://user:secret@a:9/x", Origin("a", 9, "a:9", "/x", False)),
        # Port 0 is no port: the default one.
        ("http://a:0", Origin("a", 80, "a", "", False)),
    ],
)  # fmt: skip
def test_parse_origin(url: str, origin: Origin) -> None:
    assert parse_origin(url) == origin


@pytest.mark.parametrize(
    "url", ["ftp://a:1", "a:8000", "//a:8000", "http://", "http:///path", "", "http//a"]
)
def test_parse_origin_refuses_what_is_not_an_http_url_with_a_host(url: str) -> None:
    with pytest.raises(ValueError, match="not an http or https URL"):
        parse_origin(url)


@pytest.mark.parametrize("url", ["http://a:99999", "http://a:port"])
def test_parse_origin_refuses_a_port_that_is_no_port(url: str) -> None:
    with pytest.raises(ValueError, match=r"[Pp]ort"):
        parse_origin(url)


@pytest.mark.parametrize(
    ("url", "kept"),
    [
        ("http://vllm.local:8000/", "http://vllm.local:8000"),
        ("https://llama.local:8443/base/", "https://llama.local:8443/base"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("http://u:p@a:1", "http://u:p@a:1"),
        ("HTTP://A:1", "HTTP://A:1"),  # kept as written; parse_origin reads it
    ],
)
def test_check_url_keeps_the_url_without_a_trailing_slash(url: str, kept: str) -> None:
    assert check_url(url) == kept


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "not a URL"),
        ("ftp://x:1", "not a URL"),
        ("http://", "not a URL"),
        ("x:2", "not a URL"),
        ("http://a:1/?q=1", "must not have a query or fragment"),
        ("http://a:1/#top", "must not have a query or fragment"),
    ],
)
def test_check_url_refuses(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_url(url)


@pytest.mark.parametrize(
    ("url", "ip", "reached"),
    [
        ("http://svc.ns.svc:8000", "10.0.0.1", "http://10.0.0.1:8000"),
        ("https://svc/v1", "fd00::1", "https://[fd00::1]/v1"),
        ("http://user@svc:80/base", "10.1.2.3", "http://user@10.1.2.3:80/base"),
        ("http://[::1]:9", "127.0.0.1", "http://127.0.0.1:9"),
        ("http://svc:8000/a/b", "::ffff:10.0.0.1", "http://[::ffff:10.0.0.1]:8000/a/b"),
    ],
)
def test_at_address_keeps_scheme_user_info_port_and_path(url: str, ip: str, reached: str) -> None:
    assert at_address(url, ip) == reached


def test_at_address_refuses_what_is_not_an_address() -> None:
    with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6 address"):
        at_address("http://svc:8000", "svc.other")


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://svc.ns.svc:8000", "svc.ns.svc:8000"),
        ("https://svc/v1", "svc"),
        ("http://user:pw@svc:80/base", "svc:80"),  # the port as written, the default one too
        ("http://SVC:8000", "SVC:8000"),  # as written
        ("http://[fd00::1]:8000", "[fd00::1]:8000"),
    ],
)
def test_authority_is_host_and_port_as_written(url: str, host: str) -> None:
    assert authority(url) == host


@pytest.mark.parametrize(
    ("url", "host", "name"),
    [
        ("https://10.0.0.1:8443", "llama.local:8443", "llama.local"),
        ("https://10.0.0.1", "Llama.Local", "llama.local"),
        ("https://[fd00::1]", "[fd00::2]:443", "fd00::2"),
        ("http://10.0.0.1:8000", "svc:8000", None),  # plain http: no certificate
        ("https://llama.local:8443", None, None),  # reached by its own name
    ],
)
def test_tls_name_of_a_replica_reached_by_address(
    url: str, host: str | None, name: str | None
) -> None:
    assert tls_name(url, host) == name
