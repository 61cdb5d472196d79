"""Scenario 1: n=1 pass-through, non-streaming, at fixed concurrency, every contender per round.

Direct to the backend is the limit; nginx, n-proxy and LiteLLM's proxy are measured against it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import orjson

from bench.load import Loader, Request, post
from bench.procs import CpuWatch, Server, settle
from bench.stats import Row, median, paired, rotated
from bench.workload import chat_request

DIRECT = "direct"


def check(targets: Mapping[str, Server], requests: Mapping[str, Request]) -> dict[str, int]:
    """Each contender must answer its request correctly before it is timed: as many choices as
    the body's ``n``, with usage. Returns the choices each answer had."""
    choices: dict[str, int] = {}
    for name, server in targets.items():
        request = requests[name]
        n = orjson.loads(request.body).get("n", 1)
        status, raw = post(server.url, request)
        body = orjson.loads(raw) if status == 200 else None
        got = body.get("choices") if isinstance(body, dict) else None
        indexes = [c.get("index") for c in got if isinstance(c, dict)] if got else []
        if indexes != list(range(n)) or not isinstance(body, dict) or "usage" not in body:
            raise RuntimeError(f"{name}: bad answer to the n={n} request ({status}): {raw[:300]!r}")
        choices[name] = len(indexes)
    return choices


def run(
    targets: Mapping[str, Server],
    loader: Loader,
    concurrencies: Sequence[int],
    rounds: int,
    servers: Sequence[Server],
    warm_up: bool = True,
    requests: Mapping[str, Request] | None = None,
    tag: str = "s1",
) -> dict[str, Any]:
    """``requests``: a contender's own request body (default: the n=1 chat request)."""
    chosen = {name: (requests or {}).get(name) or chat_request() for name in targets}
    checked = check(targets, chosen)
    names = list(targets)
    for name in names if warm_up else ():  # connection pools, lazy imports, caches
        loader.run(targets[name].url, chosen[name], max(concurrencies))
    rows: list[Row] = []
    for turn in range(rounds):
        for concurrency in concurrencies:
            for name in rotated(names, turn):
                request = chosen[name]
                rows.append(
                    _measure(targets, name, loader, request, concurrency, servers, turn, tag)
                )
    return {"runs": rows, "summary": summarize(rows, names, concurrencies), "checked": checked}


def _measure(
    targets: Mapping[str, Server],
    name: str,
    loader: Loader,
    request: Request,
    concurrency: int,
    servers: Sequence[Server],
    turn: int,
    tag: str,
) -> Row:
    settle(servers)
    watch = CpuWatch(servers)
    result = loader.run(targets[name].url, request, concurrency)
    cpu = watch.stop()
    own = cpu.by_server.get(targets[name].name, 0.0)
    backend = cpu.by_server.get(targets[DIRECT].name, 0.0)
    print(
        f"  {tag} round {turn} c={concurrency:<3} {name:<10} {result.rps:8.0f} req/s"
        f"  p50 {result.p50_ms:7.3f} ms  p99 {result.p99_ms:7.3f} ms"
        f"  errors {result.errors}  other load {cpu.foreign:.2f}, steal {cpu.steal:.2f} cores",
        flush=True,
    )
    per_request = 1e6 / result.rps if result.rps else 0.0
    return {
        "round": turn,
        "target": name,
        "concurrency": concurrency,
        **result.to_json(),
        "cpu": asdict(cpu),
        # CPU per request of the contender itself, and of the backend behind it.
        "own_cpu_us": round(own * per_request, 1),
        "backend_cpu_us": round(backend * per_request, 1),
    }


def summarize(rows: Sequence[Row], names: Sequence[str], concurrencies: Sequence[int]) -> list[Row]:
    summary: list[Row] = []
    for c in concurrencies:
        at_c = [r for r in rows if r["concurrency"] == c]
        for name in names:
            mine = [r for r in at_c if r["target"] == name]

            def is_mine(r: Row, name: str = name) -> bool:
                return bool(r["target"] == name)

            def is_direct(r: Row) -> bool:
                return bool(r["target"] == DIRECT)

            summary.append(
                {
                    "target": name,
                    "concurrency": c,
                    "rps": round(median(r["rps"] for r in mine), 1),
                    "p50_ms": round(median(r["p50_ms"] for r in mine), 3),
                    "p99_ms": round(median(r["p99_ms"] for r in mine), 3),
                    "errors": sum(r["errors"] for r in mine),
                    "rps_vs_direct": round(
                        median(paired(at_c, is_mine, is_direct, lambda r, d: r["rps"] / d["rps"])),
                        3,
                    ),
                    "added_p50_ms": round(
                        median(
                            paired(at_c, is_mine, is_direct, lambda r, d: r["p50_ms"] - d["p50_ms"])
                        ),
                        3,
                    ),
                    "added_p99_ms": round(
                        median(
                            paired(at_c, is_mine, is_direct, lambda r, d: r["p99_ms"] - d["p99_ms"])
                        ),
                        3,
                    ),
                    "cpu_us_per_req": round(median(r["own_cpu_us"] for r in mine), 1),
                    "backend_cpu_us_per_req": round(median(r["backend_cpu_us"] for r in mine), 1),
                    "other_load_cores": round(median(r["cpu"]["foreign"] for r in mine), 2),
                    "steal_cores": round(median(r["cpu"].get("steal", 0) for r in mine), 2),
                }
            )
    return summary
