"""The upstream client's own failures: what each one also is, for the callers that catch it."""

from __future__ import annotations

import pytest

from proxy import http
from proxy.http import BodyTooLong, ClientClosed, ConnectFailed, Disconnected, HTTPClientError
from proxy.http.errors import BadResponse, ConnectTimeout, ResponseTimeout


@pytest.mark.parametrize(
    ("error", "timeout", "os_error"),
    [
        (ConnectFailed, False, True),
        (ConnectTimeout, True, True),
        (Disconnected, False, False),
        (BadResponse, False, False),
        (ResponseTimeout, True, True),  # a TimeoutError is an OSError, as the builtin is
        (ClientClosed, False, True),
    ],
)
def test_each_failure_is_a_client_error_and_a_timeout_or_os_error_where_said(
    error: type[HTTPClientError], timeout: bool, os_error: bool
) -> None:
    exc = error("what happened")
    assert isinstance(exc, HTTPClientError)
    assert isinstance(exc, TimeoutError) is timeout
    assert isinstance(exc, OSError) is os_error
    assert str(exc) == "what happened"


def test_a_connect_timeout_never_reached_a_server() -> None:
    assert issubclass(ConnectTimeout, ConnectFailed)
    assert not issubclass(ResponseTimeout, ConnectFailed)


def test_a_body_past_its_reader_s_cap_is_not_a_failure_of_the_exchange() -> None:
    assert not issubclass(BodyTooLong, HTTPClientError)


def test_the_package_exports_the_whole_tree() -> None:
    exported = {getattr(http, name) for name in http.__all__}
    defined = {
        value
        for value in vars(http.errors).values()
        if isinstance(value, type) and issubclass(value, Exception)
    }
    assert defined <= exported
