"""Guards on the package's shape: the pure core does no I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "proxy"

# Planning, SSE, stitching, usage, headers and errors: literal bytes and dicts in and out.
PURE = ("plan", "sse", "stitch", "usage", "headers", "errors", "encoding", "numbers")
# What a pure module may import from outside the package: the standard library's pure parts
# and the JSON and multidict value types.
ALLOWED = frozenset({
    "__future__", "collections", "dataclasses", "enum", "functools", "itertools", "json",
    "math", "re", "typing", "zlib", "orjson", "multidict",
})  # fmt: skip


def _imports(module: str) -> set[str]:
    """The top-level names ``module`` imports, ``proxy.x`` kept whole."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
    return {n if n.startswith("proxy.") else n.split(".")[0] for n in names}


def _closure(module: str) -> dict[str, set[str]]:
    """Every package module reachable from ``module``, with what each imports."""
    seen: dict[str, set[str]] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = _imports(name)
        todo += [n.removeprefix("proxy.") for n in seen[name] if n.startswith("proxy.")]
    return seen


@pytest.mark.parametrize("module", PURE)
def test_pure_core_imports_no_io_library(module: str) -> None:
    for name, imports in _closure(module).items():
        outside = {n for n in imports if not n.startswith("proxy.")}
        assert outside <= ALLOWED, f"proxy.{name} (reached from proxy.{module}) imports " + str(
            sorted(outside - ALLOWED)
        )


def test_pure_core_list_names_real_modules() -> None:
    for module in PURE:
        assert (PACKAGE / f"{module}.py").is_file(), module
