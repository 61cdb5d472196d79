"""Reload: how many requests the upstream runs at once while SIGHUPs reload n-proxy under open
streams. ``max_concurrency`` is the bound; the demo backend counts the most it ever generated at
once (``devserver_requests_peak``), from outside the proxy."""

import asyncio
import functools
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson

from bench.procs import Server, free_port
from bench.report import Column, Row, Section, say, target
from bench.scenario import PROXY, Context, Scenario
from bench.stack import start_backend, start_proxy
from bench.workload import (
    CHAT_PATH,
    StreamTiming,
    chat_body,
    client,
    read_stream,
    run_async,
    stream_events,
)

LIMIT = 2  # the upstream's max_concurrency
RELOADS = 3
TOKEN_DELAY = 0.05  # seconds per token: long streams
WAIT = 60.0  # seconds any one wait may take: a bound, not a timing
CONFIG = """\
upstreams:
  - name: demo
    url: {url}
    max_concurrency: {limit}
    max_queue: 1000
admin: {{host: 127.0.0.1, port: {admin}}}
max_n: {max_n}
drain_seconds: 1
"""
SHOWN = ("peak", "whole", "streams")


async def _gauge(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """The value of an unlabelled (or the first labelled) sample ``name`` on a /metrics page."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    if found is None:
        raise RuntimeError(f"no {name} on {url}/metrics")
    return float(found.group(1))


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``check`` every 20 ms until it is true, WAIT at most."""
    deadline = time.monotonic() + WAIT
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not after {WAIT:g} s")
        await asyncio.sleep(0.02)


async def _measure(
    ctx: Context, proxy: Server, backend: Server, admin: str, reload: Callable[[int], None]
) -> Row:
    """``--concurrency`` streams open, then each ``reload`` once the last one took, and one more
    stream once it did."""
    n, tokens, opened = ctx.options.n[0], ctx.options.max_tokens, ctx.options.concurrency[0]
    x_demo = {"token_delay": TOKEN_DELAY}
    body = orjson.dumps(chat_body(n, stream=True, max_tokens=tokens, x_demo=x_demo))
    url = proxy.url + CHAT_PATH
    reloaded_at: list[float] = []
    async with client(3600) as session:
        started = time.perf_counter()
        tasks = [
            asyncio.create_task(read_stream(session, url, body, started)) for _ in range(opened)
        ]

        async def flowing() -> bool:
            running = await _gauge(session, backend.url, "devserver_requests_running")
            return running >= min(n * opened, LIMIT)

        await _until(flowing, "the first streams flowing")
        for count in range(1, RELOADS + 1):
            reload(count)

            async def took(count: int = count) -> bool:
                return await _gauge(session, admin, "n_proxy_config_reloads_total") >= count

            await _until(took, f"reload {count}")
            reloaded_at.append(time.perf_counter() - started)
            tasks.append(asyncio.create_task(read_stream(session, url, body, started)))

            async def begun() -> bool:  # in the generation this reload made current
                in_flight = await _gauge(session, admin, "n_proxy_requests_in_flight")
                return in_flight >= sum(not task.done() for task in tasks)

            await _until(begun, f"the stream after reload {count}")
        timings: list[StreamTiming] = await asyncio.gather(*tasks)
        peak = await _gauge(session, backend.url, "devserver_requests_peak")
    whole = [t.status == 200 and t.events == stream_events(n, tokens) for t in timings]
    first_end = min(t.end_at for t in timings[:opened])
    return {
        "peak": peak, "bound": LIMIT, "reloads": len(reloaded_at), "streams": len(timings),
        "whole": sum(whole), "last_reload_s": reloaded_at[-1], "first_end_s": first_end,
        # Every reload came while the first streams were still open: the case measured.
        "open_across_reloads": reloaded_at[-1] < first_end,
        "first_token_s": [round(t.first_token_at, 3) for t in timings],
        "end_s": [round(t.end_at, 3) for t in timings],
    }  # fmt: skip


def _reload(proxy: Server, path: Path, backend: Server, admin: str, count: int) -> None:
    """The config file (where ``start_proxy`` wrote it) with another ``max_n``, then SIGHUP."""
    path.write_text(_config(backend.url, admin, max_n=10 + count))
    os.kill(proxy.pid, signal.SIGHUP)


def _config(url: str, admin: str, max_n: int) -> str:
    port = admin.rsplit(":", 1)[1]
    return CONFIG.format(url=url, limit=LIMIT, admin=port, max_n=max_n)


def _run(ctx: Context) -> Row:
    """Each round, each tree in turn (the order alternating) on a backend of its own, so the
    backend's peak is that tree's."""
    runs: list[Row] = []
    trees = list(ctx.trees("").items())
    for turn in range(ctx.options.rounds):
        for label, (tree, env) in trees[turn % 2 :] + trees[: turn % 2]:
            backend = start_backend(ctx.fleet, name=f"backend-{label}-{turn}")
            admin = f"http://127.0.0.1:{free_port()}"
            name = f"{label}-{turn}"
            config = _config("{url}", admin, max_n=10)
            proxy = start_proxy(ctx.fleet, ctx.work, backend.url, name, checkout=tree,
                                config=config, env=env)  # fmt: skip
            ctx.ready({backend.name: backend, label: proxy})
            reload = functools.partial(_reload, proxy, ctx.work / f"{name}.yaml", backend, admin)
            row: Row = {"proxy": label, "round": turn}
            row |= run_async(_measure(ctx, proxy, backend, admin, reload))
            say(f"reload {label}, round {turn}", row, *SHOWN)
            runs.append(row)
            ctx.fleet.stop(proxy, backend)
    summary = []
    for label, _ in trees:
        rows = [r for r in runs if r["proxy"] == label]
        summary.append({
            "proxy": label, "rounds": len(rows), "peak": max(r["peak"] for r in rows),
            "peaks": [r["peak"] for r in rows], "bound": LIMIT,
            "whole": sum(r["whole"] for r in rows), "streams": sum(r["streams"] for r in rows),
            "open_across_reloads": all(r["open_across_reloads"] for r in rows),
            "last_end_s": max(max(r["end_s"]) for r in rows),
        })  # fmt: skip
    return {"runs": runs, "summary": summary}


COLUMNS: list[Column] = [
    ("proxy", "proxy", ""), ("rounds", "rounds", "{:d}"),
    ("upstream's peak in flight", "peak", "{:.0f}"), ("each round", "peaks", "{:.0f}"),
    ("max_concurrency", "bound", "{:d}"), ("whole streams", "whole", "{:d}"),
    ("streams", "streams", "{:d}"), ("every reload under open streams", "open_across_reloads", ""),
    ("last stream ended, s", "last_end_s", "{:.1f}"),
]  # fmt: skip

RENDER = Section(
    COLUMNS,
    f"max_concurrency: {LIMIT}. {{options[concurrency][0]}} n={{options[n][0]}} stream(s) of"
    f" {{options[max_tokens]}} tokens at {TOKEN_DELAY * 1e3:g} ms/token open; then {RELOADS}"
    " SIGHUPs, each once the last took (the config file rewritten with another max_n), each"
    " followed by one more such stream once the reload took. Upstream's peak: the most requests"
    " the demo backend ever generated at once (`devserver_requests_peak`), a backend per proxy"
    " and round.",
    "A proxy that builds a new admission line on each reload lets each generation's streams"
    " take max_concurrency slots of their own: up to (reloads + 1) x max_concurrency at once."
    " With one line per upstream the streams sent after the reloads wait for a slot, so they"
    " end later.",
)


def _targets(data: Row) -> list[Row]:
    rows = {r["proxy"]: r for r in data["summary"]}
    peak = rows.get(PROXY, {}).get("peak")
    what = f"upstream's peak in flight through {RELOADS} reloads under open streams"
    return [target(what, peak, "<=", LIMIT, "{:.0f}")]


RELOAD = Scenario(
    "reload", "Upstream concurrency through reloads under open streams", _run, RENDER, _targets,
    full={"rounds": 3, "n": (2,), "max_tokens": 100, "concurrency": (1,)},
    smoke={"n": (2,), "max_tokens": 20},
)  # fmt: skip
