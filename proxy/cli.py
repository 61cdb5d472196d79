"""The ``n-proxy`` command: serve (in front of a URL, a YAML config, or the built-in demo backend),
``check-config`` and ``config-schema``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Sequence

import orjson

from proxy import __version__
from proxy.config import (
    MAX_N_CEILING,
    Config,
    ConfigError,
    Listen,
    config_schema,
    load_config,
    single_upstream_config,
)
from proxy.observe import LEVELS, setup_logging
from proxy.server import (
    FAILED,
    USAGE,
    WORKER_MEMORY_BYTES,
    MiB,
    NotStarted,
    Server,
    auto_workers,
    check_worker_count,
    install_uvloop,
    max_workers,
    report,
    run,
    run_workers,
    start,
)

AUTO = 0  # --workers auto, resolved once the config is known
DEMO_MODEL = "demo"
DEMO_NOTICE = "no upstream configured; this answer comes from the built-in demo backend"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["check-config"]:
        return check_config(args[1:])
    if args[:1] == ["config-schema"]:
        _schema_parser().parse_args(args[1:])
        sys.stdout.write(orjson.dumps(config_schema(), option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    options = _parser().parse_args(args)
    # Until the config is loaded, its failure is logged in the flags' format, else the default.
    setup_logging(options.log_format or "json", options.log_level or "info")
    try:
        return _serve(options)
    except NotStarted as failure:  # one line, no traceback (docs/operating.md#exit-status)
        return report(failure)


def _serve(options: argparse.Namespace) -> int:
    try:
        config = _config(options)
    except ConfigError as exc:
        raise _config_error(options, exc) from None
    setup_logging(config.log_format, config.log_level)
    demo = options.upstream is None and options.config is None
    # SIGHUP reads the file again, with the same command-line overrides on top.
    loader = functools.partial(_config, options) if options.config is not None else None
    workers = options.workers
    if workers == AUTO:
        # Never more workers than the limits can be divided among
        # (proxy.server.workers.worker_config).
        workers = 1 if demo else min(auto_workers(), max_workers(config))
    if workers > 1:
        if demo:
            raise NotStarted(
                "usage error; not started", USAGE, error="--workers needs --upstream or --config"
            )
        try:
            check_worker_count(config, workers)
        except ConfigError as exc:
            raise _config_error(options, exc, workers=workers) from None
        return run_workers(config, workers, loader)
    install_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config, demo=demo, loader=loader))
    return 0


def _config_error(options: argparse.Namespace, exc: ConfigError, **fields: object) -> NotStarted:
    """The one line ``check-config`` would print, naming the key, as the log's error line."""
    return NotStarted(
        "config error; not started", USAGE, config=options.config, error=str(exc), **fields
    )


def check_config(args: Sequence[str]) -> int:
    path = _check_config_parser().parse_args(args).file
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: ok ({len(config.upstreams)} upstreams, {len(config.routes)} routes)")
    return 0


def _check_config_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="n-proxy check-config",
        description="Validate an n-proxy YAML config: exit 0 if it loads, 1 with the first error "
        "(naming its YAML key) if not. ${ENV} placeholders are expanded from the environment. "
        "A running proxy validates the file the same way when SIGHUP makes it reload it.",
    )
    parser.add_argument("file", metavar="FILE", help="the YAML config to check")
    return parser


def _schema_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="n-proxy config-schema",
        description="Print the JSON Schema of the YAML config, for editors and CI checks.",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="n-proxy",
        description="Reverse proxy that gives OpenAI n>1 to servers that serve one choice. "
        "Without --upstream or --config it starts a built-in demo backend. "
        "`n-proxy check-config FILE` validates a config file; "
        "`n-proxy config-schema` prints its JSON Schema.",
    )
    parser.add_argument("--version", action="version", version=f"n-proxy {__version__}")
    parser.add_argument("--upstream", help="base URL of the OpenAI-compatible server")
    parser.add_argument(
        "--config",
        default=os.environ.get("N_PROXY_CONFIG"),
        help="YAML config (env N_PROXY_CONFIG)",
    )
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8080)")
    parser.add_argument("--admin-port", type=int, help="admin port for /livez /readyz /metrics")
    parser.add_argument(
        "--workers",
        type=_workers,
        default=1,
        help="processes sharing the port (SO_REUSEPORT), each with its share of the limits; "
        f"auto: the CPUs of the cgroup quota, at most one per {WORKER_MEMORY_BYTES // MiB} MiB "
        "of its memory limit",
    )
    parser.add_argument("--log-format", choices=("json", "text"), help="request log format")
    parser.add_argument(
        "--log-level", choices=LEVELS, help="least level logged (default info: a line per request)"
    )
    parser.add_argument(
        "--max-n", type=int, help=f"largest n accepted (default 10, at most {MAX_N_CEILING})"
    )
    return parser


def _workers(value: str) -> int:
    if value == "auto":
        return AUTO
    count = int(value)
    if count < 1:
        raise ValueError(value)
    return count


def _config(options: argparse.Namespace) -> Config:
    if options.config is not None:
        config = load_config(options.config)
        if options.upstream is not None:
            default = config.upstream(config.default_upstream)
            urls = single_upstream_config(options.upstream).upstreams[0].urls
            replaced = default.model_copy(update={"urls": urls})
            upstreams = tuple(replaced if u is default else u for u in config.upstreams)
            config = config.model_copy(update={"upstreams": upstreams})
    else:
        config = single_upstream_config(options.upstream or "http://127.0.0.1:0")
    listen = Listen(
        host=options.host if options.host is not None else config.listen.host,
        port=options.port if options.port is not None else config.listen.port,
    )
    max_n = options.max_n if options.max_n is not None else config.max_n
    if not 1 <= max_n <= MAX_N_CEILING:
        raise ConfigError(f"--max-n: must be an integer from 1 to {MAX_N_CEILING}")
    admin = config.admin
    if options.admin_port is not None:
        admin = Listen(host=admin.host if admin else listen.host, port=options.admin_port)
    log_format = options.log_format or config.log_format
    log_level = options.log_level or config.log_level
    return config.model_copy(
        update={
            "listen": listen,
            "max_n": max_n,
            "admin": admin,
            "log_format": log_format,
            "log_level": log_level,
        }
    )


async def serve(
    config: Config, *, demo: bool = False, loader: Callable[[], Config] | None = None
) -> None:
    """Run until SIGTERM or SIGINT, then drain; each SIGHUP reloads the config with ``loader``.

    ``demo``: no upstream was configured, so the built-in demo backend answers, and says so on
    every answer (``model: "demo"`` and an ``X-N-Proxy-Demo`` header): a forgotten ``--upstream``
    must not pass for a real model.
    """
    dev_runner = None
    notice = None
    if demo:
        from proxy.devserver import DevConfig, start_devserver

        dev_config = DevConfig(token_delay=0.02, model=DEMO_MODEL, model_override=True)
        try:
            dev_runner, dev_port, _ = await start_devserver(dev_config)
        except OSError as exc:
            raise NotStarted("demo backend failed; not started", FAILED, error=str(exc)) from None
        upstream = config.upstreams[0].model_copy(
            update={"urls": (f"http://127.0.0.1:{dev_port}",)}
        )
        config = config.model_copy(update={"upstreams": (upstream,)})
        notice = DEMO_NOTICE
        print(
            f"n-proxy: no --upstream given; demo backend on 127.0.0.1:{dev_port} "
            f'(every answer has model "{DEMO_MODEL}" and an X-N-Proxy-Demo header)',
            flush=True,
        )
    server = Server(config, notice=notice, loader=loader)
    try:
        await start(server)
        upstreams = ", ".join(f"{u.name}={'|'.join(u.urls)}" for u in config.upstreams)
        where = f"http://{config.listen.host}:{server.proxy_port}"
        admin = f", admin on port {server.admin_port}" if config.admin else ""
        banner = f"n-proxy: listening on {where} -> {upstreams}{admin}"
        await run(server, ready=lambda: print(banner, flush=True))
    finally:
        if dev_runner is not None:
            await dev_runner.cleanup()
