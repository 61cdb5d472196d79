"""The one check (``.ci/run``), run in a copy of its folder whose ``.venv`` holds stand-ins that
record each call: both test passes run whatever the first one gives, both verdicts are printed,
and the exit status fails when either pass failed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("python", "ruff", "mypy", "pytest")


def _check(tmp_path: Path, pytest_exits: tuple[int, int]) -> tuple[int, str, list[str]]:
    """``.ci/run`` in a tree whose tools only log their arguments; pytest exits with
    ``pytest_exits``, one per pass. Returns the exit status, the output and the calls."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "proxy").mkdir()
    (tmp_path / "proxy" / "stream.so").write_bytes(b"")
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    calls = tmp_path / "calls"
    for tool in TOOLS:
        script = f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\n'
        if tool == "pytest":
            first, second = pytest_exits
            script += f'[ -e "{tmp_path}/proxy/stream.so" ] && exit {first}\nexit {second}\n'
        (bin_ / tool).write_text(script)
        (bin_ / tool).chmod(0o755)
    done = subprocess.run(
        ["bash", ".ci/run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr, calls.read_text().splitlines()


@pytest.mark.parametrize(
    ("exits", "compiled", "pure", "ok"),
    [
        ((0, 0), "passed", "passed", True),
        ((1, 0), "FAILED (exit 1)", "passed", False),
        ((0, 2), "passed", "FAILED (exit 2)", False),
        ((1, 1), "FAILED (exit 1)", "FAILED (exit 1)", False),
    ],
)
def test_both_passes_run_and_either_failing_fails_the_check(
    tmp_path: Path, exits: tuple[int, int], compiled: str, pure: str, ok: bool
) -> None:
    status, output, calls = _check(tmp_path, exits)
    runs = [c for c in calls if c.startswith("pytest")]
    assert len(runs) == 2, calls
    assert "--cov-fail-under=93" not in runs[0]
    assert "--cov-fail-under=93" in runs[1]  # the pure pass, after the compiled modules went
    # The tests the same on either build run in the first pass alone.
    assert "-m not one_build" not in runs[0]
    assert "-m not one_build" in runs[1]
    assert f"compiled build: {compiled}" in output
    assert f"pure build:     {pure}" in output
    assert (status == 0) is ok


def test_the_venv_is_reused_and_checked_before_the_tests(tmp_path: Path) -> None:
    status, _, calls = _check(tmp_path, (0, 0))
    assert status == 0
    tools = [c.split()[0] for c in calls]
    # No new venv over the one there; pip upgraded and the package installed with its extras.
    assert calls[0] == "python -m pip install --quiet --upgrade pip"
    assert calls[1] == "python -m pip install --quiet -e .[test,fast]"
    assert tools[2:] == ["ruff", "ruff", "mypy", "pytest", "pytest"]
