"""The demo backend's settings, and the app key its handlers read them under."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web


@dataclass(frozen=True)
class DevConfig:
    token_delay: float = 0.0
    # Benchmark baseline only: answer n>1 natively, as a server with native n would.
    native_n: bool = False
    model: str = "demo-model"
    # n-proxy's demo mode: every answer names `model`, whatever the request asked for, so an
    # answer from the demo can never pass for one from the model a client meant to reach.
    model_override: bool = False


DEFAULT_CONFIG = DevConfig()
DEV_CONFIG = web.AppKey("dev_config", DevConfig)
