"""The scenarios of ``python -m bench``: each module here has a ``SCENARIO``, imported by name
(so vllm's and llamacpp's imports from tests/support load only when they run)."""

import importlib

from bench.scenario import Scenario

NAMES = ("passthrough", "fanout", "stitching", "ttft", "memory", "wire", "manystream", "soak",
         "vllm", "llamacpp")  # fmt: skip
SUITE = NAMES[:5]  # against the demo backend: the default run, bench/results/latest.md


def load(name: str) -> Scenario:
    scenario: Scenario = importlib.import_module(f"bench.scenarios.{name}").SCENARIO
    return scenario
