"""The build: the per-chunk stream path compiled with mypyc where it can be, else pure Python.

The modules in ``COMPILED`` are the typed pure core and wire code every relayed or stitched
chunk runs through, and the pure per-request work around them. ``N_PROXY_PURE=1`` builds
without them; a machine where mypyc or the C compiler fails gets the pure package too, with one
line saying why. Either way the same ``.py`` files are installed, so the compiled modules
always have their fallback beside them (``proxy.http.stream_path_compiled()`` says which one
runs).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

COMPILED = [
    "proxy/core/sse.py",
    "proxy/core/stitch.py",
    "proxy/core/template.py",
    "proxy/http/chunks.py",
    "proxy/http/connection.py",
    "proxy/http/response.py",
    "proxy/request/mailbox.py",
    "proxy/request/sink.py",
    "proxy/request/writer.py",
    # The fan-out around the stream path: 2 % fewer instructions per n = 4 JSON request. What a
    # compiled coroutine must not do: docs/architecture.md#working-on-a-compiled-module.
    "proxy/request/fanout.py",
    # The pure per-request work every request pays before and after its body: header filtering,
    # the plan, the answer's facts, the plain metrics, the line for a slot, replica placement,
    # the retry budget and the connection pool: 8 % fewer instructions per pass-through request
    # (docs/performance.md#the-per-request-path).
    "proxy/core/headers.py",
    "proxy/core/remembered.py",  # what header filtering and the upstream head remember by name
    "proxy/core/url.py",  # an upstream's Origin, whose fields the pool reads every request
    "proxy/core/plan.py",
    "proxy/core/answer.py",
    "proxy/core/usage.py",
    "proxy/observe/plain.py",
    "proxy/upstream/slots.py",
    "proxy/upstream/replicas.py",
    "proxy/upstream/retry.py",
    "proxy/http/pool.py",
    # The handler, the request's record and the meter that reads it: 5 % fewer instructions per
    # pass-through request. Observer allows Python subclasses (the tracing, the log line, the
    # tests' observers).
    "proxy/request/handler.py",
    "proxy/observe/record.py",
    "proxy/observe/meter.py",
    "proxy/observe/catalog.py",  # the model label the meter gives every LLM answer
    "proxy/request/clients.py",  # the client's id, each request's: 0.7 % fewer
    "proxy/request/parsed.py",  # what aiohttp parsed of a request, read without its properties
    # The request's log line, built from its record and written: 3.3 % fewer instructions per
    # pass-through request.
    "proxy/observe/line.py",
    # An upstream request's exchange and the pass-through around it: 3.3 % fewer instructions
    # per pass-through request, 4.2 % per n = 4 JSON request (the answers' classes, which
    # subclass aiohttp's, are proxy/request/responses.py's).
    "proxy/upstream/exchange.py",
    "proxy/upstream/tries.py",
    # What the proxy holds for an upstream, read a dozen times a request by the compiled
    # admission, exchange and tries: a field of a compiled class is a C read.
    "proxy/upstream/state.py",
    "proxy/request/passthrough.py",
]
# Not proxy/observe/log.py: its handler and formatters subclass the logging module's classes
# (the request line it writes, and the batch its lines wait in, are proxy/observe/line.py's).
# Not the service: the tests replace its health probe on the class, which a compiled class
# forbids; what every request asks of it (route, admit, exchange) is proxy/upstream/exchange.py's
# Front, which it subclasses.
# Not proxy/request/responses.py: its answers subclass aiohttp's StreamResponse, which mypyc
# compiles into a class whose instances aiohttp's own __init__ then fails on (SystemError). And
# mypyc cannot subclass ConnectionResetError, so ClientGone is in proxy/core/errors.py.


# Two groups, each one C file and one shared library, compiled side by side (build_ext's
# parallel below): the build takes half the time on two cores, 62 s against 124. A call from
# one group into the other goes through a table, which callgrind does not tell apart from
# noise on a stream, and finds 1 % fewer instructions on a JSON request than with one group.
STREAM_GROUP = {
    "proxy/core/sse.py", "proxy/core/stitch.py", "proxy/core/template.py", "proxy/http/chunks.py",
    "proxy/http/connection.py", "proxy/http/response.py", "proxy/request/mailbox.py",
    "proxy/request/sink.py", "proxy/request/writer.py", "proxy/request/fanout.py",
}  # fmt: skip


def _say(message: str) -> None:
    print(f"n-proxy build: {message}", file=sys.stderr, flush=True)


def _extensions() -> list[Any]:
    if os.environ.get("N_PROXY_PURE", "") not in ("", "0"):
        _say("N_PROXY_PURE is set: pure Python, nothing compiled")
        return []
    try:
        from mypyc.build import mypycify

        # The build's environment need not hold the runtime dependencies: their types are Any
        # there, which mypyc compiles as plain Python calls; so no strict checking here (the
        # project's own check, mypy --strict, runs with them installed).
        # tests/meta/test_build.py runs this check as the isolated build does (--no-site-packages).
        flags = ["--config-file=", "--ignore-missing-imports"]
        groups: list[tuple[list[str], str | None]] = [
            ([p for p in COMPILED if p in STREAM_GROUP], "proxy.compiled_stream"),
            ([p for p in COMPILED if p not in STREAM_GROUP], "proxy.compiled"),
        ]
        return list(mypycify([*flags, *COMPILED], opt_level="3", separate=groups))
    except BaseException as exc:  # mypyc missing, or its type check exiting: build pure
        _say(f"mypyc could not compile the stream path ({type(exc).__name__}: {exc}); pure Python")
        return []


class _OptionalBuildExt(build_ext):
    """A C compiler missing or failing leaves the pure package, not a failed install. The
    extensions are built on every core."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            for output in self.get_outputs():
                Path(output).unlink(missing_ok=True)  # no half-compiled set: all or none
            _say(f"compiling failed ({type(exc).__name__}: {exc}); pure Python")


setup(ext_modules=_extensions(), cmdclass={"build_ext": _OptionalBuildExt})
