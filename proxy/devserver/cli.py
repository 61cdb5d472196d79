"""The `n-proxy-devserver` command line (also `python -m proxy.devserver`)."""

from __future__ import annotations

import argparse

from aiohttp import web

from proxy.devserver.app import build_app
from proxy.devserver.config import DevConfig
from proxy.server import listen_backlog


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="n-proxy-devserver", description="A deterministic OpenAI-compatible n=1 backend."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds per token")
    parser.add_argument("--native-n", action="store_true", help="answer n>1 natively")
    parser.add_argument("--model", default="demo-model")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config = DevConfig(token_delay=args.token_delay, native_n=args.native_n, model=args.model)
    app = build_app(config)
    web.run_app(
        app, host=args.host, port=args.port, handler_cancellation=True, shutdown_timeout=1,
        backlog=listen_backlog(),
    )  # fmt: skip
    return 0
