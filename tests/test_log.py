"""The request log line, both formats, on the direct path and through ``logging``."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from proxy import log


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    saved = (log.logger.handlers[:], log.logger.level, log.logger.propagate, log._direct)
    out = io.StringIO()
    yield out
    log.logger.handlers[:], log.logger.level, log.logger.propagate, log._direct = saved


def setup(fmt: str, out: io.StringIO) -> None:
    log.setup_logging(fmt)
    assert log._direct is not None
    log._direct[0].setStream(out)


def test_json_request_line_holds_its_fields(stream: io.StringIO) -> None:
    setup("json", stream)
    log.log_request(request_id="r1", status=200, duration_ms=0.123)  # outside a loop: at once
    log.log_event("started", port=8080)  # through logging, as every other event
    request, event = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert {k: request[k] for k in ("level", "msg", "request_id", "status", "duration_ms")} == {
        "level": "info", "msg": "request", "request_id": "r1", "status": 200, "duration_ms": 0.123
    }  # fmt: skip
    assert {k: event[k] for k in ("level", "msg", "port")} == {
        "level": "info", "msg": "started", "port": 8080
    }  # fmt: skip
    assert isinstance(request["ts"], float)
    assert isinstance(event["ts"], float)


def test_text_request_line_reads_like_logging_s_own(stream: io.StringIO) -> None:
    setup("text", stream)
    log.log_request(request_id="r1", status=200)
    log.log_event("started", port=8080)
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    request, event = stream.getvalue().splitlines()
    assert re.fullmatch(stamp + r" info request request_id=r1 status=200", request), request
    assert re.fullmatch(stamp + r" info started port=8080", event), event


def test_another_handler_gets_the_request_line_through_logging(stream: io.StringIO) -> None:
    setup("json", stream)
    records: list[logging.LogRecord] = []
    extra = logging.Handler()
    extra.emit = records.append  # type: ignore[method-assign,assignment]
    log.logger.addHandler(extra)
    log.log_request(request_id="r2", status=404)
    assert [r.getMessage() for r in records] == ["request"]
    assert records[0].fields == {"request_id": "r2", "status": 404}  # type: ignore[attr-defined]
    assert json.loads(stream.getvalue())["request_id"] == "r2"
