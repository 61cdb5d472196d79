"""How many of the proxy's modules one request runs through, on the production path: a reader
follows one streaming fan-out in at most ``BOUND`` files (it took 30 before the house step)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import pytest

from proxy.config.models import Listen, single_upstream_config
from proxy.http import stream_path_compiled
from proxy.server.process import Server
from tests.support.servers import Backend

PACKAGE = Path(__file__).resolve().parents[2] / "proxy"
BOUND = 15
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "n": 3,
    "stream": True,
    "max_tokens": 8,
}


def module_of(filename: str) -> str | None:
    """The proxy module a code object's file is, or None outside the proxy (the demo backend
    is outside: it only stands in for the upstream)."""
    path = Path(filename)
    if not path.is_relative_to(PACKAGE) or path.is_relative_to(PACKAGE / "devserver"):
        return None
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.skipif(
    stream_path_compiled(),
    reason="compiled modules run without Python frames to count: the pure build's run checks this",
)
async def test_one_streaming_fan_out_runs_through_at_most_half_the_modules(
    backend: Backend,
) -> None:
    config = single_upstream_config(backend.url).model_copy(
        update={"listen": Listen(host="127.0.0.1", port=0)}
    )
    server = Server(config)
    await server.start()
    calls: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and (module := module_of(frame.f_code.co_filename)) is not None:
            calls[module] += 1

    url = f"http://127.0.0.1:{server.proxy_port}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(2):  # warm: connections pooled, labelled metrics looked up
                async with http.post(url, json=BODY) as r:
                    assert r.status == 200
                    await r.read()
            sys.setprofile(profile)
            try:
                async with http.post(url, json=BODY) as r:
                    assert r.status == 200
                    raw = await r.read()
            finally:
                sys.setprofile(None)
    finally:
        await server.close()
    assert raw.count(b"data: [DONE]") == 1
    assert "proxy.request.fanout" in calls  # the profile saw the request
    touched = set(calls)
    listed = "\n".join(f"{calls[m]:6d} {m}" for m in sorted(calls))
    assert len(touched) <= BOUND, f"{len(touched)} modules, past {BOUND}:\n{listed}"
