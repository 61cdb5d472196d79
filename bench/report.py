"""The issue's targets checked against a run's results, and the run written as markdown tables."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

Results = dict[str, Any]
Row = dict[str, Any]
HEADLINE_CONCURRENCY = 16
FANOUT_TARGET_N = 8
FLAT_KIB = 1024  # "flat": less than this much growth between early and late in a stream's life


@dataclass(frozen=True)
class Target:
    what: str
    goal: str
    measured: str
    passed: bool | None  # None: not measured in this run

    @property
    def verdict(self) -> str:
        return {True: "pass", False: "MISS", None: "n/a"}[self.passed]


def _row(rows: Sequence[Row], **match: Any) -> Row:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), {})


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _check(what: str, goal: str, value: Any, ok: Callable[[float], bool], fmt: str) -> Target:
    if _missing(value):
        return Target(what, goal, "not measured", None)
    return Target(what, goal, fmt.format(value), ok(float(value)))


def _ratio(a: Row, b: Row) -> float | None:
    return a["rps"] / b["rps"] if a.get("rps") and b.get("rps") else None


def evaluate(results: Results) -> list[Target]:
    s1 = results.get("passthrough", {}).get("summary", [])
    c = HEADLINE_CONCURRENCY
    proxy = _row(s1, target="n-proxy", concurrency=c)
    at = f" (n=1, c={c})"
    s2 = results.get("fanout", {}).get("summary", [])
    s3 = results.get("stitching", {}).get("summary", {})
    s4 = results.get("ttft", {}).get("summary", {})
    s4_paced = results.get("ttft", {}).get("paced", {}).get("summary", {})
    s5 = results.get("memory", {})
    early_late = s5.get("open_streams", {}).get("growth_early_to_late_kib")
    stall_late = s5.get("slow_client", {}).get("proxy_held_growth_late_kib")
    growth = None if _missing(early_late) or _missing(stall_late) else max(early_late, stall_late)
    n8 = f"fan-out vs native, n={FANOUT_TARGET_N}"
    return [
        _check(
            "added p50 latency" + at,
            "<= 0.3 ms",
            proxy.get("added_p50_ms"),
            lambda v: v <= 0.3,
            "{:.3f} ms",
        ),
        _check(
            "added p99 latency" + at,
            "<= 1 ms",
            proxy.get("added_p99_ms"),
            lambda v: v <= 1.0,
            "{:.3f} ms",
        ),
        _check(
            "throughput vs direct" + at,
            ">= 50 %",
            proxy.get("rps_vs_direct"),
            lambda v: v >= 0.5,
            "{:.0%}",
        ),
        _check(
            "throughput vs LiteLLM" + at,
            ">= 5x",
            _ratio(proxy, _row(s1, target="litellm", concurrency=c)),
            lambda v: v >= 5,
            "{:.1f}x",
        ),
        _check(
            "throughput vs nginx" + at,
            ">= 0.5x (within 2x)",
            _ratio(proxy, _row(s1, target="nginx", concurrency=c)),
            lambda v: v >= 0.5,
            "{:.2f}x",
        ),
        _check(
            "throughput vs the 20-line aiohttp forwarder" + at,
            ">= 1.5x",
            _ratio(proxy, _row(s1, target="aiohttp forwarder", concurrency=c)),
            lambda v: v >= 1.5,
            "{:.2f}x",
        ),
        _check(
            "added p50 latency (n=1, c=1)",
            "<= 0.25 ms",
            _row(s1, target="n-proxy", concurrency=1).get("added_p50_ms"),
            lambda v: v <= 0.25,
            "{:.3f} ms",
        ),
        _check(
            n8 + ", non-streaming",
            ">= 80 %",
            _row(s2, n=FANOUT_TARGET_N, stream=False).get("ratio"),
            lambda v: v >= 0.8,
            "{:.0%}",
        ),
        _check(
            n8 + ", streaming",
            ">= 80 %",
            _row(s2, n=FANOUT_TARGET_N, stream=True).get("ratio"),
            lambda v: v >= 0.8,
            "{:.0%}",
        ),
        _check(
            "stitching, chunks per proxy CPU-second (one core)",
            ">= 50,000/s",
            s3.get("chunks_per_cpu_s"),
            lambda v: v >= 50_000,
            "{:,.0f}/s",
        ),
        _check(
            "merged TTFT minus fastest child's",
            "<= 1 ms",
            s4.get("ttft_added_ms"),
            lambda v: v <= 1.0,
            "{:.3f} ms",
        ),
        _check(
            "merged total over slowest child's",
            "<= 5 %",
            s4.get("total_over_slowest"),
            lambda v: v <= 0.05,
            "{:+.1%}",
        ),
        _check(
            "same, backend at 1 ms/token: TTFT gap",
            "<= 1 ms",
            s4_paced.get("ttft_added_ms"),
            lambda v: v <= 1.0,
            "{:.3f} ms",
        ),
        _check(
            "same, backend at 1 ms/token: total over slowest",
            "<= 5 %",
            s4_paced.get("total_over_slowest"),
            lambda v: v <= 0.05,
            "{:+.1%}",
        ),
        _check(
            "memory growth with stream length",
            f"flat (<= {FLAT_KIB} KiB)",
            growth,
            lambda v: v <= FLAT_KIB,
            "{:,.0f} KiB",
        ),
        _check(
            "bytes held per child behind a slow client",
            "<= 64 KiB",
            s5.get("slow_client", {}).get("proxy_held_per_child_kib"),
            lambda v: v <= 64,
            "{:.1f} KiB",
        ),
    ]


def targets_json(targets: Sequence[Target]) -> list[Row]:
    return [{**asdict(t), "verdict": t.verdict} for t in targets]


# --- markdown ------------------------------------------------------------------------------------

Column = tuple[str, str, str]  # header, key in the row, format ("" for str())


def _cell(value: object, fmt: str) -> str:
    if _missing(value):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return " / ".join(str(v) for v in value)
    return fmt.format(value) if fmt else str(value)


def _table(columns: Sequence[Column], rows: Sequence[Row]) -> list[str]:
    lines = [
        "| " + " | ".join(h for h, _, _ in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(_cell(r.get(k), f) for _, k, f in columns) + " |" for r in rows]
    return ["", *lines]


_TARGETS: list[Column] = [
    ("target", "what", ""),
    ("goal", "goal", ""),
    ("measured", "measured", ""),
    ("verdict", "verdict", ""),
]
_PASSTHROUGH: list[Column] = [
    ("contender", "target", ""),
    ("concurrency", "concurrency", ""),
    ("req/s", "rps", "{:,.0f}"),
    ("vs direct", "rps_vs_direct", "{:.0%}"),
    ("p50 ms", "p50_ms", "{:.3f}"),
    ("p99 ms", "p99_ms", "{:.3f}"),
    ("added p50 ms", "added_p50_ms", "{:+.3f}"),
    ("added p99 ms", "added_p99_ms", "{:+.3f}"),
    ("own CPU µs/req", "cpu_us_per_req", "{:,.0f}"),
    ("errors", "errors", ""),
    ("other load, cores", "other_load_cores", "{:.2f}"),
    ("steal, cores", "steal_cores", "{:.2f}"),
]
_FANOUT: list[Column] = [
    ("n", "n", ""),
    ("stream", "stream", ""),
    ("n-proxy req/s", "proxy_rps", "{:,.0f}"),
    ("native req/s", "native_rps", "{:,.0f}"),
    ("ratio", "ratio", "{:.0%}"),
    ("backend-bound ceiling", "backend_ceiling", "{:.0%}"),
    ("n-proxy p50 ms", "proxy_p50_ms", "{:.3f}"),
    ("native p50 ms", "native_p50_ms", "{:.3f}"),
    ("n-proxy cores", "proxy_cores", "{:.2f}"),
    ("its backend's cores", "backend_cores_proxied", "{:.2f}"),
    ("native backend cores", "backend_cores_native", "{:.2f}"),
    ("errors", "errors", ""),
    ("other load, cores", "other_load_cores", "{:.2f}"),
    ("steal, cores", "steal_cores", "{:.2f}"),
]
_STITCHING: list[Column] = [
    ("chunks/s through the proxy", "chunks_per_s", "{:,.0f}"),
    ("proxy CPU µs/chunk", "cpu_us_per_chunk", "{:.2f}"),
    ("chunks per proxy CPU-second", "chunks_per_cpu_s", "{:,.0f}"),
    ("errors", "errors", ""),
    ("RSS growth KiB", "rss_growth_kib", "{:,}"),
]
_TTFT: list[Column] = [
    ("fast children, ms/token", "fast_delay_ms", ""),
    ("fastest child first token ms", "fastest_child_first_token_ms", "{:.3f}"),
    ("slowest child headers ms", "slowest_child_headers_ms", "{:.3f}"),
    ("merged first token ms", "merged_first_token_ms", "{:.3f}"),
    ("TTFT gap ms", "ttft_added_ms", "{:+.3f}"),
    ("first token before slowest headers ms", "first_token_before_slowest_headers_ms", "{:.3f}"),
    ("first-byte gap ms", "first_byte_added_ms", "{:+.3f}"),
    ("slowest child total ms", "slowest_child_total_ms", "{:.1f}"),
    ("merged total ms", "merged_total_ms", "{:.1f}"),
    ("total over slowest", "total_over_slowest", "{:+.1%}"),
]
_OPEN_STREAMS: list[Column] = [
    ("open streams", "streams", ""),
    ("n", "n", ""),
    ("RSS warm KiB", "rss_warm_kib", "{:,}"),
    ("RSS all flowing / mid / at 90 % of life KiB", "rss_open_kib", ""),
    ("KiB per stream", "per_stream_kib", "{:.1f}"),
    ("growth early to late KiB", "growth_early_to_late_kib", "{:,}"),
    ("open fds", "fds_open", ""),
    ("failed", "failed", ""),
]
_SLOW_CLIENT: list[Column] = [
    ("slow client, n", "n", ""),
    ("stall s", "stall_seconds", ""),
    ("held in proxy per child KiB", "proxy_held_per_child_kib", "{:.1f}"),
    ("held growth, 2nd half of stall KiB", "proxy_held_growth_late_kib", "{:,}"),
    ("RSS growth KiB", "rss_growth_kib", "{:,}"),
    ("backend sent KiB", "backend_sent_kib", "{:,}"),
    ("backend sent, 2nd half of stall KiB", "backend_sent_late_kib", "{:,}"),
]


def markdown(results: Results, targets: Sequence[Target]) -> str:
    meta = results["meta"]
    out = [
        "# n-proxy benchmark",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['cpus']} x {meta['cpu_model']}, Linux {meta['kernel']}, "
        f"Python {meta['python']}; load generator: {meta['tool']};"
        f" proxy at commit {meta.get('proxy_version', 'unknown')}  ",
        f"Started {meta['started']}, took {meta.get('seconds', 0):.0f} s. "
        "Medians over alternating rounds; everything on 127.0.0.1.",
        "",
        "## Targets",
        *_table(
            _TARGETS,
            targets_json(targets),
        ),
    ]
    if results.get("skipped"):
        out += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in results["skipped"].items())]
    if s1 := results.get("passthrough"):
        out += ["", "## 1. n=1 pass-through, non-streaming", *_table(_PASSTHROUGH, s1["summary"])]
        out += [
            "",
            "Added latency is paired by round (contender minus direct in the same round), then"
            " the median. Other load: CPU used by processes that are not the bench; steal: CPU"
            " the hypervisor gave to other machines. Both should be near 0 for clean numbers.",
        ]
    if s2 := results.get("fanout"):
        out += ["", f"## 2. Fan-out vs native n (concurrency {s2['concurrency']})"]
        out += _table(_FANOUT, s2["summary"])
        out += [
            "",
            "Backend-bound ceiling: the ratio even a proxy costing nothing would reach, from the"
            " backend CPU that one native n-choice request takes over the CPU its n single-choice"
            " requests take (the demo backend's cost is mostly per request, not per choice).",
        ]
    if s3 := results.get("stitching"):
        out += [
            "",
            f"## 3. Stitching: n={s3['n']} streams of {s3['tokens_per_choice']} tokens per"
            f" choice, {s3['concurrency']} at a time",
            *_table(_STITCHING, [s3["summary"]]),
            "",
            "Chunks/s through the proxy is bounded by the demo backend generating them on the same"
            " cores; chunks per proxy CPU-second is what one core of proxy sustains.",
        ]
    if s4 := results.get("ttft"):
        rows = [{**s4["summary"], "fast_delay_ms": 0}]
        if s4.get("paced"):
            rows.append(
                {**s4["paced"]["summary"], "fast_delay_ms": s4["paced_token_delay_s"] * 1e3}
            )
        out += [
            "",
            f"## 4. TTFT and total, n={s4['n']}, {s4['tokens_per_choice']} tokens, one child"
            f" {s4.get('slow_child_headers_delay_s', 0) * 1000:.0f} ms slow to start and at"
            f" {s4['slow_child_token_delay_s'] * 1000:.0f} ms/token",
            *_table(_TTFT, rows),
            "",
            "Baseline: the client sends the same n children straight to the backend at once."
            " n-proxy starts the stream with the first child to answer (SPEC §5 rev 2), so its"
            " first token need not wait for the slow child's status line.",
        ]
    if s5 := results.get("memory"):
        out += ["", "## 5. Memory"]
        if s5.get("open_streams"):
            out += _table(_OPEN_STREAMS, [s5["open_streams"]])
        if s5.get("slow_client"):
            out += _table(_SLOW_CLIENT, [s5["slow_client"]])
            out += [
                "",
                "Held in proxy = bytes it read minus bytes it wrote (/proc/PID/io), i.e. what"
                " sits in its user-space buffers; kernel socket buffers are not counted.",
            ]
    if results.get("errors"):
        out += ["", "## Errors", ""] + [f"- {k}: {v}" for k, v in results["errors"].items()]
    return "\n".join(out) + "\n"
