"""Scenario 2: n-proxy fanning n out to the n=1 backend vs the backend answering n natively.

Same load, same bodies; the ratio is n-proxy's requests/s over the native baseline's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import orjson

from bench.load import Loader, Request, post
from bench.procs import CpuWatch, Server, settle
from bench.stats import Row, median, paired, rotated
from bench.workload import chat_request

PROXY = "n-proxy"
NATIVE = "native"


def check(server: Server, request: Request, n: int, stream: bool, name: str) -> None:
    status, raw = post(server.url, request)
    if status != 200:
        raise RuntimeError(f"{name}: status {status} for n={n}: {raw[:300]!r}")
    if stream:
        indices = {
            orjson.loads(line[6:])["choices"][0]["index"]
            for line in raw.split(b"\n")
            if line.startswith(b"data: {") and b'"choices":[{' in line
        }
        ok = indices == set(range(n)) and raw.count(b"data: [DONE]") == 1
    else:
        ok = [c["index"] for c in orjson.loads(raw)["choices"]] == list(range(n))
    if not ok:
        raise RuntimeError(f"{name}: wrong choices for n={n} stream={stream}: {raw[:300]!r}")


def run(
    proxy: Server,
    upstream: Server,
    native: Server,
    loader: Loader,
    ns: Sequence[int],
    concurrency: int,
    rounds: int,
    servers: Sequence[Server],
) -> dict[str, Any]:
    targets = {PROXY: proxy, NATIVE: native}
    cases = [(n, stream) for stream in (False, True) for n in ns]
    for n, stream in cases:
        for name, server in targets.items():
            check(server, chat_request(n, stream=stream), n, stream, name)
    rows: list[Row] = []
    for turn in range(rounds):
        for n, stream in cases:
            request = chat_request(n, stream=stream)
            for name in rotated(list(targets), turn):
                settle(servers)
                watch = CpuWatch(servers)
                result = loader.run(targets[name].url, request, concurrency)
                cpu = watch.stop()
                # The backend that did the generating: the n=1 one behind n-proxy, or native.
                backend = cpu.by_server.get(upstream.name if name == PROXY else native.name, 0.0)
                rows.append(
                    {
                        "round": turn,
                        "target": name,
                        "n": n,
                        "stream": stream,
                        **result.to_json(),
                        "cpu": asdict(cpu),
                        "proxy_cores": cpu.by_server.get(proxy.name, 0.0) if name == PROXY else 0,
                        "backend_cores": backend,
                    }
                )
                print(
                    f"  s2 round {turn} n={n:<2} stream={stream!s:<5} {name:<7}"
                    f" {result.rps:8.0f} req/s  p50 {result.p50_ms:7.3f} ms"
                    f"  errors {result.errors}  other load {cpu.foreign:.2f},"
                    f" steal {cpu.steal:.2f} cores",
                    flush=True,
                )
    return {"concurrency": concurrency, "runs": rows, "summary": summarize(rows)}


def summarize(rows: Sequence[Row]) -> list[Row]:
    cases = list(dict.fromkeys((r["n"], r["stream"]) for r in rows))
    summary: list[Row] = []
    for n, stream in cases:
        case = [r for r in rows if r["n"] == n and r["stream"] == stream]

        def is_proxy(r: Row) -> bool:
            return bool(r["target"] == PROXY)

        def is_native(r: Row) -> bool:
            return bool(r["target"] == NATIVE)

        summary.append(
            {
                "n": n,
                "stream": stream,
                "proxy_rps": round(median(r["rps"] for r in case if is_proxy(r)), 1),
                "native_rps": round(median(r["rps"] for r in case if is_native(r)), 1),
                "ratio": round(
                    median(paired(case, is_proxy, is_native, lambda r, b: r["rps"] / b["rps"])), 3
                ),
                "proxy_p50_ms": round(median(r["p50_ms"] for r in case if is_proxy(r)), 3),
                "native_p50_ms": round(median(r["p50_ms"] for r in case if is_native(r)), 3),
                "errors": sum(r["errors"] for r in case),
                # Cores busy: is the proxy or the backend the bottleneck?
                "proxy_cores": round(median(r["proxy_cores"] for r in case if is_proxy(r)), 2),
                "backend_cores_proxied": round(
                    median(r["backend_cores"] for r in case if is_proxy(r)), 2
                ),
                "backend_cores_native": round(
                    median(r["backend_cores"] for r in case if is_native(r)), 2
                ),
                "other_load_cores": round(median(r["cpu"]["foreign"] for r in case), 2),
                "steal_cores": round(median(r["cpu"].get("steal", 0) for r in case), 2),
                "backend_ceiling": _ceiling(case, n),
            }
        )
    return summary


def _ceiling(case: Sequence[Row], n: int) -> float:
    """The ratio a free proxy would reach on a CPU-bound backend: native backend CPU per n-choice
    request over the n=1 backend's CPU for n single-choice requests (same rounds, medians)."""
    native = median(
        r["backend_cores"] / r["rps"] for r in case if r["target"] == NATIVE and r["rps"]
    )
    proxied = median(
        r["backend_cores"] / r["rps"] for r in case if r["target"] == PROXY and r["rps"]
    )
    return round(native / proxied, 3) if proxied > 0 else float("nan")
