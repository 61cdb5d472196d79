"""What a scenario is (a plugin of ``python -m bench``) and what the driver hands it: its options,
the tools found, and a Context that starts n-proxy (and the baseline beside it) and the servers."""

import argparse
import contextlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.load import Loader, Tool
from bench.procs import Fleet, Server, settle, wait_ready
from bench.profile import perf_recording, recording
from bench.report import Row
from bench.stack import PROXY_CONFIG, start_proxy

PROXY = "n-proxy"
BASELINE = "baseline"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _option(default: Any, help: str, parse: Callable[[str], Any] | None = None) -> Any:
    """An Options field with what its flag says in --help and how it reads its value."""
    return field(default=default, metadata={"help": help, "parse": parse or type(default)})


@dataclass(frozen=True)
class Options:
    """The options of every scenario, declared once: each is a flag of ``python -m bench``
    (``max_tokens``: ``--max-tokens``; a true one also ``--no-warm-up``). Each scenario reads those
    it needs, with its own defaults (``Scenario.full`` and ``.smoke``) under these."""

    rounds: int = _option(1, "rounds, each contender once per round")
    seconds: float = _option(3.0, "per measurement (soak: all of it)")
    concurrency: tuple[int, ...] = _option((16,), "comma-separated levels, or clients", _ints)
    n: tuple[int, ...] = _option((1,), "comma-separated n (fanout, vllm, ...)", _ints)
    max_tokens: int = _option(16, "tokens per choice")
    reps: int = _option(10, "repetitions (ttft, vllm streams, llamacpp)")
    streams: tuple[int, ...] = _option((200,), "open streams (manystream, memory)", _ints)
    warm_up: bool = _option(True, "a warm-up before measuring (default: yes)")
    workers: int = _option(2, "passthrough: also n-proxy with --workers N (1: not)")
    steps_ms: tuple[int, ...] = _option((50, 20), "manystream: the pacer's decode steps", _ints)
    retry_on: tuple[str, ...] = _option(("connect", "reset"), "llamacpp: n-proxy's retry_on",
                                        lambda text: tuple(text.split(",")))  # fmt: skip
    clients: tuple[str, ...] = _option(
        ("native",),
        "manystream: native (C), python (asyncio, line by line)",
        lambda text: tuple(text.split(",")),
    )
    pacers: tuple[str, ...] = _option(("native",), "manystream: native (C), python (asyncio)",
                                      lambda text: tuple(text.split(",")))  # fmt: skip


@dataclass(frozen=True)
class Tools:
    """What the driver found (None: not installed, or left out with --skip)."""

    nginx: str | None
    wrk: str | None
    litellm: str | None
    prometheus: str | None  # the dashboard scenario's
    tool: Tool  # the load generator: wrk, or bench.load as a process
    py_spy: str | None  # --profile
    perf: str | None = None  # --perf
    gateways: Mapping[str, str] = field(default_factory=dict)  # sglang-router, smg: their binaries


@dataclass
class Context:
    options: Options
    tools: Tools
    args: argparse.Namespace  # what runs: --skip, --env, --baseline
    fleet: Fleet
    work: Path  # this scenario's scratch folder (configs, wrk scripts, py-spy stacks)
    stack: contextlib.ExitStack
    skipped: dict[str, str]

    @property
    def loader(self) -> Loader:
        return Loader(self.tools.tool, self.options.seconds, self.work, self.tools.wrk)

    def wants(self, contender: str) -> bool:
        return contender not in self.args.skip

    def trees(self, upstream: str) -> dict[str, tuple[Path | None, dict[str, str]]]:
        """Which n-proxy runs, keyed "n-proxy" and "baseline": its checkout (None: this one) and
        environment (--env, for this tree only; ``{upstream}`` in a value is the upstream's URL)."""
        env = {k: v.replace("{upstream}", upstream) for k, v in self.args.env.items()}
        found: dict[str, tuple[Path | None, dict[str, str]]] = {PROXY: (None, env)}
        if self.args.baseline is not None:
            found[BASELINE] = (self.args.baseline, {})
        return found

    def proxies(
        self, upstream: str, suffix: str = "", config: str = PROXY_CONFIG
    ) -> dict[str, Server]:
        """Each of ``trees`` as a server in front of ``upstream``; launched only (``ready``)."""
        return {
            label: start_proxy(self.fleet, self.work, upstream, label + suffix, checkout=tree,
                               config=config, env=env)
            for label, (tree, env) in self.trees(upstream).items()
        }  # fmt: skip

    def ready(
        self, servers: Mapping[str, Server], optional: Collection[str] = ()
    ) -> dict[str, Server]:
        """Wait until each answers; an ``optional`` one that does not is skipped and noted. With
        --profile, py-spy starts recording n-proxy once it is up; with --perf, perf does."""
        up: dict[str, Server] = {}
        for name, server in servers.items():
            if not any(server is seen for seen in up.values()):  # one server, two contenders
                try:
                    wait_ready(server)
                except RuntimeError as exc:
                    if name not in optional:
                        raise
                    self.skipped[name] = f"did not start: {exc}"[:300]
                    self.fleet.stop(server)
                    continue
                if self.tools.py_spy and name == PROXY:  # server.name has a suffix (manystream)
                    out = self.work / "profile.txt"
                    self.stack.enter_context(recording(self.tools.py_spy, server.pid, out))
                if self.tools.perf and name == PROXY:
                    out = self.work / "perf.data"
                    self.stack.enter_context(perf_recording(self.tools.perf, server.pid, out))
            up[name] = server
        return up

    def rounds(
        self, contenders: Iterable[str], cases: Sequence[Row], one: Callable[[str, Row], Row],
        label: str = "target",
    ) -> list[Row]:  # fmt: skip
        """``one(contender, case)`` for every case in every round (``case["round"]`` says which),
        the contenders in a rotated order (none always runs first, or last), each once every
        server is idle; a row each, with the contender (under ``label``) and the case."""
        names, rows = list(contenders), []
        for turn in range(self.options.rounds):
            k = turn % len(names) if names else 0
            for case in ({"round": turn, **c} for c in cases):
                for name in names[k:] + names[:k]:
                    settle(self.fleet.servers)
                    rows.append({label: name, **case, **one(name, case)})
        return rows


@dataclass(frozen=True)
class Scenario:
    """``run`` measures and returns what goes into the JSON (its ``summary`` included), ``render``
    turns that into Markdown lines, ``targets`` checks it against the goals. ``full`` and
    ``smoke`` are its Options defaults: a real run, and a tiny one of seconds for CI."""

    name: str
    title: str
    run: Callable[[Context], Row]
    render: Callable[[Row], list[str]]
    targets: Callable[[Row], list[Row]] = lambda _: []
    full: Mapping[str, Any] = field(default_factory=dict)
    smoke: Mapping[str, Any] = field(default_factory=dict)
