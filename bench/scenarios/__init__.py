"""The scenarios of ``python -m bench``, each a ``Scenario`` named in capitals after it in its
module, imported by name (so vllm's and llamacpp's imports of bench/backends load only when they
run). A module may hold two: the same loop over another upstream."""

import importlib

from bench.scenario import Scenario

MODULES = {"passthrough": "passthrough", "fanout": "fanout", "stitching": "fanout",
           "ttft": "ttft", "memory": "memory", "wire": "passthrough", "manystream": "manystream",
           "soak": "soak", "vllm": "vllm", "llamacpp": "llamacpp",
           "dashboard": "dashboard", "tokens": "tokens", "reload": "reload",
           "fairness": "fairness"}  # fmt: skip
NAMES = tuple(MODULES)
SUITE = NAMES[:5]  # against the demo backend: the default run, bench/results/latest.md


def load(name: str) -> Scenario:
    scenario: Scenario = getattr(
        importlib.import_module(f"bench.scenarios.{MODULES[name]}"), name.upper()
    )
    return scenario
