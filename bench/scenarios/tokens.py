"""Tokens: what n-proxy's counters count against what its answers' usage says, over a mix of
requests (fanned-out chat and completions, JSON and streams; passed-through JSON and streams,
with and without usage asked for), read back from its own ``/metrics``.

The counters must equal the sum of the usage the clients were sent (a fan-out's merged usage,
a passed-through answer's own), kind by kind: prompt, completion, cached and reasoning tokens.
"""

from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.procs import Server, free_port
from bench.report import Column, Row, Section, say, target
from bench.scenario import PROXY, Context, Scenario
from bench.stack import start_backend, start_proxy
from bench.workload import CHAT_PATH, chat_body, client, run_async

KINDS = ("prompt", "completion", "cached", "reasoning")
COMPLETIONS_PATH = "/v1/completions"
CONFIG = """\
admin: {{host: 127.0.0.1, port: {admin}}}
upstreams:
  - name: demo
    url: {{url}}
    max_concurrency: 100000
    max_queue: 0
drain_seconds: 1
"""


def _answered(usage: dict[str, Any] | None) -> dict[str, int]:
    """The tokens a usage reports, by kind (0 where it reports none)."""
    usage = usage or {}
    prompt = usage.get("prompt_tokens_details") or {}
    completion = usage.get("completion_tokens_details") or {}
    return {"prompt": usage.get("prompt_tokens", 0),
            "completion": usage.get("completion_tokens", 0),
            "cached": prompt.get("cached_tokens", 0),
            "reasoning": completion.get("reasoning_tokens", 0)}  # fmt: skip


def _mix(seed: int) -> list[tuple[str, str, dict[str, Any]]]:
    """One round of requests: (its kind, path, body)."""
    usage = {"stream_options": {"include_usage": True}}
    completions = {"model": "bench-model", "prompt": "count", "max_tokens": 6, "seed": seed}
    return [
        ("fan-out JSON, n = 3", CHAT_PATH, chat_body(3, max_tokens=8, seed=seed)),
        ("fan-out stream, n = 2", CHAT_PATH, chat_body(2, stream=True, max_tokens=8, seed=seed)
         | usage),
        ("fan-out completions, n = 4", COMPLETIONS_PATH, completions | {"n": 4}),
        ("pass-through JSON", CHAT_PATH, chat_body(1, max_tokens=8, seed=seed)),
        ("pass-through stream", CHAT_PATH, chat_body(1, stream=True, max_tokens=8, seed=seed)
         | usage),
        ("pass-through stream, no usage asked", CHAT_PATH,
         chat_body(1, stream=True, max_tokens=8, seed=seed)),
    ]  # fmt: skip


async def _usage_sent(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    """The usage the client was sent: a JSON body's, or a stream's last usage chunk's."""
    async with session.post(url, json=body) as response:
        raw = await response.read()
        if response.status != 200:
            raise RuntimeError(f"answered {response.status}: {raw[:200]!r}")
    if not body.get("stream"):
        return orjson.loads(raw).get("usage")
    found = [orjson.loads(line[6:]).get("usage") for line in raw.split(b"\n")
             if line.startswith(b"data: {")]  # fmt: skip
    return next((u for u in reversed(found) if u), None)


async def _counted(session: aiohttp.ClientSession, admin: str) -> dict[str, float]:
    async with session.get(admin + "/metrics") as response:
        text = await response.text()
    totals = dict.fromkeys(KINDS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for kind in KINDS:
                if sample.name == f"n_proxy_{kind}_tokens_total":
                    totals[kind] += sample.value
    return totals


async def _measure(ctx: Context, proxy: Server, admin: str) -> Row:
    sent: dict[str, dict[str, int]] = {}
    async with client(120) as session:
        before = await _counted(session, admin)
        for rep in range(ctx.options.reps):
            for kind, path, body in _mix(rep):
                tokens = _answered(await _usage_sent(session, proxy.url + path, body))
                mine = sent.setdefault(kind, dict.fromkeys(KINDS, 0))
                for name in KINDS:
                    mine[name] += tokens[name]
        after = await _counted(session, admin)
    rows: list[Row] = [{"requests": kind, **tokens} for kind, tokens in sent.items()]
    answered = {k: sum(r[k] for r in rows) for k in KINDS}
    counted = {k: after[k] - before[k] for k in KINDS}
    rows += [{"requests": "sent to the clients, in all", **answered},
             {"requests": "counted on /metrics", **counted}]  # fmt: skip
    say("tokens", {"answered": answered["completion"], "counted": counted["completion"]},
        "answered", "counted")  # fmt: skip
    return {"summary": rows, "answered": answered, "counted": counted}


def _run(ctx: Context) -> Row:
    """This tree's proxy only: a baseline's counters are not the question here."""
    backend = start_backend(ctx.fleet)
    port = free_port()
    proxy = start_proxy(ctx.fleet, ctx.work, backend.url, config=CONFIG.format(admin=port))
    ctx.ready({"backend": backend, PROXY: proxy})
    return run_async(_measure(ctx, proxy, f"http://127.0.0.1:{port}"))


def _targets(data: Row) -> list[Row]:
    """Every kind counted as the answers' usage says: the difference, in tokens."""
    answered, counted = data["answered"], data["counted"]
    off = max(abs(counted[k] - answered[k]) for k in KINDS) if answered else None
    return [target("tokens counted on /metrics minus the answers' usage (any kind)", off, "<=",
                   0, "{:.0f}")]  # fmt: skip


COLUMNS: list[Column] = [("requests", "requests", ""),
                         *((f"{k} tokens", k, "{:,.0f}") for k in KINDS)]  # fmt: skip
TOKENS = Scenario(
    "tokens", "Tokens counted against the usage the answers carried", _run,
    Section(COLUMNS, "{options[reps]} rounds of each request against the demo backend; the last "
            "two rows are the usage the clients were sent, in all, and what n-proxy's token "
            "counters rose by on its /metrics over the run."),
    _targets, full={"reps": 50}, smoke={"reps": 2},
)  # fmt: skip
