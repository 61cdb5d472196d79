"""The log: the request line in both formats, on the direct path and through ``logging``, with
its fields; every library's line as one JSON object; ``--log-level``."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import warnings
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from proxy import log
from proxy.cli import _config, _parser
from proxy.config import Listen, single_upstream_config
from proxy.server import Server
from tests.conftest import Backend

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """setup_logging takes the root logger too: pytest's own capture handler is put back."""
    root = logging.getLogger()
    saved = (log.logger.handlers[:], log.logger.level, log.logger.propagate, log._direct)
    saved_root = (root.handlers[:], root.level)
    out = io.StringIO()
    yield out
    log.logger.handlers[:], log.logger.level, log.logger.propagate, log._direct = saved
    root.handlers[:], root.level = saved_root
    logging.captureWarnings(False)


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


def parsed(stream: io.StringIO) -> list[dict[str, Any]]:
    """Every line of the stream, each one JSON object (json.loads fails the test otherwise)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_library_s_exception_is_one_json_line_with_the_traceback_in_a_field(
    stream: io.StringIO,
) -> None:
    setup("json", stream)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("asyncio").exception("Task exception was never retrieved")
    (line,) = parsed(stream)
    assert line["level"] == "error"
    assert line["logger"] == "asyncio"
    assert line["msg"] == "Task exception was never retrieved"
    assert line["exc"].startswith("Traceback (most recent call last):")
    assert line["exc"].endswith("ValueError: boom")


def test_warnings_are_json_lines_too(stream: io.StringIO) -> None:
    setup("json", stream)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
    (line,) = parsed(stream)
    assert line["logger"] == "py.warnings"
    assert "deprecated thing" in line["msg"]


def test_text_format_keeps_the_traceback_readable(stream: io.StringIO) -> None:
    setup("text", stream)
    try:
        raise KeyError("k")
    except KeyError:
        logging.getLogger("aiohttp.server").exception("Error handling request")
    head, *rest = stream.getvalue().splitlines()
    assert head.endswith("error Error handling request logger=aiohttp.server")
    assert rest[0] == "Traceback (most recent call last):"


@pytest.mark.parametrize(
    ("level", "requests_logged"), [("debug", True), ("info", True), ("warning", False)]
)
def test_log_level_gates_the_request_line(
    stream: io.StringIO, level: str, requests_logged: bool
) -> None:
    log.setup_logging("json", level)
    assert log._direct is not None
    log._direct[0].setStream(stream)
    assert log.log_enabled() is requests_logged
    log.log_request(request_id="r")
    logging.getLogger("aiohttp.server").warning("a warning")
    assert [line["msg"] for line in parsed(stream)] == ["request"] * requests_logged + ["a warning"]


def test_log_level_flag_reaches_the_config() -> None:
    options = _parser().parse_args(["--upstream", "http://127.0.0.1:1", "--log-level", "debug"])
    assert _config(options).log_level == "debug"
    options = _parser().parse_args(["--upstream", "http://127.0.0.1:1"])
    assert _config(options).log_level == "info"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--log-level", "loud"])


async def running(backend: Backend) -> Server:
    config = single_upstream_config(backend.url).model_copy(
        update={"listen": Listen(host="127.0.0.1", port=0)}
    )
    server = Server(config)
    await server.start()
    return server


async def test_malformed_request_is_one_json_line_not_a_traceback(
    stream: io.StringIO, backend: Backend
) -> None:
    setup("json", stream)
    server = await running(backend)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.proxy_port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
        reply = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert reply.split(b" ", 2)[1] == b"400"
    finally:
        await server.close()
    lines = parsed(stream)
    (error,) = [line for line in lines if line.get("logger") == "aiohttp.server"]
    assert error["level"] == "error"
    assert "BadHttpMessage" in error["exc"]


async def test_request_line_fields(stream: io.StringIO, backend: Backend) -> None:
    setup("json", stream)
    server = await running(backend)
    url = f"http://127.0.0.1:{server.proxy_port}/v1/chat/completions"
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 3}
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={**body, "n": 2}, headers={"X-Request-Id": "r1"}) as r:
                assert r.status == 200
                fanned = await r.read()
            stream_body = {**body, "stream": True}
            async with http.post(url, json=stream_body, headers={"traceparent": parent}) as r:
                passed = await r.read()
            async with http.get(f"http://127.0.0.1:{server.proxy_port}/v1/models") as r:
                await r.read()
    finally:
        await server.close()
    fan, stream_line, models = [line for line in parsed(stream) if line["msg"] == "request"]
    assert fan["request_id"] == "r1"
    assert fan["path"] == "/v1/chat/completions"
    assert fan["model"] == "m"
    assert fan["replica"] == backend.url
    assert fan["bytes_out"] == len(fanned)
    assert fan["bytes_in"] > 0
    assert fan["prompt_tokens"] > 0
    assert fan["completion_tokens"] == 6  # 3 tokens for each of two choices
    assert fan["ttft_ms"] is None  # not a stream
    assert fan["trace_id"] is None
    # A single-choice stream passes through: its first chunk's time, no parsed usage.
    assert stream_line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert stream_line["bytes_out"] == len(passed)
    assert 0 < stream_line["ttft_ms"] <= stream_line["duration_ms"]
    assert stream_line["replica"] == backend.url
    assert stream_line["prompt_tokens"] is None
    # No X-Request-Id from the client: the proxy's own, still one per line.
    assert stream_line["request_id"] != models["request_id"]
    assert all(isinstance(line["request_id"], str) for line in (stream_line, models))
    assert models["model"] is None
