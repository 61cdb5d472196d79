"""Every scenario's report: the stamp (commit, date, machine, command), Markdown tables, targets
checked against their goals, and the pictures (``python -m bench.report latest.json``, in
bench/.work/venv: it has matplotlib; this module needs nothing else beyond the stdlib)."""

import datetime
import functools
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
Row = dict[str, Any]
Column = tuple[str, str, str]  # header, key in the row, format ("" for str())


def version(argv: Sequence[str]) -> str:
    """The first line a tool prints about its version ("unknown" when it cannot say)."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    first = (out.stdout + out.stderr).strip().splitlines() or ["unknown"]
    return first[0].split(" [")[0].split(" (")[0].removeprefix("nginx version: ")


def commit(tree: Path = ROOT) -> str:
    """The commit a tree is at, marked dirty when its proxy/ has uncommitted changes."""
    git = functools.partial(subprocess.run, cwd=tree, capture_output=True, text=True)
    try:
        head = git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = git(["git", "status", "--porcelain", "proxy"]).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}{'+dirty' if dirty else ''}" if head else "unknown"


# Run by an n-proxy tree's Python: its version, its executable, and the libpython it mapped (none
# when the executable has the interpreter linked in).
_INTERPRETER = """\
import os, platform, sys
maps = open("/proc/self/maps").read().splitlines()
lib = next((line.split()[-1] for line in maps if "/libpython" in line), "")
print(platform.python_version(), os.path.realpath(sys.executable), lib, sep="\\t")
"""


def interpreter(python: str | Path) -> str:
    """What n-proxy runs on under ``python``: the version, the executable, and whether the
    interpreter is in a shared libpython or linked into the executable. How a CPython was built
    (PGO, LTO, a shared libpython) moves n-proxy's CPU per request by a fifth
    (docs/performance.md#the-interpreters-build); "unknown" when ``python`` cannot say."""
    try:
        out = subprocess.run([str(python), "-c", _INTERPRETER], capture_output=True, text=True,
                             timeout=30)  # fmt: skip
        found, executable, lib = out.stdout.rstrip("\n").split("\t")
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return "unknown"
    linked = f"libpython shared ({lib})" if lib else "libpython linked in"
    return f"Python {found} at {executable}, {linked}"


def stamp(command: str, load: str, versions: list[str], baseline: Path | None, note: str) -> Row:
    """What a result was measured with: printed at the top of its report, kept in its JSON."""
    names = re.findall(r"^model name\s*: (.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    pythons = {"n-proxy": interpreter(sys.executable)}
    if baseline:
        pythons["baseline"] = interpreter(baseline / ".venv" / "bin" / "python")
    return {
        "command": command, "commit": commit(),
        "baseline": f"{baseline} at {commit(baseline)}" if baseline else None,
        "interpreters": pythons,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(), "cpu_model": names[0] if names else "unknown",
        "kernel": platform.release(), "python": platform.python_version(),
        "load_average": os.getloadavg()[0],  # at the start: other work on a shared machine
        "load": load, "versions": versions, "note": note,
    }  # fmt: skip


def header(title: str, meta: Row) -> list[str]:
    tools = ", ".join([f"load generator: {meta['load']}", *meta["versions"]])
    lines = [
        f"# {title}", "", f"Command: `{meta['command']}`  ",
        f"n-proxy at commit {meta['commit']}"
        + (f"; baseline {meta['baseline']}" if meta.get("baseline") else "")
        + f"; started {meta['started']}, took {meta.get('seconds', 0):.0f} s  ",
        f"Machine: {meta['cpus']} x {meta['cpu_model']}, Linux {meta['kernel']}, Python"
        f" {meta['python']}; {tools}; load average {meta.get('load_average', 0):.1f} at the"
        " start. Everything on 127.0.0.1.",
    ]  # fmt: skip
    if pythons := meta.get("interpreters"):
        lines[-1] += "  "
        lines.append("; ".join(f"{name} on {what}" for name, what in pythons.items()) + ".")
    return lines + (["", meta["note"]] if meta.get("note") else [])


def pick(rows: Sequence[Row], **match: Any) -> Row:
    """The first row with these values ({} when none has)."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), {})


def say(what: str, row: Row, *keys: str) -> None:
    """A progress line: some of a row's values, as a run goes."""
    shown = ", ".join(f"{k} {cell(row.get(k), '{:,.4g}')}" for k in keys)
    print(f"  {what}: {shown}", flush=True)


def missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def cell(value: object, fmt: str = "") -> str:
    if missing(value):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return " / ".join(cell(v, fmt) for v in value)
    return fmt.format(value) if fmt else str(value)


def table(columns: Sequence[Column], rows: Sequence[Row]) -> list[str]:
    """A Markdown table, blank line first; a missing value shows as "-"."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k), f) for _, k, f in columns) + " |" for r in rows]
    return ["", *lines]


@dataclass(frozen=True)
class Section:
    """A scenario's part of the report as a description: ``text`` (a format string over the
    scenario's JSON, as ``{options[seconds]:g}``), then its ``summary`` as a table of ``columns``,
    then ``note``. Called with that JSON it gives the Markdown, so it is a Scenario's ``render``."""

    columns: Sequence[Column]
    text: str
    note: str = ""

    def __call__(self, data: Row) -> list[str]:
        note = ["", self.note] if self.note else []
        return [self.text.format(**data), *table(self.columns, data["summary"]), *note]


def target(what: str, value: Any, op: str, bound: float, fmt: str) -> Row:
    """A goal as the performance notes state it and what this run measured against it: a row of
    the targets table. ``op`` is "<=" or ">="; ``fmt`` formats both the goal and the measured
    value; the verdict is "pass", "MISS", or "n/a" when this run did not measure it."""
    goal = f"{op} {fmt.format(bound)}"
    if missing(value):
        return {"what": what, "goal": goal, "measured": "not measured", "verdict": "n/a"}
    ok = float(value) <= bound if op == "<=" else float(value) >= bound
    verdict = "pass" if ok else "MISS"
    return {"what": what, "goal": goal, "measured": fmt.format(value), "verdict": verdict}


COLORS = {"direct": "#4c72b0", "nginx": "#55a868", "n-proxy": "#c44e52", "n-proxy x2": "#dd8452",
          "litellm": "#8172b2", "aiohttp forwarder": "#937860", "baseline": "#8c8c8c"}  # fmt: skip


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files (imported here: only the bench venv has it)."""
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    return plt


def _passthrough(bars: Any, lines: Any, summary: list[Row]) -> None:
    """Req/s per contender and concurrency as bars; latency added over direct as lines."""
    names = list(dict.fromkeys(r["target"] for r in summary))
    levels = sorted({r["concurrency"] for r in summary})
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        rows = {r["concurrency"]: r for r in summary if r["target"] == name}
        xs = [j + i * width for j in range(len(levels))]
        bars.bar(xs, [rows[c]["rps"] for c in levels], width, label=name, color=COLORS.get(name))
        for q, style in (("p50", "o-"), ("p99", "x--")) if name != "direct" else ():
            values = [rows[c][f"added_{q}_ms"] for c in levels]
            lines.plot(levels, values, style, color=COLORS.get(name), label=f"{name} {q}")
    bars.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(levels))])
    bars.set_xticklabels([f"c={c}" for c in levels])
    bars.set(ylabel="requests/s", title="n=1 pass-through (non-streaming)")
    bars.legend(fontsize=8)
    lines.set_xscale("log", base=2)
    lines.set_yscale("symlog", linthresh=1)
    lines.axhline(0.3, color="grey", linewidth=0.8, linestyle=":")
    lines.set_xticks(levels, [str(c) for c in levels])
    lines.set(xlabel="concurrency", ylabel="added latency over direct, ms", title="added latency")
    lines.legend(fontsize=7)


def _fanout(ax: Any, summary: list[Row]) -> None:
    for stream, style in ((False, "o-"), (True, "o--")):
        rows = sorted((r for r in summary if r["stream"] == stream and r["target"] == "n-proxy"),
                      key=lambda r: r["n"])  # fmt: skip
        label = "streaming" if stream else "non-streaming"
        ax.plot([r["n"] for r in rows], [r["ratio"] * 100 for r in rows], style, label=label)
    ax.axhline(80, color="grey", linewidth=0.8, linestyle=":")
    ax.set(xlabel="n", ylabel="n-proxy / native n, % req/s", title="fan-out vs native n")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)


def _targets(ax: Any, targets: list[Row]) -> None:
    ax.axis("off")
    ax.set_title("targets")
    colors = {"pass": "#2e7d32", "MISS": "#c62828", "n/a": "#757575"}
    for i, t in enumerate(targets):
        y = 1 - (i + 0.5) / max(len(targets), 1)
        ax.text(0, y, t["verdict"], color=colors[t["verdict"]], fontsize=8, weight="bold")
        ax.text(0.12, y, f"{t['what']}: {t['measured']} (goal {t['goal']})", fontsize=7)


def chart(results: Row, out: Path) -> None:
    """Pass-through's req/s and added latency, fan-out over native n, and the targets."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    if passthrough := results.get("passthrough", {}).get("summary"):
        _passthrough(axes[0][0], axes[0][1], passthrough)
    if fanout := results.get("fanout", {}).get("summary"):
        _fanout(axes[1][0], fanout)
    _targets(axes[1][1], results.get("targets", []))
    meta = results.get("meta", {})
    fig.suptitle(f"n-proxy benchmark · {meta.get('cpus')} x {meta.get('cpu_model')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def dashboard(data: Row, png: Path) -> None:
    """The dashboard scenario's panels, two columns, as Grafana's dark theme shows them."""
    plt = pyplot()
    panels = [p for p in data["panels"] if "title" in p]
    rows = (len(panels) + 1) // 2
    plt.style.use("dark_background")
    fig, axes = plt.subplots(rows, 2, figsize=(11, 2.1 * rows), dpi=72)
    scale = {"percentunit": (100, "%"), "s": (1000, "ms"), "reqps": (1, "/s"), "short": (1, "")}
    for ax, panel in zip(axes.flat, panels, strict=False):
        factor, suffix = scale.get(panel["unit"], (1, ""))
        shown = [s for s in panel["series"] if any(not missing(v) for _, v in s["points"])][:8]
        for series in shown:  # NaN, null in the JSON: a gap in the line
            xs = [p[0] for p in series["points"]]
            ys = [math.nan if missing(p[1]) else p[1] * factor for p in series["points"]]
            ax.plot(xs, ys, linewidth=1.2, label=series["legend"][:34])
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.2)
        if suffix:
            ax.set_ylabel(suffix, fontsize=7)
        if shown:
            ax.legend(fontsize=6, loc="upper left", frameon=False, ncol=2)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"n-proxy dashboard: {data['requests']} requests from {data['workers']} clients"
                 f" over {data['seconds']:g} s (demo backend, one dead replica of two); x: seconds",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(png, dpi=72)
    from PIL import Image  # type: ignore[import-not-found, unused-ignore]  # matplotlib's dependency

    with Image.open(png) as image:  # a palette of 64 colours: a third of the bytes, same look
        image.convert("RGB").quantize(64).save(png, optimize=True)


PICTURED = {"passthrough", "fanout", "dashboard"}  # the scenarios with a picture


def pictures(results: Row, out: Path, stem: str) -> None:
    """The chart of passthrough and fanout (<stem>.png), and the dashboard's (dashboard.png)."""
    if {"passthrough", "fanout"} & set(results):
        chart(results, out / f"{stem}.png")
    if results.get("dashboard", {}).get("panels"):
        dashboard(results["dashboard"], out / "dashboard.png")


if __name__ == "__main__":  # RESULTS.json: its pictures beside it
    path = Path(sys.argv[1])
    pictures(json.loads(path.read_text()), path.parent, path.stem)
