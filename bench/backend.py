"""The demo backend as ``n-proxy-devserver`` serves it, on uvloop: a faster backend is a harder
baseline (``python -m bench.backend --port P [--token-delay S] [--native-n]``)."""

import asyncio
import contextlib
import sys

from proxy.devserver.cli import main

if __name__ == "__main__":
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    raise SystemExit(main(sys.argv[1:]))
