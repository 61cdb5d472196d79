"""The build (setup.py): the modules every streamed chunk runs through compiled with mypyc where
they can be, the same modules as pure Python where they cannot, and the server saying at start
which one it runs.

The wheels are built offline, with what the test environment holds (``--no-build-isolation
--no-index``: its setuptools and mypy, which the ``test`` extra pins to what the build needs), so
that the suite passes with no network."""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from proxy.http import stream_path_compiled
from tests.support.logs import capture_logs
from tests.support.servers import Backend, running_server

ROOT = Path(__file__).resolve().parents[2]
PURE_LINE = "the stream path runs as pure Python: this build compiled none of it (setup.py)"


def _setup_literal(name: str) -> Any:
    """The literal setup.py assigns to ``name``, as it is written there."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py names no {name}")


STREAM_PATH: tuple[str, ...] = tuple(_setup_literal("COMPILED"))
# Seconds for one build: mypyc type-checks and generates C before the compiler fails; on an idle
# machine it takes about 40 s, on one whose cores others hold several times that.
BUILD_TIMEOUT = 900


def _wheel(tmp_path: Path, **env: str) -> tuple[list[str], str]:
    """The wheel pip builds from a copy of this checkout's sources (no compiled files), with
    ``env``: the files it holds, and the build's output."""
    tree = tmp_path / "src"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(
        ROOT / "proxy", tree / "proxy", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    out = tmp_path / "wheels"
    offline = ["--no-deps", "--no-build-isolation", "--no-index"]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", *offline, "-w", str(out), str(tree)],
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("n_proxy-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist(), done.stdout + done.stderr


@pytest.mark.one_build
@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_a_build_whose_c_compiler_fails_is_the_pure_package_and_says_why(tmp_path: Path) -> None:
    names, said = _wheel(tmp_path, CC="false")  # mypyc runs; compiling its C fails
    assert [n for n in names if n.endswith(".so")] == []
    assert set(STREAM_PATH) <= set(names)
    assert "n-proxy build: compiling failed" in said
    assert "pure Python" in said


@pytest.mark.one_build
@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_n_proxy_pure_builds_the_pure_package_without_running_mypyc(tmp_path: Path) -> None:
    names, said = _wheel(tmp_path, N_PROXY_PURE="1")
    assert [n for n in names if n.endswith(".so")] == []
    assert set(STREAM_PATH) <= set(names)
    assert "n-proxy build: N_PROXY_PURE is set: pure Python, nothing compiled" in said


@pytest.mark.one_build
@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_mypyc_type_checks_the_stream_path_without_the_runtime_dependencies(tmp_path: Path) -> None:
    """pip builds in an isolated environment holding only ``[build-system] requires``: there
    aiohttp, multidict and the rest are missing, their classes ``Any``, and an alias built from
    them must still be a type, or mypyc exits and the install is silently the pure build. The
    offline wheels above build where they are installed, so this is the check that sees it."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            *("--config-file=", "--ignore-missing-imports"),  # setup.py's flags
            "--no-site-packages",  # as in pip's isolated build environment
            *("--cache-dir", str(tmp_path / "cache")),
            *STREAM_PATH,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_test_environment_holds_what_the_build_requires() -> None:
    """The offline builds above use this environment's own build tools: the ``test`` extra must
    pin each of pyproject.toml's ``[build-system] requires`` to a release that satisfies it."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    unmet = [
        spec
        for spec in map(Requirement, requires)
        if not spec.specifier.contains(metadata.version(spec.name), prereleases=True)
    ]
    assert unmet == [], f"installed releases do not meet {unmet}"


def test_the_stream_group_is_made_of_compiled_modules() -> None:
    """setup.py builds ``COMPILED`` in two groups, those in ``STREAM_GROUP`` and the rest: a name
    there that ``COMPILED`` lacks would split nothing off, and say so nowhere."""
    stream_group = _setup_literal("STREAM_GROUP")
    assert stream_group
    assert stream_group <= set(STREAM_PATH)
    assert len(stream_group) < len(STREAM_PATH)  # the other group is not empty either


def test_the_stream_path_is_compiled_whole_or_not_at_all() -> None:
    """setup.py compiles these modules as one group: a build holds all or none of them."""
    names = [path.removesuffix(".py").replace("/", ".") for path in STREAM_PATH]
    modules = [importlib.import_module(name) for name in names]
    built = [not (m.__file__ or "").endswith(".py") for m in modules]
    assert "proxy.http.connection" in names  # the module ``stream_path_compiled`` asks
    assert built in ([True] * len(names), [False] * len(names))
    assert stream_path_compiled() == built[0]


async def test_the_server_logs_one_line_at_start_when_it_runs_the_pure_build(
    backend: Backend,
) -> None:
    with capture_logs() as logs:
        async with running_server(backend.url):
            pass
    said = [r for r in logs.records if r.startswith(PURE_LINE)]
    assert len(said) == (0 if stream_path_compiled() else 1)


def _suspensions(body: list[ast.stmt]) -> list[int]:
    """The lines in ``body`` where its own code can suspend (a nested function's do not count)."""
    found: list[int] = []
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.Await | ast.AsyncFor | ast.AsyncWith):
            found.append(node.lineno)
        todo.extend(ast.iter_child_nodes(node))
    return sorted(found)


def test_no_compiled_module_awaits_in_an_except_or_finally_block() -> None:
    """mypyc keeps the exception a handler handles in the thread's ``sys.exc_info()``, not in
    the coroutine: a handler that suspends leaves it there for other tasks, and a ``finally``
    that awaits re-raises whatever is there once its await is over, even when nothing failed.
    Hold the failure in a variable and await after the handler
    (docs/architecture.md#working-on-a-compiled-module)."""
    found = []
    for name in STREAM_PATH:
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.Try | ast.TryStar):
                blocks = [node.finalbody, *(handler.body for handler in node.handlers)]
                found += [f"{name}:{line}" for block in blocks for line in _suspensions(block)]
    assert not found, found


def test_the_await_check_finds_an_await_in_a_finally_or_a_handler_and_not_in_a_nested_def() -> None:
    source = """
async def f():
    try:
        await a()
    except E:
        await b()
    finally:
        async with c():
            pass

        async def inner():
            await d()
"""
    (node,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Try)]
    assert _suspensions(node.handlers[0].body) == [6]
    assert _suspensions(node.finalbody) == [8]
    assert _suspensions(node.body) == [4]
