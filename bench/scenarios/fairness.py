"""Fairness: one client keeps n = 4 fan-out streams in flight while another sends n = 1 requests
one after another, through n-proxy with ``admission: fair`` and ``fifo`` in front of the demo
backend at 20 ms a token and ``max_concurrency: 4``: the second client's median latency over its
unloaded one, and the tokens served per second, paired by round (docs/behaviour.md#admission);
and ``fair`` without its kept slot (``return_grace: 0``), for what that adds."""

import asyncio
import re
import time
import urllib.request

import aiohttp
import orjson

from bench.procs import Server, free_port
from bench.report import Column, Row, Section, pick, say, target
from bench.scenario import Context, Scenario
from bench.stack import start_backend, start_proxy
from bench.stats import grouped, median, medians, paired, percentile, quartiles
from bench.workload import CHAT_PATH, TOKEN_EVENT, chat_body, client, run_async, whole_events

TOKEN_DELAY = 0.02  # seconds a token: the demo backend as the issue measured it
CAPACITY = 4
FLOOD_PARENTS = 6  # the flooding client keeps this many fan-outs in flight
VICTIM_TOKENS = 4  # the other client's requests: about 0.1 s unloaded
FLOOD_WARM_UP = 2.0  # seconds of flood before the victim is timed: its queue is built by then
UNLOADED_SECONDS = 3.0
# fair: the turns, and a returning client's slot kept for it (``return_grace``, its default);
# fair-no-grace: the turns alone, for what the kept slot adds.
ADMISSIONS = ("fifo", "fair", "fair-no-grace")
# Each client has its own key: the proxy tells them apart by it (clients.identify's default).
FLOOD = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench-flood"}
VICTIM = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench-victim"}

CONFIG = """\
admin: {{host: 127.0.0.1, port: {admin}}}
upstreams:
  - name: demo
    url: {{url}}
    max_concurrency: {capacity}
    admission: {admission}{grace}
drain_seconds: 1
"""
_SERVED = re.compile(
    rb'^n_proxy_upstream_responses_total\{[^}]*upstream="demo"[^}]*\} (\S+)$', re.M
)


def _served(admin: int) -> float:
    """Upstream requests the proxy has seen to their end so far (its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as answer:
        return sum(float(v) for v in _SERVED.findall(answer.read()))


class Window:
    """When the victim is timed, and the tokens every client received meanwhile."""

    def __init__(self) -> None:
        self.start = self.end = float("inf")
        self.tokens = 0

    def count(self, tokens: int, at: float | None = None) -> None:
        if self.start <= (time.perf_counter() if at is None else at) <= self.end:
            self.tokens += tokens


async def _victim(
    session: aiohttp.ClientSession, url: str, body: bytes, seconds: float, window: Window
) -> Row:
    """n = 1 requests one after another for ``seconds``: their latencies in ms."""
    latencies, errors = [], 0
    deadline = time.perf_counter() + seconds
    for _ in range(100_000):  # bounded: at least 0.08 s each
        if time.perf_counter() >= deadline:
            break
        began = time.perf_counter()
        async with session.post(url, data=body, headers=VICTIM) as response:
            await response.read()
        if response.status == 200:
            latencies.append((time.perf_counter() - began) * 1e3)
            window.count(VICTIM_TOKENS)
        else:
            errors += 1
    latencies.sort()
    q1, p50, q3 = quartiles(latencies)
    return {"victim_requests": len(latencies), "victim_errors": errors, "victim_p50_ms": p50,
            "victim_q1_ms": q1, "victim_q3_ms": q3,
            "victim_p90_ms": percentile(latencies, 90)}  # fmt: skip


def lengths(flood: str) -> list[int]:
    """A flood's choice lengths: ``"20"``, each 20 tokens; ``"16-24"``, 16, 18, ... 24 in turn;
    ``"none"``: no flood."""
    if flood == "none":
        return []
    low, _, high = flood.partition("-")
    return list(range(int(low), int(high or low) + 1, 2))


async def _flood(
    session: aiohttp.ClientSession, url: str, bodies: list[bytes], errors: list[int],
    window: Window, turn: int,
) -> None:  # fmt: skip
    """One fan-out stream after another, the next of ``bodies`` each time from ``turn`` on, its
    tokens counted as they arrive, until cancelled (its client then leaves mid-request)."""
    for sent in range(1_000_000):  # bounded: each takes the tokens' time at least
        body = bodies[(turn + sent) % len(bodies)]
        async with session.post(url, data=body, headers=FLOOD) as response:
            rest = b""
            async for data in response.content.iter_any():
                block, rest = whole_events(rest + data)
                window.count(len(TOKEN_EVENT.findall(block)))
        if response.status != 200:
            errors.append(response.status)
            await asyncio.sleep(0.1)


async def _measure(ctx: Context, proxy: Server, admin: int, flood: str) -> Row:
    """The victim alone (``flood`` "none"), or beside a flood of choices that long."""
    o = ctx.options
    url = proxy.url + CHAT_PATH
    victim = orjson.dumps(chat_body(max_tokens=VICTIM_TOKENS))
    bodies = [orjson.dumps(chat_body(o.n[0], stream=True, max_tokens=tokens))
              for tokens in lengths(flood)]  # fmt: skip
    window = Window()
    async with client(600) as session:
        if not bodies:
            seconds = UNLOADED_SECONDS if o.warm_up else 1.0
            return await _victim(session, url, victim, seconds, window)
        errors: list[int] = []
        floods = [asyncio.create_task(_flood(session, url, bodies, errors, window, turn))
                  for turn in range(FLOOD_PARENTS)]  # fmt: skip
        try:
            await asyncio.sleep(FLOOD_WARM_UP if o.warm_up else 0.5)
            before, window.start = _served(admin), time.perf_counter()
            row = await _victim(session, url, victim, o.seconds, window)
            served, window.end = _served(admin) - before, time.perf_counter()
        finally:
            for task in floods:
                task.cancel()
            await asyncio.gather(*floods, return_exceptions=True)
    took = window.end - window.start
    return row | {"tokens_per_s": window.tokens / took, "children_per_s": served / took,
                  "flood_errors": len(errors)}  # fmt: skip


def _run(ctx: Context) -> Row:
    backend = start_backend(ctx.fleet, token_delay=TOKEN_DELAY)
    proxies: dict[str, tuple[Server, int]] = {}
    for admission in ADMISSIONS:
        admin = free_port()
        config = CONFIG.format(
            admin=admin,
            capacity=CAPACITY,
            admission=admission.removesuffix("-no-grace"),
            # fair keeps the default grace, so the figure is the one operators get
            grace="\n    return_grace: 0" if admission.endswith("-no-grace") else "",
        )
        proxies[admission] = (start_proxy(ctx.fleet, ctx.work, backend.url, admission,
                                          config=config), admin)  # fmt: skip
    ctx.ready({"backend": backend, **{name: proxy for name, (proxy, _) in proxies.items()}})

    def one(admission: str, case: Row) -> Row:
        proxy, admin = proxies[admission]
        flood = case["flood"]
        row = run_async(_measure(ctx, proxy, admin, flood))
        beside = f"beside {flood}-token choices" if flood != "none" else "alone"
        say(f"{admission}, {beside}, round {case['round']}", row, "victim_p50_ms",
            "tokens_per_s", "children_per_s")  # fmt: skip
        return row

    # The flood's choices --max-tokens long (the case: five times the victim's), each as
    # long, then as long on average but from a fifth shorter to a fifth longer (real answers
    # differ; equal ones end in step), then as long as the victim's; "none": the victim alone.
    tokens, spread = ctx.options.max_tokens, ctx.options.max_tokens // 5
    floods = ("none", f"{tokens}", f"{tokens - spread}-{tokens + spread}", f"{VICTIM_TOKENS}")
    cases = [{"flood": flood} for flood in dict.fromkeys(floods)]
    rows = ctx.rounds(ADMISSIONS, cases, one, label="admission")
    return {"runs": rows, "summary": summarize(rows)}


def summarize(rows: list[Row]) -> list[Row]:
    """Per flood and admission: the victim's median latency under the flood, and over its
    unloaded median through the same proxy in the same round; the tokens and children served
    per second, and the tokens' ratio over fifo's under the same flood in the same round."""
    alone = {(r["admission"], r["round"]): r["victim_p50_ms"] for r in rows
             if r["flood"] == "none"}  # fmt: skip
    summary = []
    for (flood, admission), under in grouped(rows, "flood", "admission"):
        if flood == "none":
            continue
        ratios = [r["victim_p50_ms"] / alone[admission, r["round"]] for r in under
                  if alone.get((admission, r["round"]))]  # fmt: skip
        same = [r for r in rows if r["flood"] == flood]
        over_fifo = paired(same, "admission", admission, "fifo", "tokens_per_s")
        summary.append({
            "flood": flood, "admission": admission,
            "unloaded_p50_ms": median(v for (a, _), v in alone.items() if a == admission),
            **medians(under, "victim_p50_ms", "victim_q1_ms", "victim_q3_ms", "victim_p90_ms",
                      "tokens_per_s", "children_per_s"),
            "victim_requests": sum(r["victim_requests"] for r in under),
            "slowdown": median(ratios),
            "slowdown_range": [min(ratios), max(ratios)] if ratios else None,
            "over_fifo": median(over_fifo),
            "over_fifo_range": [min(over_fifo), max(over_fifo)] if over_fifo else None,
            "errors": sum(r["victim_errors"] + r["flood_errors"] for r in under),
        })  # fmt: skip
    return summary


COLUMNS: list[Column] = [
    ("flood's tokens a choice", "flood", ""), ("admission", "admission", ""),
    ("victim p50 ms, alone", "unloaded_p50_ms", "{:.0f}"),
    ("victim p50 ms, beside the flood", "victim_p50_ms", "{:.0f}"),
    ("quartiles ms", "victim_q1_ms", "{:.0f}"), ("", "victim_q3_ms", "{:.0f}"),
    ("p90 ms", "victim_p90_ms", "{:.0f}"),
    ("slowdown (paired)", "slowdown", "{:.2f}x"), ("range", "slowdown_range", "{:.2f}"),
    ("victim requests", "victim_requests", ""),
    ("tokens/s", "tokens_per_s", "{:.1f}"),
    ("over fifo (paired)", "over_fifo", "{:.3f}"), ("range", "over_fifo_range", "{:.3f}"),
    ("children/s", "children_per_s", "{:.2f}"), ("errors", "errors", ""),
]  # fmt: skip

RENDER = Section(
    COLUMNS,
    f"The demo backend at {TOKEN_DELAY * 1e3:.0f} ms a token behind n-proxy with max_concurrency"
    f" {CAPACITY}. One client (its own API key) keeps {FLOOD_PARENTS} streams of"
    " n = {options[n][0]} in flight, their choices {options[max_tokens]} tokens long, then"
    " from a fifth shorter to a fifth longer, then"
    f" {VICTIM_TOKENS}; the other sends n = 1 requests of {VICTIM_TOKENS} tokens one after"
    f" another, for {{options[seconds]:g}} s after {FLOOD_WARM_UP:g} s of flood, and alone for"
    f" {UNLOADED_SECONDS:g} s. Rounds: {{options[rounds]}}, the admissions in a rotated order.",
    "Slowdown: the victim's median latency beside the flood over its median alone, through the"
    " same proxy in the same round. Tokens/s: the tokens both clients received while the victim"
    " was timed (the flood's as they streamed in, the victim's with each answer), the work the"
    " backend's slots did; over fifo: against fifo's under the same flood in the same round."
    " Children/s: upstream requests the proxy saw to their end meanwhile (its /metrics), which"
    " rises with the share of the victim's short requests.",
)


def _targets(data: Row) -> list[Row]:
    out = []
    for tokens in dict.fromkeys(r["flood"] for r in data["summary"]):
        fair = pick(data["summary"], flood=tokens, admission="fair")
        flood = f"a flood of {tokens}-token choices"
        out += [
            target(f"fair: victim's median beside {flood}, over alone", fair.get("slowdown"),
                   "<=", 2.0, "{:.2f}x"),
            target(f"fair: tokens/s beside {flood}, over fifo's", fair.get("over_fifo"), ">=",
                   0.95, "{:.3f}"),
        ]  # fmt: skip
    return out


FAIRNESS = Scenario(
    "fairness", "Fair admission beside a flood of fan-outs", _run, RENDER, _targets,
    full={"rounds": 3, "seconds": 12.0, "n": (4,), "max_tokens": 20},
    smoke={"seconds": 1.0, "max_tokens": 8},
)  # fmt: skip
