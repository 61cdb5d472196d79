"""py-spy on n-proxy while a scenario runs (``--profile``), and its hot spots: functions ranked by
the samples in which they are on top (self) and anywhere on the stack (total), and source files by
the samples in which one of their functions is on top. Time spent in compiled code (a C
extension's, a mypyc-compiled module's, a system call) counts for the Python function that called
it: run a pure build (no ``.so`` in ``proxy/``) to see the proxy's own modules one by one.

Linux's perf on n-proxy (``--perf``) splits the same time the other way: by the object whose code
ran (the kernel, the interpreter, the proxy's compiled modules, uvloop, aiohttp's parser, orjson)
and by symbol, the kernel's among them. It samples the CPU clock, so it works in a virtual machine
with no hardware counters, and it needs no symbols of Python's own."""

import contextlib
import re
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RATE_HZ = 250
PERF_HZ = 999  # perf's samples a second of n-proxy's CPU time
TOP = 25
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")
_SITE_PACKAGES = re.compile(r".*/site-packages/")
_CHECKOUT = re.compile(r".*/(?=proxy/)")  # a checkout's own modules, named from the package


def recording(py_spy: str, pid: int, out: Path) -> contextlib.AbstractContextManager[None]:
    """``with recording(py_spy, pid, out):`` records the process until the block ends."""
    argv = [py_spy, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--format", "raw",
            "--nonblocking", "--output", str(out)]  # fmt: skip
    return _recorder(argv, out, 30)


def perf_recording(perf: str, pid: int, out: Path) -> contextlib.AbstractContextManager[None]:
    """``with perf_recording(perf, pid, out):`` samples the process's CPU clock into ``out``
    until the block ends."""
    # -g: each sample's call chain too, for ``perf report -g`` on the file (the kernel's frames
    # are whole; Python's are not, without its frame pointers).
    argv = [perf, "record", "--quiet", "-g", "-e", "cpu-clock", "-F", str(PERF_HZ), "-p",
            str(pid), "-o", str(out)]  # fmt: skip
    return _recorder(argv, out, 60)


@contextlib.contextmanager
def _recorder(argv: list[str], out: Path, wait: float) -> Iterator[None]:
    """``argv`` run for the block, its own output in ``out``'s ``.log``; then SIGINT, on which
    py-spy and perf both write their file, and up to ``wait`` seconds for them to."""
    with out.with_suffix(".log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def perf_spots(perf: str, data: Path) -> dict[str, Any]:
    """The shares of perf's samples in ``data`` by object (``objects``) and by symbol
    (``symbols``), largest first."""

    def shares(sort: str) -> list[tuple[str, float]]:
        argv = [perf, "report", "--stdio", "--no-children", "-g", "none", "-i", str(data),
                "--sort", sort]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
        return perf_shares(out.stdout)[:TOP]

    return {"objects": shares("dso"), "symbols": shares("dso,sym")}


def perf_shares(report: str) -> list[tuple[str, float]]:
    """``perf report --stdio``'s rows: each name (an object, or an object and a symbol) and its
    share of the samples."""
    rows = []
    for line in report.splitlines():
        share, percent, name = line.strip().partition("%")
        if line.startswith("#") or not percent:
            continue
        try:
            rows.append((" ".join(name.split()), float(share) / 100))
        except ValueError:
            continue
    return rows


def perf_lines(spots: dict[str, Any]) -> list[str]:
    out = ["", "perf on n-proxy (its CPU clock, sampled), by object:", "",
           "| share | object |", "|---|---|"]  # fmt: skip
    out += [f"| {share:.1%} | `{name}` |" for name, share in spots["objects"]]
    out += ["", "By symbol:", "", "| share | object and symbol |", "|---|---|"]
    return out + [f"| {share:.1%} | `{name}` |" for name, share in spots["symbols"]]


def _function(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    return f"{match['func']} ({_SITE_PACKAGES.sub('', match['file'])})"


def hot_spots(raw: Path) -> dict[str, Any]:
    """Samples, and the top functions by self share and by total share (fractions of samples)."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    files: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count, frames = int(count_text), [_function(f) for f in stack.split(";")]
        samples += count
        own[frames[-1]] += count
        files[_file(frames[-1])] += count
        total.update(dict.fromkeys(frames, count))
    return {
        "samples": samples,
        "self": [(f, n / samples, total[f] / samples) for f, n in own.most_common(TOP)],
        "total": [(f, n / samples) for f, n in total.most_common(TOP)],
        "files": [(f, n / samples) for f, n in files.most_common(TOP)],
    }


def _file(function: str) -> str:
    """The source file of ``_function``'s name, ``proxy/...`` for the proxy's own."""
    _, _, where = function.rpartition(" (")
    return _CHECKOUT.sub("", where.removesuffix(")")) or function


def lines(spots: dict[str, Any]) -> list[str]:
    out = ["", f"py-spy on n-proxy, {spots['samples']} samples:", "",
           "| self | total | function |", "|---|---|---|"]  # fmt: skip
    out += [f"| {own:.1%} | {total:.1%} | `{f}` |" for f, own, total in spots["self"]]
    out += ["", "Inclusive (on the stack):", "", "| total | function |", "|---|---|"]
    out += [f"| {total:.1%} | `{f}` |" for f, total in spots["total"]]
    out += ["", "Self, by source file:", "", "| self | file |", "|---|---|"]
    return out + [f"| {own:.1%} | `{f}` |" for f, own in spots.get("files", [])]
