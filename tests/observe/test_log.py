"""The log: the request line in both formats, on the direct path and through ``logging``, with
its fields; every library's line as one JSON object; ``--log-level``."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import re
import sys
import warnings
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from proxy.cli import _config, _parser
from proxy.config.models import ClientTimeouts, Listen, single_upstream_config
from proxy.observe import line as request_line
from proxy.observe import log
from proxy.observe.clienterrors import LINES_PER_SECOND
from proxy.observe.line import json_line
from proxy.observe.metrics import PROTOCOL_ERROR_KINDS
from proxy.observe.record import Observers, RequestRecord
from proxy.request.responses import WholeAnswer
from proxy.server.generations import Generations
from proxy.server.process import Server
from tests.support.servers import Backend, metric

MESSAGES = [{"role": "user", "content": "hello"}]
WITHIN = 30.0  # seconds any one wait may take


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """setup_logging takes the root logger too: pytest's own capture handler is put back."""
    root = logging.getLogger()
    saved = (log.logger.handlers[:], log.logger.level, log.logger.propagate, request_line._direct)
    saved_root = (root.handlers[:], root.level)
    out = io.StringIO()
    yield out
    log.logger.handlers[:], log.logger.level, log.logger.propagate, direct = saved
    request_line.write_directly(direct)
    root.handlers[:], root.level = saved_root
    logging.captureWarnings(False)


def setup(fmt: str, out: io.StringIO) -> None:
    log.setup_logging(fmt)
    assert request_line._direct is not None
    request_line._direct.handler.setStream(out)


def test_times_in_the_line_are_milliseconds_to_the_microsecond() -> None:
    """The line's times (``proxy.observe.line.ms``) and the JSON line's ``ts`` round with
    integers, not to digits: the same value as ``round(x, 3)`` but where a half microsecond
    falls, never more than three decimals."""
    rng = random.Random(38)
    samples = [0.0, 1e-7, 0.0004996, 0.001, 0.1234565, 59.9999996, 3600.000001]
    samples += [rng.uniform(0, 120) for _ in range(2000)] + [
        rng.expovariate(1e4) for _ in range(2000)
    ]
    for seconds in samples:
        ms = request_line.ms(seconds)
        assert abs(ms - round(seconds * 1000, 3)) <= 0.001 + 1e-9, seconds
        assert abs(ms - seconds * 1000) <= 0.0005 + 1e-9, seconds
        assert len(repr(ms).partition(".")[2]) <= 3, (seconds, ms)
    stamped = json.loads(log._JsonFormatter().line(1733400000.1234567, "info", "request", {}))
    assert stamped["ts"] == 1733400000.123


def test_json_request_line_holds_its_fields(stream: io.StringIO) -> None:
    setup("json", stream)
    # Outside a loop: written at once.
    log.log_request({"request_id": "r1", "status": 200, "duration_ms": 0.123})
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


def test_the_request_line_is_the_json_line_of_its_fields(stream: io.StringIO) -> None:
    """The request line is written from one object, not through ``json_line``: byte for byte
    what ``json_line`` makes of its fields, with no fields, odd values, and every field of a real
    line."""
    setup("json", stream)
    assert request_line._direct is not None
    assert request_line._direct.json  # the direct path, not the formatter's
    every = {"request_id": 'a\n"b', "trace_id": None, "n": 4, "duration_ms": 0.5, "x": object()}
    cases: list[dict[str, Any]] = [{}, {"status": 200}, every]
    for fields in cases:
        log.log_request(fields)
    written = stream.getvalue().splitlines()
    assert len(written) == len(cases)
    for fields, text in zip(cases, written, strict=True):
        ts = json.loads(text)["ts"]
        assert text == request_line.json_line(ts, "info", "request", fields)


@pytest.mark.parametrize("other_handler", [False, True])
def test_a_records_line_is_the_json_line_of_its_fields(
    stream: io.StringIO, other_handler: bool
) -> None:
    """The observer's line, whether written at once (directly) or through logging (another
    handler as well): byte for byte ``json_line`` of the fields of ``request_line``."""
    setup("json", stream)
    if other_handler:
        log.logger.addHandler(logging.NullHandler())
    record = RequestRecord(Observers([]), "POST", "/v1/chat/completions", {"X-Request-Id": 'a\n"'})
    record.usage = {"prompt_tokens": 3, "completion_tokens": 5}
    record.status, record.n, record.model = 200, 2, "m"
    record.counted()
    request_line.RequestLine().ended(record)
    (text,) = stream.getvalue().splitlines()
    line = request_line.request_line(record)
    assert list(line)[:3] == ["ts", "level", "msg"]
    fields = {name: value for name, value in line.items() if name not in ("ts", "level", "msg")}
    assert text == json_line(json.loads(text)["ts"], "info", "request", fields)
    assert json.loads(text)["request_id"] == 'a\n"'


def test_text_request_line_reads_like_logging_s_own(stream: io.StringIO) -> None:
    setup("text", stream)
    log.log_request({"request_id": "r1", "status": 200})
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
    log.log_request({"request_id": "r2", "status": 404})
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
    # Indented: no line of it (an exception's message may hold a client's bytes) starts
    # like a log line.
    assert rest[0] == "  Traceback (most recent call last):"
    assert rest[-1] == "  KeyError: 'k'"


STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
FORGED = "\n2030-01-01 00:00:00,000 info request request_id=admin status=200"


def test_text_format_escapes_what_a_client_chose(stream: io.StringIO) -> None:
    setup("text", stream)
    log.log_request({
        "path": "/v1/models" + FORGED, "model": "m x=1", "request_id": 'r"1\\', "status": 200,
        "n": 1, "replica": "\u2028\x1b[31m", "upstream": "",
    })  # fmt: skip
    log.log_event("event" + FORGED, field="\r\t")
    request, event = stream.getvalue().splitlines()  # two records, two lines
    assert re.fullmatch(
        STAMP + r" info request path=\"/v1/models\\n2030-01-01 00:00:00,000 info request "
        r"request_id=admin status=200\" model=\"m x=1\" request_id=\"r\\\"1\\\\\" "
        r"status=200 n=1 replica=\"\\u2028\\x1b\[31m\" upstream=",
        request,
    ), request
    assert re.fullmatch(
        STAMP + r" info event\\n2030-01-01 00:00:00,000 info request request_id=admin "
        r"status=200 field=\"\\r\\t\"",
        event,
    ), event


@pytest.mark.parametrize(
    ("level", "requests_logged"), [("debug", True), ("info", True), ("warning", False)]
)
def test_log_level_gates_the_request_line(
    stream: io.StringIO, level: str, requests_logged: bool
) -> None:
    log.setup_logging("json", level)
    assert request_line._direct is not None
    request_line._direct.handler.setStream(stream)
    assert log.log_enabled() is requests_logged
    log.log_request({"request_id": "r"})
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


# Requests the HTTP parser refuses, each with the kind it is counted under.
MALFORMED = {
    "request_line": [b"G@T / HTTP/1.1\r\nHost: x\r\n\r\n"],
    "header": [b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"],
    "too_long": [b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n"],
    "body": [
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    ],
    "body-in-a-later-read": [  # the head handled first, then a bad chunk size
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"3\r\nabc\r\nzz\r\nmore\r\n",
    ],
    "http/0.9": [b"GET /v1/models\r\n"],
}
KIND = {"body-in-a-later-read": "body", "http/0.9": "request_line"}


async def running_with_admin(backend: Backend) -> Server:
    config = single_upstream_config(backend.url).model_copy(
        update={
            "listen": Listen(host="127.0.0.1", port=0),
            "admin": Listen(host="127.0.0.1", port=0),
            # far longer than any answer below may take: they come at once, not at a deadline
            "client_timeouts": ClientTimeouts(headers=600, body=600),
        }
    )
    server = Server(config)
    await server.start()
    return server


async def send_raw(port: int, pieces: list[bytes]) -> bytes:
    """Each piece in its own write, once the proxy has taken the one before; the whole answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for piece in pieces[:-1]:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)  # a later read, not a timing assertion
        writer.write(pieces[-1])
        async with asyncio.timeout(WITHIN):
            return await reader.read()
    finally:
        writer.close()


def protocol_errors(server: Server) -> dict[str, float]:
    text = server.metrics.render().decode()
    return {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "n_proxy_client_protocol_errors_total"
    }


@pytest.mark.parametrize(
    ("case", "listener"),
    # The admin listener reads no body: a broken one is never parsed there.
    [(c, "proxy") for c in MALFORMED] + [(c, "admin") for c in MALFORMED if "later" not in c],
)
async def test_a_malformed_request_is_one_short_info_line_and_a_count(
    stream: io.StringIO, backend: Backend, case: str, listener: str
) -> None:
    setup("json", stream)
    server = await running_with_admin(backend)
    port = server.proxy_port if listener == "proxy" else server.admin_port
    try:
        reply = await send_raw(port, MALFORMED[case])
        counted = protocol_errors(server)
    finally:
        await server.close()
    status_line, _, body = reply.partition(b"\r\n")
    assert status_line.split(b" ")[1] == b"400", reply[:200]
    assert orjson.loads(body.partition(b"\r\n\r\n")[2])["error"]["type"] == "invalid_request_error"
    kind = KIND.get(case, case)
    assert counted == {k: 1.0 if k == kind else 0.0 for k in PROTOCOL_ERROR_KINDS}
    lines = parsed(stream)
    assert not [line for line in lines if line.get("logger", "").startswith("aiohttp")]
    (error,) = [line for line in lines if line["msg"] == "client protocol error"]
    assert error["level"] == "info"  # the client's fault, as nginx logs it
    assert error["kind"] == kind
    assert error["remote"] == "127.0.0.1"
    assert "exc" not in error
    assert len(json.dumps(error)) < 200  # whatever the client sent


async def test_log_level_warning_drops_protocol_error_lines_but_counts_them(
    stream: io.StringIO, backend: Backend
) -> None:
    log.setup_logging("json", "warning")
    assert request_line._direct is not None
    request_line._direct.handler.setStream(stream)
    server = await running_with_admin(backend)
    try:
        await send_raw(server.proxy_port, MALFORMED["header"])
        assert protocol_errors(server)["header"] == 1
    finally:
        await server.close()
    assert parsed(stream) == []


async def test_protocol_error_lines_are_rate_limited_and_say_how_many_were_held_back(
    stream: io.StringIO, backend: Backend
) -> None:
    setup("json", stream)
    server = await running_with_admin(backend)
    now = [100.0]
    server.client_errors.clock = lambda: now[0]
    try:
        for _ in range(LINES_PER_SECOND + 5):  # within one second of the throttle's clock
            await send_raw(server.proxy_port, MALFORMED["header"])
        now[0] += 1.0
        await send_raw(server.proxy_port, MALFORMED["request_line"])
        counted = protocol_errors(server)
    finally:
        await server.close()
    assert (counted["header"], counted["request_line"]) == (LINES_PER_SECOND + 5, 1)
    lines = [line for line in parsed(stream) if line["msg"] == "client protocol error"]
    assert [line.get("suppressed") for line in lines] == [None] * LINES_PER_SECOND + [5]
    assert lines[-1]["kind"] == "request_line"


async def test_a_path_or_model_with_a_line_break_stays_on_its_request_s_line(
    stream: io.StringIO, backend: Backend
) -> None:
    setup("text", stream)
    server = await running(backend)
    url = f"http://127.0.0.1:{server.proxy_port}"
    body = {"model": "m" + FORGED, "messages": MESSAGES, "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                await r.read()
            async with http.get(URL(url + "/v1/models%0Aforged", encoded=True)) as r:
                assert r.headers["Server"] != "n-proxy"  # the backend's answer: passed through
    finally:
        await server.close()
    for handler in logging.getLogger().handlers:
        handler.flush()
    lines = stream.getvalue().splitlines()
    requests = [line for line in lines if " info request " in line]
    assert len(requests) == 2
    assert all(re.match(STAMP + " ", line) for line in lines)  # no line a client wrote
    assert r'model="m\n2030-01-01 00:00:00,000 info request' in requests[0]
    assert 'path="/v1/models\\nforged" ' in requests[1]


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


@pytest.mark.parametrize("n", [1, 2], ids=["pass-through", "fan-out"])
async def test_a_whole_answer_is_written_before_its_request_line(
    stream: io.StringIO, backend: Backend, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """A JSON answer leaves before its request's line and metrics are made
    (``WholeAnswer.ends``): they are off the client's wait. When the line is added, the whole
    answer has been written to the client's connection already."""
    setup("json", stream)
    requests: list[web.Request] = []
    written: list[int] = []
    dispatch = Generations.dispatch

    def recorded(self: Generations, request: web.Request) -> Awaitable[web.StreamResponse]:
        requests.append(request)
        return dispatch(self, request)

    class Added(request_line.Lines):
        def add(self, line: str) -> None:
            if '"msg":"request"' in line:
                written.append(requests[-1].writer.output_size)
            super().add(line)

    monkeypatch.setattr(Generations, "dispatch", recorded)
    direct = request_line._direct
    assert direct is not None
    handler = direct.handler
    handler._lines = Added(stream)  # the request line's way in, and every other line's
    request_line.write_directly(request_line.Direct(handler, json_line))
    server = await running(backend)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 3, "n": n}
    try:
        answer = await send_raw(
            server.proxy_port,
            [
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(orjson.dumps(body)), orjson.dumps(body))
            ],
        )
    finally:
        await server.close()
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert len(orjson.loads(answer.partition(b"\r\n\r\n")[2])["choices"]) == n
    assert written == [len(answer)]
    (line,) = [line for line in parsed(stream) if line["msg"] == "request"]
    assert line["completion_tokens"] == 3 * n  # the answer's usage, read for its line


@pytest.mark.parametrize("n", [1, 2], ids=["pass-through", "fan-out"])
async def test_a_whole_answer_is_counted_before_it_is_written(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """A client that has its JSON answer finds it counted in /metrics (another worker's admin
    listener may serve them): the request and its tokens are counted before the answer's write."""
    server = await running(backend)
    counted: list[tuple[float, float]] = []
    prepare = WholeAnswer.prepare

    async def prepared(self: WholeAnswer, request: web.BaseRequest) -> Any:
        counted.append(
            (
                metric(server.metrics, "n_proxy_requests_total"),
                metric(server.metrics, "n_proxy_completion_tokens_total"),
            )
        )
        return await prepare(self, request)

    monkeypatch.setattr(WholeAnswer, "prepare", prepared)
    body = orjson.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 3, "n": n})
    try:
        answer = await send_raw(
            server.proxy_port,
            [
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            ],
        )
    finally:
        await server.close()
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert counted == [(1, 3 * n)]


# --- the handler's batches: one write per tick of the loop it runs in --------------------------


class _Writes(io.StringIO):
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)


def test_lines_of_one_tick_leave_in_one_write_on_whichever_loop_runs_them() -> None:
    """Lines added in one tick of a loop are written together at its next; with no loop running
    in the adding thread (before the loop, after it, from another thread) a line is written at
    once. The handler remembers the loop it last used: a loop that stopped, or one running in
    another thread, is never the one it schedules a write on."""
    handler = log._BatchingHandler()
    writes = _Writes()
    handler.setStream(writes)
    handler.add("before")  # no loop: at once
    assert writes.writes == ["before\n"]

    async def tick(name: str) -> list[str]:
        for i in range(3):
            handler.add(f"{name}-{i}")
        held = list(writes.writes)
        await asyncio.sleep(0)  # the flush scheduled on this loop runs
        await asyncio.sleep(0)
        assert writes.writes[len(held) :] == [f"{name}-0\n{name}-1\n{name}-2\n"]
        return held

    for name in ("first", "second"):  # the second loop: a new one, in the same thread
        writes.writes.clear()
        assert asyncio.run(tick(name)) == []  # nothing written within the tick
    writes.writes.clear()
    handler.add("after")  # its loop closed: at once
    assert writes.writes == ["after\n"]

    def add_and_look() -> list[str]:
        handler.add("threaded")
        return list(writes.writes)  # written there and then, not by the loop later

    async def from_another_thread() -> None:
        await tick("third")  # the handler knows this loop now
        writes.writes.clear()
        assert await asyncio.to_thread(add_and_look) == ["threaded\n"]

    asyncio.run(from_another_thread())


class _Counted(io.TextIOWrapper):
    """A real text stream over a file, that counts its flushes."""

    flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


def _stream(path: Path, kind: str) -> _Counted:
    raw = io.FileIO(path, "w")
    if kind == "through":  # stderr into a pipe or a file, from Python 3.9
        return _Counted(raw, encoding="utf-8", write_through=True)
    buffered = io.BufferedWriter(raw)
    # "lines": stderr on a terminal; "buffered": a stream that holds what it is given
    return _Counted(buffered, encoding="utf-8", line_buffering=kind == "lines")


@pytest.mark.parametrize(("kind", "flushed"), [("through", 0), ("lines", 0), ("buffered", 1)])
def test_a_ticks_lines_are_in_the_file_at_the_tick_with_a_flush_only_where_one_is_needed(
    tmp_path: Path, kind: str, flushed: int
) -> None:
    """A tick's lines reach the file in that tick, whatever the stream: a stream that writes
    them out by itself (stderr, to a terminal or not) is not flushed as well; one that holds
    them is. The handler's own ``flush`` flushes either."""
    path = tmp_path / "log"
    handler = log._BatchingHandler()
    stream = _stream(path, kind)
    handler.setStream(stream)
    stream.flushes = 0  # setStream flushes the stream it replaces, and may look at this one

    async def tick() -> None:
        handler.add("one")
        handler.add("two")
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    try:
        asyncio.run(tick())
        assert path.read_text() == "one\ntwo\n"
        assert stream.flushes == flushed
        handler.flush()
        assert stream.flushes == flushed + 1
    finally:
        stream.close()


def test_stderr_itself_writes_its_lines_out() -> None:
    """What the handler counts on for the proxy's own stream, on this Python."""
    assert request_line.writes_out(sys.__stderr__)
