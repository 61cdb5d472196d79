"""The load tools written in C, where a Python one would cost as much CPU as the contender it
measures: the paced upstream (``pacer.c``) and the many-stream client (``streams.c``) of the
manystream scenario. Each is built on first use with the machine's C compiler (``$CC``, else
``cc``), into bench/.work/native, under a name that changes with its source."""

import hashlib
import os
import subprocess
from pathlib import Path

SOURCES = Path(__file__).resolve().parent
BUILT = SOURCES.parent / ".work" / "native"
FLAGS = ("-O2", "-Wall", "-Wextra")
BUILD_TIMEOUT = 120.0


def tool(name: str) -> Path:
    """The executable built from ``<name>.c``; RuntimeError with the compiler's words when it
    cannot be built."""
    source = SOURCES / f"{name}.c"
    digest = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    built = BUILT / f"{name}-{digest}"
    if built.exists():
        return built
    BUILT.mkdir(parents=True, exist_ok=True)
    partial = built.with_suffix(f".{os.getpid()}.tmp")  # several runs may build at once
    argv = [os.environ.get("CC") or "cc", *FLAGS, "-o", str(partial), str(source), "-lm"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"bench/native/{name}.c needs a C compiler: {error}") from error
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"bench/native/{name}.c did not build:\n{done.stderr[-2000:]}")
    partial.replace(built)
    return built
