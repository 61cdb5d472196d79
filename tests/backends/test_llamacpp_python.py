"""Opt-in: llama-cpp-python's server silently ignores n; behind n-proxy it answers every choice.

Needs ``pip install 'llama-cpp-python[server]'`` (it compiles llama.cpp: about 8 minutes on 2
cores), then ``pytest -m llamacpp_python tests/backends/test_llamacpp_python.py``; skipped without
it.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from proxy.config.models import Config, single_upstream_config
from tests.support.llamacpp import CHAT, COMPLETIONS, PROMPT, request_body
from tests.support.servers import Proxy, with_upstream

pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.llamacpp_python

SEED = 100
N = 3
MAX_TOKENS = 8
STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
TIMEOUT = aiohttp.ClientTimeout(total=30)
# uvicorn reports the port the kernel picked for --port 0.
LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@dataclass(frozen=True)
class _Listening:
    """Set by the reader thread once the server listens (``port`` then holds its one port) or
    once its output ends without that (``port`` stays empty)."""

    event: threading.Event
    port: list[int]


def _read_output(stream: IO[str], log: IO[str], listening: _Listening) -> None:
    """Copies the server's output to its log (so the pipe never fills) and spots readiness."""
    for line in stream:
        log.write(line)
        log.flush()
        match = LISTENING.search(line)
        if match and not listening.event.is_set():
            listening.port.append(int(match.group(1)))
            listening.event.set()
    listening.event.set()  # end of output: unblock the waiter, which then finds no port


@pytest.fixture(scope="module")
def python_server_url(llama_model: Path) -> Iterator[str]:
    """``python -m llama_cpp.server`` on 127.0.0.1; ``--interrupt_requests false`` keeps one
    request from cutting off another, which concurrent fan-out children would otherwise do."""
    log_path = llama_model.parent / "llama-cpp-python.log"
    command = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(llama_model),
        "--host", "127.0.0.1", "--port", "0", "--interrupt_requests", "false",
        "--n_ctx", "512", "--n_threads", "1", "--verbose", "false",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    listening = _Listening(threading.Event(), [])
    with log_path.open("w") as log:
        reader = threading.Thread(target=_read_output, args=(proc.stdout, log, listening))
        reader.start()
        try:
            if not listening.event.wait(STARTUP_TIMEOUT_S) or not listening.port:
                tail = "\n".join(log_path.read_text().splitlines()[-20:])
                raise RuntimeError(f"llama_cpp.server did not start; log tail:\n{tail}")
            yield f"http://127.0.0.1:{listening.port[0]}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
            reader.join(timeout=STOP_TIMEOUT_S)
            proc.stdout.close()


@pytest.fixture
async def proxy_url(
    make_proxy: Callable[[Config], Awaitable[Proxy]], python_server_url: str
) -> str:
    # llama-cpp-python answers an X-Request-Id that is not a UUID with a bare 400.
    config = with_upstream(single_upstream_config(python_server_url), child_request_id="uuid")
    return (await make_proxy(config)).url


_body = functools.partial(request_body, model="tiny", max_tokens=MAX_TOKENS)


async def _post_ok(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url, json=body, timeout=TIMEOUT) as resp:
        raw = await resp.text()
        assert resp.status == 200, f"HTTP {resp.status}: {raw!r}"
    answer: dict[str, Any] = json.loads(raw)
    return answer


def _texts(path: str, answer: dict[str, Any]) -> list[str]:
    return [c["message"]["content"] if path == CHAT else c["text"] for c in answer["choices"]]


async def _direct_texts(
    http: aiohttp.ClientSession, server_url: str, path: str
) -> tuple[list[str], list[int]]:
    """The server's own n=1 answers for seed + i, and their completion token counts."""
    texts, tokens = [], []
    for seed in range(SEED, SEED + N):
        answer = await _post_ok(http, server_url + path, _body(path, seed=seed))
        texts += _texts(path, answer)
        tokens.append(answer["usage"]["completion_tokens"])
    return texts, tokens


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_server_alone_silently_answers_one_choice_for_n3(
    http: aiohttp.ClientSession, python_server_url: str, path: str
) -> None:
    direct, _ = await _direct_texts(http, python_server_url, path)
    answer = await _post_ok(http, python_server_url + path, _body(path, n=N, seed=SEED))
    assert [c["index"] for c in answer["choices"]] == [0]
    assert _texts(path, answer) == direct[:1]


async def test_server_alone_rejects_a_request_id_that_is_not_a_uuid_with_an_empty_400(
    http: aiohttp.ClientSession, python_server_url: str
) -> None:
    # starlette-context's RequestIdPlugin validates X-Request-Id as a UUID; n-proxy's child ids
    # have the form "{i}_{parent}" (docs/behaviour.md#children), which this backend turns away.
    url = python_server_url + COMPLETIONS
    body = _body(COMPLETIONS, seed=SEED)
    uuid_hex = "0123456789abcdef" * 2
    for child_id in ("0_abc", f"0_{uuid_hex}"):
        headers = {"X-Request-Id": child_id}
        async with http.post(url, json=body, headers=headers, timeout=TIMEOUT) as resp:
            assert (resp.status, await resp.read()) == (400, b"")
    headers = {"X-Request-Id": uuid_hex}
    async with http.post(url, json=body, headers=headers, timeout=TIMEOUT) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_through_the_proxy_n3_gives_the_servers_answers_for_seed_plus_i(
    http: aiohttp.ClientSession, python_server_url: str, proxy_url: str, path: str
) -> None:
    direct, tokens = await _direct_texts(http, python_server_url, path)
    assert len(set(direct)) == N
    answer = await _post_ok(http, proxy_url + path, _body(path, n=N, seed=SEED))
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert _texts(path, answer) == direct
    assert answer["usage"]["completion_tokens"] == sum(tokens)


async def test_openai_client_streams_three_choices_through_the_proxy(
    http: aiohttp.ClientSession, python_server_url: str, openai_client: AsyncOpenAI
) -> None:
    direct, _ = await _direct_texts(http, python_server_url, COMPLETIONS)
    stream = await openai_client.completions.create(
        model="tiny", prompt=PROMPT, n=N, seed=SEED, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts = ["", "", ""]
    usages = []
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        if chunk.usage is not None:
            usages.append(chunk.usage.completion_tokens)
    assert texts == direct
    # llama-cpp-python ignores include_usage and streams no usage, so there is none to merge.
    assert usages == []
