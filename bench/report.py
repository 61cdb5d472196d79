"""Every scenario's report: the stamp (commit, date, machine, command), Markdown tables, and targets
checked against their goals."""

import datetime
import functools
import math
import os
import platform
import re
import subprocess
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
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0].split(" [")[0].removeprefix("nginx version: ") if text else "unknown"


def commit(tree: Path = ROOT) -> str:
    """The commit a tree is at, marked dirty when its proxy/ has uncommitted changes."""
    git = functools.partial(subprocess.run, cwd=tree, capture_output=True, text=True)
    try:
        head = git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = git(["git", "status", "--porcelain", "proxy"]).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}{'+dirty' if dirty else ''}" if head else "unknown"


def stamp(command: str, load: str, versions: list[str], baseline: Path | None, note: str) -> Row:
    """What a result was measured with: printed at the top of its report, kept in its JSON."""
    names = re.findall(r"^model name\s*: (.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    return {
        "command": command, "commit": commit(),
        "baseline": f"{baseline} at {commit(baseline)}" if baseline else None,
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
class Target:
    """A goal as the performance notes state it, and what this run measured against it."""

    what: str
    goal: str
    measured: str
    passed: bool | None  # None: not measured in this run

    @property
    def verdict(self) -> str:
        return {True: "pass", False: "MISS", None: "n/a"}[self.passed]


def target(what: str, value: Any, op: str, bound: float, fmt: str) -> Target:
    """``op`` is "<=" or ">="; ``fmt`` formats both the goal and the measured value."""
    goal = f"{op} {fmt.format(bound)}"
    if missing(value):
        return Target(what, goal, "not measured", None)
    ok = float(value) <= bound if op == "<=" else float(value) >= bound
    return Target(what, goal, fmt.format(value), ok)
