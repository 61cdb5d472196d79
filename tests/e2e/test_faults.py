"""Every injected upstream fault, for n=1 and n>1, JSON and SSE, gets the answer
docs/behaviour.md#errors gives it.

Each test also proves that nothing leaks: no upstream connection left acquired, no task left
running, no file descriptor left open, and no child still generating at the backend.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.config.models import Timeouts
from proxy.devserver import generate
from tests.support.client import sse_payloads
from tests.support.rig import ANSWER_WITHIN, RELAXED, RID, MakeRig, Rig

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "tell me a story"}]
PROMPT = "tell me a story"  # the text the devserver generates from for MESSAGES
DELAY = 0.002  # backend seconds per token for every child without its own x_demo delay
LONG = 5000  # tokens: a sibling still generating when its fan-out fails (10 s at DELAY)
SHORT = 6
K = 3  # children of every fan-out here
FAULTY = 1  # the choice that gets the fault
SEED = 100
SHORT_WAIT = 1.0  # seconds: the one timeout a test is about (the others must not trip it,
# on a loaded machine too: a sibling slower than this to start would time out itself)


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A port that is bound but never listens: connecting to it is refused, deterministically."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


# --- requests and what the backend would answer -----------------------------------------------


def chat_body(
    n: int, stream: bool, fault: str | None, max_tokens: int, after_tokens: int = 2
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": MESSAGES,
        "seed": SEED,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # answers of exactly max_tokens tokens: siblings outlive the fault
        "stream": stream,
    }
    if n > 1:
        body["n"] = n
    if stream:
        body["stream_options"] = {"include_usage": True}
    if fault is not None:
        target = SEED + FAULTY if n > 1 else SEED
        demo: dict[str, Any] = {"only_seed": target, "fault": fault, "after_tokens": after_tokens}
        if not stream:
            # A JSON fault strikes after the whole answer: without delay, while siblings generate.
            demo["token_delay"] = 0
        body["x_demo"] = demo
    return body


def child_rids(n: int) -> list[str]:
    return [f"{i}_t" for i in range(n)] if n > 1 else ["t"]


def expected_text(seed: int, max_tokens: int) -> str:
    return "".join(t.text for t in generate(PROMPT, seed, max_tokens, may_stop=False).tokens)


def without_created(raw: bytes) -> bytes:
    """Two answers a second apart differ only in ``created``."""
    return re.sub(rb'"created":\s*\d+', b'"created":0', raw)


async def post_until_cut(rig: Rig, url: str, body: dict[str, Any]) -> tuple[int, bytes, bool]:
    """Read a stream to its end or until the connection is cut; True when it was cut."""
    got = bytearray()
    async with (
        asyncio.timeout(ANSWER_WITHIN),
        rig.client.post(url, json=body, headers={"X-Request-Id": RID}) as response,
    ):
        try:
            async for chunk in response.content.iter_any():
                got += chunk
        except aiohttp.ClientPayloadError:
            return response.status, bytes(got), True
        return response.status, bytes(got), False


def proxy_error(raw: bytes) -> dict[str, Any]:
    """The proxy's own OpenAI error body (docs/behaviour.md#validation, #errors)."""
    body = orjson.loads(raw)
    assert set(body) == {"error"}
    error = body["error"]
    assert isinstance(error["message"], str)
    assert error["message"]
    assert (error["type"], error["param"], error["code"]) == ("server_error", None, None)
    return dict(error)


def child_error(status: int, message: str) -> dict[str, Any]:
    """The devserver's own error body for ``status``, as a native backend sends it."""
    kinds = {400: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}
    code = None if status == 400 else status
    return {"error": {"message": message, "type": kinds[status], "param": None, "code": code}}


# --- failures before the stream: a status and an error body, never a 200 ---------------------


@dataclass(frozen=True)
class Before:
    fault: str | None  # None: the upstream refuses connections
    status: int
    relayed: str | None  # the failing child's own error message, relayed; None: the proxy's error
    outcome: str | None  # where the backend files the faulty request; None: it never got it
    timeouts: Timeouts = RELAXED


FIRST_BYTE_SHORT = RELAXED.model_copy(update={"first_byte": SHORT_WAIT})

BEFORE_BOTH = [
    Before("status_400", 400, "Injected fault status_400", "faulted"),
    Before("status_429", 429, "Injected fault status_429", "faulted"),
    Before("status_500", 500, "Injected fault status_500", "faulted"),
    Before("reset_before_headers", 502, None, "faulted"),
    Before("no_headers", 504, None, "aborted", FIRST_BYTE_SHORT),
    Before(None, 502, None, None),
]
# Without a stream these faults strike before the headers too.
BEFORE_JSON = [
    Before("reset_mid_stream", 502, None, "faulted"),
    Before("idle_forever", 504, None, "aborted", FIRST_BYTE_SHORT),
    Before("error_event", 500, "Injected error event", "faulted"),
]
BEFORE_CASES = [
    pytest.param(
        case, n, stream, id=f"{case.fault or 'refused'}-n{n}-{'sse' if stream else 'json'}"
    )
    for case in BEFORE_BOTH
    for n in (1, K)
    for stream in (False, True)
] + [
    pytest.param(case, n, False, id=f"{case.fault}-n{n}-json")
    for case in BEFORE_JSON
    for n in (1, K)
]


@pytest.mark.parametrize(("case", "n", "stream"), BEFORE_CASES)
async def test_failure_before_the_stream_answers_a_status_and_an_error_body(
    make_rig: MakeRig, refused_url: str, case: Before, n: int, stream: bool
) -> None:
    rig = await make_rig(
        timeouts=case.timeouts,
        upstream_url=None if case.fault else refused_url,
        token_delay=DELAY,
        # stream_start: all, so that a sibling's 200 arriving first cannot commit the stream (the
        # default start, at the first answer, is tested in test_stream_start.py;
        # docs/behaviour.md#stream-start).
        stream_start="all" if stream and n > 1 else "first",
    )
    # Siblings that finish fast could not show that they were aborted; slow ones would trip a
    # short first-byte timeout themselves before their JSON headers.
    siblings_long = stream or case.timeouts.first_byte > SHORT_WAIT
    body = chat_body(n, stream, case.fault, LONG if siblings_long else SHORT)
    status, raw, headers = await rig.post(rig.proxy_url + CHAT, body)

    assert status == case.status, raw
    assert headers["Content-Type"].startswith("application/json")
    if case.relayed is None:
        proxy_error(raw)
    else:
        assert orjson.loads(raw) == child_error(case.status, case.relayed)
    rids = child_rids(n)
    faulty = rids[FAULTY if n > 1 else 0]
    if case.outcome is not None:
        ended = {"faulted": rig.state.faulted, "aborted": rig.state.aborted}[case.outcome]
        await rig.state.wait_for(lambda s: faulty in ended and not s.active, timeout=ANSWER_WITHIN)
    await rig.assert_no_leaks(requests=1)
    # Settled now: every request the backend ever got has ended.
    if case.outcome is None:
        assert rig.state.seen == []
    if n > 1 and case.outcome is not None and siblings_long:
        assert rig.log.lines[0]["children_aborted"] == K - 1
        assert not set(rig.state.finished) & set(rids)
        seen = {rid for rid, _, _ in rig.state.seen}
        assert seen - {faulty} <= set(rig.state.aborted)


async def test_fanout_child_answering_non_json_is_502(make_rig: MakeRig) -> None:
    rig = await make_rig(token_delay=DELAY)
    status, raw, _ = await rig.post(rig.proxy_url + CHAT, chat_body(K, False, "bad_json", LONG))
    assert status == 502
    assert "not a JSON object" in proxy_error(raw)["message"]
    await rig.state.wait_for(lambda s: not s.active and "1_t" in s.finished, timeout=ANSWER_WITHIN)
    assert {"0_t", "2_t"} <= set(rig.state.aborted)
    await rig.assert_no_leaks(requests=1)


# --- failures after the 200: one error event, no usage, one [DONE] ----------------------------


IDLE_SHORT = RELAXED.model_copy(update={"idle": SHORT_WAIT})

AFTER_CASES = [
    pytest.param("reset_mid_stream", 2, "faulted", RELAXED, id="reset_mid_stream"),
    pytest.param("error_event", 2, "faulted", RELAXED, id="error_event"),
    pytest.param("bad_json", 2, "aborted", RELAXED, id="bad_json"),
    pytest.param("idle_forever", 2, "aborted", IDLE_SHORT, id="idle_forever"),
    # Idle straight after the opening chunk: only the idle timeout may end it, never first_byte.
    pytest.param("idle_forever", 0, "aborted", IDLE_SHORT, id="idle_forever-after-headers"),
]


@pytest.mark.parametrize(("fault", "after_tokens", "outcome", "timeouts"), AFTER_CASES)
async def test_fanout_failure_after_the_200_sends_one_error_event_then_done(
    make_rig: MakeRig, fault: str, after_tokens: int, outcome: str, timeouts: Timeouts
) -> None:
    rig = await make_rig(timeouts=timeouts, token_delay=DELAY)
    body = chat_body(K, True, fault, LONG, after_tokens)
    status, raw, headers = await rig.post(rig.proxy_url + CHAT, body)

    assert status == 200
    assert headers["Content-Type"] == "text/event-stream"
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    errors = [p for p in payloads[:-1] if "error" in p]
    assert len(errors) == 1
    assert payloads[-2] is errors[0]
    assert errors[0]["error"]["type"] == "server_error"
    assert errors[0]["error"]["message"].startswith(f"choice {FAULTY} failed")
    chunks = payloads[:-2]
    assert all(c["choices"] for c in chunks)  # no usage chunk after an error
    texts = {i: "" for i in range(K)}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        assert choice["finish_reason"] is None
        texts[choice["index"]] += choice["delta"].get("content", "")
    for i, text in texts.items():
        assert expected_text(SEED + i, LONG).startswith(text)

    rids = child_rids(K)
    ended = {"faulted": rig.state.faulted, "aborted": rig.state.aborted}[outcome]
    siblings = set(rids) - {rids[FAULTY]}
    await rig.state.wait_for(
        lambda s: rids[FAULTY] in ended and siblings <= set(s.aborted), timeout=ANSWER_WITHIN
    )
    await rig.log.wait_for(1)
    assert rig.log.lines[0]["children_aborted"] >= K - 1
    await rig.assert_no_leaks(requests=1)


# --- n=1: the client sees what the upstream sent, however broken ------------------------------


@pytest.mark.parametrize("fault", ["error_event", "bad_json"])
async def test_single_choice_stream_with_a_broken_event_passes_through_byte_for_byte(
    make_rig: MakeRig, fault: str
) -> None:
    rig = await make_rig(token_delay=DELAY)
    body = chat_body(1, True, fault, SHORT)
    direct = await rig.post(rig.backend.url + CHAT, body)
    proxied = await rig.post(rig.proxy_url + CHAT, body)
    assert proxied[0] == direct[0] == 200
    assert without_created(proxied[1]) == without_created(direct[1])
    outcome = rig.state.faulted if fault == "error_event" else rig.state.finished
    await rig.state.wait_for(lambda s: outcome.count("t") == 2)
    await rig.assert_no_leaks(requests=1)


async def test_single_choice_json_that_is_not_json_passes_through_byte_for_byte(
    make_rig: MakeRig,
) -> None:
    rig = await make_rig(token_delay=DELAY)
    body = chat_body(1, False, "bad_json", SHORT)
    status, raw, _ = await rig.post(rig.proxy_url + CHAT, body)
    assert (status, raw) == (200, b"not json")
    await rig.assert_no_leaks(requests=1)


@pytest.mark.parametrize(
    ("fault", "after_tokens", "timeouts", "outcome"),
    [
        pytest.param("reset_mid_stream", 2, RELAXED, "faulted", id="reset_mid_stream"),
        pytest.param("idle_forever", 2, IDLE_SHORT, "aborted", id="idle_forever"),
        pytest.param("idle_forever", 0, IDLE_SHORT, "aborted", id="idle_forever-after-headers"),
    ],
)
async def test_single_choice_stream_broken_upstream_cuts_the_client_after_its_bytes(
    make_rig: MakeRig, fault: str, after_tokens: int, timeouts: Timeouts, outcome: str
) -> None:
    rig = await make_rig(timeouts=timeouts, token_delay=DELAY)
    body = chat_body(1, True, fault, LONG, after_tokens)
    status, got, cut = await post_until_cut(rig, rig.proxy_url + CHAT, body)
    assert status == 200
    assert cut  # a truncated body, as the upstream's was: never a clean end
    payloads = sse_payloads(got)
    assert "[DONE]" not in payloads
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads)
    assert text == expected_text(SEED, after_tokens)  # every token before the fault, none lost
    ended = {"faulted": rig.state.faulted, "aborted": rig.state.aborted}[outcome]
    await rig.state.wait_for(lambda s: "t" in ended and not s.active, timeout=ANSWER_WITHIN)
    await rig.assert_no_leaks(requests=1)


# --- faults that are not failures: framing, compression, huge lines, aborted choices ----------


BENIGN = ["huge_line", "crlf", "cr", "ping", "gzip", "abort"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fault", BENIGN)
async def test_fanout_with_benign_fault_is_stitched_like_a_clean_answer(
    make_rig: MakeRig, fault: str, stream: bool
) -> None:
    rig = await make_rig(token_delay=DELAY)
    body = chat_body(K, stream, fault, SHORT)
    expected = []
    for i in range(K):
        child = {**body, "seed": SEED + i, "stream": False}
        del child["n"]
        status, raw, _ = await rig.post(rig.backend.url + CHAT, child)
        assert status == 200
        (choice,) = orjson.loads(raw)["choices"]
        expected.append((choice["message"]["content"], choice["finish_reason"]))
    status, raw, headers = await rig.post(rig.proxy_url + CHAT, body)

    assert status == 200, raw
    assert headers["X-Request-Id"] == "t"
    if stream:
        payloads = sse_payloads(raw)
        assert payloads[-1] == "[DONE]"
        assert payloads.count("[DONE]") == 1
        *chunks, usage_chunk = payloads[:-1]
        assert {(c["id"], c["created"], c["model"]) for c in payloads[:-1]} == {
            ("chatcmpl-t", usage_chunk["created"], "m")
        }
        usage = usage_chunk["usage"]
        assert usage_chunk["choices"] == []
        got: list[tuple[str, str | None]] = [("", None)] * K
        for chunk in chunks:
            (choice,) = chunk["choices"]
            text, reason = got[choice["index"]]
            assert reason is None  # nothing after a choice's finish chunk
            got[choice["index"]] = (
                text + choice["delta"].get("content", ""),
                choice["finish_reason"],
            )
    else:
        merged = orjson.loads(raw)
        assert merged["id"] == "chatcmpl-t"
        assert [c["index"] for c in merged["choices"]] == list(range(K))
        got = [(c["message"]["content"], c["finish_reason"]) for c in merged["choices"]]
        usage = merged["usage"]
    assert got == expected
    tokens = 2 if fault == "abort" else SHORT
    assert usage["completion_tokens"] == (K - 1) * SHORT + tokens
    if fault == "abort":
        assert got[FAULTY][1] == "abort"
    if fault == "huge_line":
        assert len(got[FAULTY][0]) > 1 << 20
    await rig.state.wait_for(lambda s: set(child_rids(K)) <= set(s.finished))
    await rig.assert_no_leaks(requests=1)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("fault", BENIGN)
async def test_single_choice_with_benign_fault_passes_through_byte_for_byte(
    make_rig: MakeRig, fault: str, stream: bool
) -> None:
    rig = await make_rig(token_delay=DELAY)
    body = chat_body(1, stream, fault, SHORT)
    direct = await rig.post(rig.backend.url + CHAT, body)
    proxied = await rig.post(rig.proxy_url + CHAT, body)
    assert proxied[0] == direct[0] == 200
    assert without_created(proxied[1]) == without_created(direct[1])
    assert proxied[2].get("Content-Encoding") == direct[2].get("Content-Encoding")
    await rig.state.wait_for(lambda s: s.finished.count("t") == 2)
    await rig.assert_no_leaks(requests=1)


# --- the client leaves ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("n", [1, K])
async def test_client_leaving_aborts_every_child_and_leaks_nothing(
    make_rig: MakeRig, n: int, stream: bool
) -> None:
    rig = await make_rig(token_delay=DELAY)
    body = chat_body(n, stream, None, LONG)
    rids = child_rids(n)
    request = asyncio.ensure_future(rig.post(rig.proxy_url + CHAT, body))
    await rig.state.wait_for(lambda s: set(rids) <= set(s.active))
    request.cancel()
    await rig.state.wait_for(lambda s: set(rids) <= set(s.aborted), timeout=ANSWER_WITHIN)
    assert not rig.state.finished
    await rig.assert_no_leaks(requests=1)
    await rig.log.wait_for(1)
    assert rig.log.lines[0]["status"] == 499
