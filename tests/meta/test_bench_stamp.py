"""The bench's stamp names the interpreter each n-proxy ran on: a CPython's build moves n-proxy's
CPU per request by a fifth (docs/performance.md#the-interpreters-build)."""

import os
import platform
import sys
from pathlib import Path

from bench.report import header, interpreter, stamp


def test_the_interpreter_is_named_with_its_version_executable_and_libpython() -> None:
    said = interpreter(sys.executable)
    executable = os.path.realpath(sys.executable)
    assert said.startswith(f"Python {platform.python_version()} at {executable}, ")
    # this process runs on the same interpreter: its own map says how libpython is linked
    mapped = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if "/libpython" in line]  # fmt: skip
    if mapped:
        assert said.endswith(f", libpython shared ({mapped[0]})")
    else:
        assert said.endswith(", libpython linked in")


def test_a_python_that_cannot_say_is_unknown(tmp_path: Path) -> None:
    assert interpreter(tmp_path / "no-python") == "unknown"
    silent = tmp_path / "silent"
    silent.write_text("#!/bin/sh\nexit 0\n")
    silent.chmod(0o755)
    assert interpreter(silent) == "unknown"


def test_the_report_names_the_baseline_interpreter_too(tmp_path: Path) -> None:
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    meta = stamp("python -m bench wire", "wrk", [], tmp_path, "")
    ours = interpreter(sys.executable)
    assert meta["interpreters"] == {"n-proxy": ours, "baseline": ours}
    lines = header("n-proxy benchmark: wire", meta)
    assert f"n-proxy on {ours}; baseline on {ours}." in lines


def test_a_report_saved_before_interpreters_were_named_still_renders() -> None:
    meta = stamp("python -m bench wire", "wrk", [], None, "")
    del meta["interpreters"]
    assert not any(line.startswith("n-proxy on ") for line in header("n-proxy benchmark", meta))
