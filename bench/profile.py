"""py-spy on n-proxy while a scenario runs (``--profile``), and its hot spots: functions ranked by
the samples in which they are on top (self) and anywhere on the stack (total), and source files by
the samples in which one of their functions is on top. Time spent in compiled code (a C
extension's, a mypyc-compiled module's, a system call) counts for the Python function that called
it: run a pure build (no ``.so`` in ``proxy/``) to see the proxy's own modules one by one."""

import contextlib
import re
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RATE_HZ = 250
TOP = 25
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")
_SITE_PACKAGES = re.compile(r".*/site-packages/")
_CHECKOUT = re.compile(r".*/(?=proxy/)")  # a checkout's own modules, named from the package


@contextlib.contextmanager
def recording(py_spy: str, pid: int, out: Path) -> Iterator[None]:
    """``with recording(py_spy, pid, out):`` records the process until the block ends."""
    argv = [py_spy, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--format", "raw",
            "--nonblocking", "--output", str(out)]  # fmt: skip
    with out.with_suffix(".log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


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
