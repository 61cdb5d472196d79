"""Upstream client failures at the boundary: the retry reason each one is, and the proxy's
502 or 504 it becomes."""

from __future__ import annotations

import pytest

from proxy.config.models import Upstream
from proxy.core.errors import UpstreamTimeout, UpstreamUnavailable
from proxy.http import ClientClosed, ConnectFailed, Disconnected
from proxy.http.errors import BadResponse, ConnectTimeout, ResponseTimeout
from proxy.upstream.exchange import failure_kind, upstream_error

UPSTREAM = Upstream(name="llama", urls=("http://127.0.0.1:1",))


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ConnectFailed("refused"), "connect"),
        (ConnectTimeout("connecting timed out"), "connect"),
        (Disconnected("closed before a response"), "reset"),
        (ClientClosed("the upstream client is closed"), "reset"),
        (ResponseTimeout("no response head"), None),
        (BadResponse("malformed"), None),
        (TimeoutError(), None),
        (ValueError("not the client's"), None),
    ],
)
def test_failure_kind_names_the_retry_on_reason(exc: BaseException, kind: str | None) -> None:
    assert failure_kind(exc) == kind


@pytest.mark.parametrize(
    ("exc", "error", "message"),
    [
        (ConnectFailed("refused"), UpstreamUnavailable, "upstream llama failed: ConnectFailed"),
        (ConnectTimeout("slow"), UpstreamTimeout, "upstream llama timed out"),
        (Disconnected("gone"), UpstreamUnavailable, "upstream llama failed: Disconnected"),
        (BadResponse("bad"), UpstreamUnavailable, "upstream llama failed: BadResponse"),
        (ResponseTimeout("silent"), UpstreamTimeout, "upstream llama timed out"),
        (ClientClosed("closed"), UpstreamUnavailable, "upstream llama failed: ClientClosed"),
    ],
)
def test_upstream_error_is_a_502_or_on_a_timeout_a_504(
    exc: BaseException, error: type[Exception], message: str
) -> None:
    mapped = upstream_error(exc, UPSTREAM)
    assert type(mapped) is error
    assert mapped.message == message
    assert mapped.status == (504 if error is UpstreamTimeout else 502)
