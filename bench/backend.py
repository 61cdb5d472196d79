"""The demo backend as ``n-proxy-devserver`` serves it, tuned for long benchmark runs.

Two changes, both to make the baseline hard to beat rather than easy: uvloop, and bookkeeping
that forgets finished requests (the devserver keeps every request for tests to inspect, which
grows without bound and makes garbage collection pauses longer as a run goes on).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

from aiohttp import web

from proxy.devserver import DEV_STATE, DevConfig, DevState, build_app


class _ForgetfulState(DevState):
    """Tracks requests in flight only; nothing in the bench reads the history."""

    def record(self, rid: str, body: Any, headers: dict[str, str]) -> None:
        pass

    def end(self, rid: str, outcome: Any) -> None:
        self.active.pop(rid, None)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.backend")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--native-n", action="store_true")
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    app = build_app(DevConfig(token_delay=args.token_delay, native_n=args.native_n))
    app[DEV_STATE] = _ForgetfulState()
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        handler_cancellation=True,
        shutdown_timeout=1,
        access_log=None,
        print=None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
