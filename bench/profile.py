"""Sampling the proxy with py-spy while a scenario runs, and naming its hot spots.

py-spy writes collapsed stacks (``frame;frame;... count``); the summary ranks functions by the
samples in which they are on top (self) and anywhere on the stack (total).
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

RATE_HZ = 250
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")
_SITE_PACKAGES = re.compile(r".*/site-packages/")


@dataclass(frozen=True)
class HotSpot:
    function: str  # "name (path)" with the site-packages prefix cut
    self_share: float  # of all samples
    total_share: float


class PySpy:
    """``with PySpy(py_spy, pid, out):`` records the process until the block ends."""

    def __init__(self, py_spy: str, pid: int, out: Path) -> None:
        self.out = out
        self._argv = [
            py_spy,
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(RATE_HZ),
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            str(out),
        ]
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PySpy:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        log = self.out.with_suffix(".log").open("wb")
        self._process = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._process is None:
            return
        self._process.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)


def _function(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    where = _SITE_PACKAGES.sub("", match["file"])
    return f"{match['func']} ({where})"


def hot_spots(raw: Path, top: int = 25) -> tuple[int, list[HotSpot]]:
    """All samples, and the ``top`` functions by self share."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_function(f) for f in stack.split(";")]
        if not frames:
            continue
        samples += count
        own[frames[-1]] += count
        for name in set(frames):
            total[name] += count
    spots = [
        HotSpot(name, round(n / samples, 4), round(total[name] / samples, 4))
        for name, n in own.most_common(top)
    ]
    return samples, spots


def inclusive(raw: Path, top: int = 25) -> list[tuple[str, float]]:
    """The ``top`` functions by the share of samples they appear in, anywhere on the stack."""
    total: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        samples += count
        for name in {_function(f) for f in stack.split(";")}:
            total[name] += count
    return [(name, round(n / samples, 4)) for name, n in total.most_common(top)] if samples else []
