"""llama.cpp's own server (the suite's tiny GGUF, via xllamacpp) behind n-proxy: first token and
whole stream at -np 1 and -np 4, with ``stream_start: first`` and ``all``.

Its target is a timing the suite cannot hold a loaded machine to: with one slot the children run
one after another, and a stream that starts with the first child (``stream_start: first``)
shows its first chunk within the first of them."""

import aiohttp

from bench.backends.llamacpp import start_llama_server
from bench.backends.tinymodel import build_tiny_gguf
from bench.report import Row, say, table, target
from bench.scenario import Context, Scenario
from bench.stats import median
from bench.workload import Request, StreamTiming, chat_request, client, read_stream, run_async

ATTEMPTS = 3
REQUEST_SECONDS = 300
CONFIG = """\
stream_start: {start}
upstreams:
  - name: llama
    url: {{url}}
    max_concurrency: 100000
    max_queue: 0
    retry_on: [{retry_on}]
"""


async def _stream(
    session: aiohttp.ClientSession, url: str, request: Request, failed: list[str]
) -> StreamTiming:
    """One stream, timed; a request that failed is noted and sent again."""
    for _ in range(ATTEMPTS):
        timing = await read_stream(session, url + request.path, request.body)
        if timing.status == 200:
            return timing
        failed.append(f"status {timing.status}")
    raise RuntimeError(f"{ATTEMPTS} failures in a row: {failed[-ATTEMPTS:]}")


async def _measure(ctx: Context) -> Row:
    o, rows, failed = ctx.options, [], list[str]()
    model = build_tiny_gguf(ctx.work / "tiny.gguf", eos_reachable=True)
    for slots in (1, 4):
        n_ctx = max(512, slots * (o.max_tokens + 64))
        async with start_llama_server(model, n_parallel=slots, n_ctx=n_ctx) as server:
            cases = [("direct", "", server.base_url, 1)]
            for start in ("first", "all"):
                config = CONFIG.format(start=start, retry_on=", ".join(o.retry_on))
                up = ctx.ready(ctx.proxies(server.base_url, f"-np{slots}-{start}", config))
                cases += [(label, start, proxy.url, o.n[0]) for label, proxy in up.items()]
            # A new connection per request: llama-server drops a kept-alive connection after a
            # stream, and the same rule for every path keeps them comparable.
            async with client(REQUEST_SECONDS, force_close=True) as session:
                for path, start, url, n in cases:
                    request = chat_request(
                        n, stream=True, max_tokens=o.max_tokens, seed=1, model="tiny"
                    )
                    await _stream(session, url, request, failed)  # warm-up
                    timings = [await _stream(session, url, request, failed) for _ in range(o.reps)]
                    rows.append({"np": slots, "path": path, "stream_start": start, "n": n,
                                 "first_token_ms": median(t.first_token_at * 1e3 for t in timings),
                                 "total_ms": median(t.end_at * 1e3 for t in timings),
                                 "first_token_share": median(t.first_token_at / t.end_at
                                                             for t in timings)})  # fmt: skip
                    say(f"llamacpp -np {slots} {path} {start}", rows[-1], "first_token_ms",
                        "total_ms")  # fmt: skip
            ctx.fleet.stop(*ctx.fleet.servers)
    return {"failed": failed, "summary": rows}


def _render(data: Row) -> list[str]:
    return [
        f"`stream: true`, `max_tokens: {data['options']['max_tokens']}`, `ignore_eos`, medians of"
        f" {data['options']['reps']}. Requests sent again after a failure: {len(data['failed'])}"
        + (f" ({', '.join(sorted(set(data['failed'])))})" if data["failed"] else "") + ".",
        *table([("`-np`", "np", ""), ("path", "path", ""), ("n", "n", ""),
                ("stream_start", "stream_start", ""),
                ("first token ms", "first_token_ms", "{:.0f}"),
                ("whole stream ms", "total_ms", "{:.0f}"),
                ("first token at", "first_token_share", "{:.0%}")], data["summary"]),
    ]  # fmt: skip


def _targets(data: Row) -> list[Row]:
    """One slot, ``n`` children one after another: the first token within the first child's part
    of the stream (a share of the whole under ``1 / n``)."""
    rows = [r for r in data["summary"] if r["np"] == 1 and r["stream_start"] == "first"]
    share = rows[0]["first_token_share"] if rows else None
    n = data["options"]["n"][0]
    return [target(f"-np 1, n = {n}: first token's share of the stream", share, "<=", 1 / n,
                   "{:.0%}")]  # fmt: skip


LLAMACPP = Scenario(
    "llamacpp", "llama.cpp's server behind n-proxy", lambda ctx: run_async(_measure(ctx)), _render,
    _targets, full={"n": (4,), "max_tokens": 400, "reps": 20}, smoke={"max_tokens": 16, "reps": 2},
)  # fmt: skip
