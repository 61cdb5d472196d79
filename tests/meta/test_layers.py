"""The package's layer contract (``proxy/__init__.py`` draws it): each layer imports only the
layers below it, the pure core imports no I/O library, the upstream HTTP client no aiohttp, and
aiohttp's private members are used in three modules only, each of them still there on the
installed aiohttp. The import graph has no cycle inside a layer either."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import aiohttp.base_protocol
import aiohttp.http_writer
import aiohttp.web_protocol
import aiohttp.web_runner
import aiohttp.web_server
import pytest
from aiohttp import web

PACKAGE = Path(__file__).resolve().parents[2] / "proxy"

# Low to high. ``proxy``, ``proxy.__main__`` and ``proxy.cli`` sit above them all.
LAYERS = ("core", "config", "observe", "http", "upstream", "request", "server", "devserver")
TOP = frozenset({"proxy", "proxy.__main__", "proxy.cli"})

# What the pure core may import from outside the package: the standard library's pure parts and
# the JSON and multidict value types.
PURE_ALLOWED = frozenset({
    "__future__", "collections", "dataclasses", "enum", "functools", "itertools", "json",
    "math", "re", "typing", "zlib", "orjson", "multidict", "urllib", "ipaddress",
})  # fmt: skip

# The modules where the server leans on aiohttp's internals (the members below).
AIOHTTP_INTERNALS = frozenset(
    {"proxy.server.connection", "proxy.request.passthrough", "proxy.request.sink"}
)

# Each private member of aiohttp the server uses, by the class it belongs to.
PRIVATE_MEMBERS: dict[type, tuple[str, ...]] = {
    aiohttp.web_protocol.RequestHandler: (
        "_messages", "_request_in_progress", "_force_close", "_loop", "_current_request",
    ),
    aiohttp.web_runner.BaseSite: ("_runner", "_backlog", "_server"),
    web.StreamResponse: ("_write_headers",),
    web.PlainResource: ("_match",),
    # The concrete writer behind ``request.writer`` (an AbstractStreamWriter has neither) and
    # the handler's flow control, read by the client sink.
    aiohttp.http_writer.StreamWriter: ("chunked", "send_headers"),
    aiohttp.base_protocol.BaseProtocol: ("writing_paused",),
}  # fmt: skip
INSTANCE_MEMBERS = {web.StreamResponse: ("_req",), aiohttp.web_server.Server: ("_kwargs",)}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """The module's layer index; ``len(LAYERS)`` for the top (the CLI and the package root)."""
    if module in TOP:
        return len(LAYERS)
    parts = module.split(".")
    assert len(parts) >= 2, f"{module} is in no layer"
    assert parts[1] in LAYERS, f"{module} is in no layer"
    return LAYERS.index(parts[1])


def imports(module: str) -> set[str]:
    """Every name ``module`` imports (at the top, under TYPE_CHECKING or inside a function),
    package modules as the module they name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            for alias in node.names:  # ``from proxy.core import plan``
                if f"{node.module}.{alias.name}" in MODULES:
                    found.add(f"{node.module}.{alias.name}")
    return found


def package_imports(module: str) -> set[str]:
    return {name for name in imports(module) if name in MODULES and name != module}


def outside_imports(module: str, *, typing_too: bool = True) -> set[str]:
    """The top-level names of what ``module`` imports from outside the package; without
    ``typing_too``, imports made only for type checking (``if TYPE_CHECKING:``) are left out."""
    names = imports(module) if typing_too else imports(module) - _typing_only(module)
    return {n.split(".")[0] for n in names if not n.startswith("proxy")}


def _typing_only(module: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    found.update(alias.name for alias in inner.names)
                elif isinstance(inner, ast.ImportFrom) and inner.module:
                    found.add(inner.module)
    return found


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)
    assert {m.split(".")[1] for m in MODULES if m not in TOP} == set(LAYERS)


def test_each_layer_imports_only_the_layers_below_it() -> None:
    reach_ups = sorted(
        (module, target)
        for module in MODULES
        for target in package_imports(module)
        if layer_of(target) > layer_of(module)
    )
    assert not reach_ups, "imports that reach up a layer: " + ", ".join(
        f"{m} -> {t}" for m, t in reach_ups
    )


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("proxy.core")))
def test_the_pure_core_imports_no_io_library(module: str) -> None:
    """Type annotations may name asyncio's types; nothing runs it."""
    outside = outside_imports(module, typing_too=False)
    assert outside <= PURE_ALLOWED, f"{module} imports {sorted(outside - PURE_ALLOWED)}"


def test_the_upstream_http_client_imports_no_aiohttp() -> None:
    """Not even under TYPE_CHECKING: its failures are its own (``proxy.http.errors``)."""
    using = {m for m in MODULES if m.startswith("proxy.http") and "aiohttp" in outside_imports(m)}
    assert not using, f"aiohttp imported in {sorted(using)}"


def _aiohttp_internal_user(module: str) -> bool:
    """Imports an aiohttp module past its public ``aiohttp`` / ``aiohttp.web`` faces, or
    subclasses one of aiohttp's classes."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    private_modules = {
        n
        for n in imports(module)
        if n.startswith("aiohttp.") and n not in ("aiohttp.web", "aiohttp.http_exceptions")
    }
    subclasses = any(
        isinstance(node, ast.ClassDef)
        and any(
            isinstance(b, ast.Attribute) and ast.unparse(b).startswith("web.") for b in node.bases
        )
        for node in ast.walk(tree)
    )
    return bool(private_modules) or subclasses


def test_aiohttp_internals_are_used_in_the_listed_modules_only() -> None:
    users = {
        m for m in MODULES if not m.startswith("proxy.devserver") and _aiohttp_internal_user(m)
    }
    assert users <= AIOHTTP_INTERNALS, (
        f"aiohttp internals used in {sorted(users - AIOHTTP_INTERNALS)}"
    )


@pytest.mark.parametrize(
    ("owner", "member"), [(o, m) for o, members in PRIVATE_MEMBERS.items() for m in members]
)
def test_each_private_aiohttp_member_the_server_uses_is_still_there(
    owner: type, member: str
) -> None:
    """On the installed aiohttp: an upgrade that renames one fails here, by name."""
    in_slots = any(member in getattr(cls, "__slots__", ()) for cls in owner.__mro__)
    assert in_slots or hasattr(owner, member), f"{owner.__qualname__}.{member} is gone"


async def test_each_private_aiohttp_attribute_the_server_reads_is_still_set() -> None:
    async def nothing(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response()

    made = {
        web.StreamResponse: web.StreamResponse(),
        aiohttp.web_server.Server: web.Server(nothing),
    }
    for owner, members in INSTANCE_MEMBERS.items():
        for member in members:
            assert hasattr(made[owner], member), f"{owner.__qualname__}().{member} is gone"


def test_the_listed_modules_still_use_what_this_file_checks() -> None:
    """The list above stays the list of what the listed modules use: each member appears there."""
    text = "".join(MODULES[m].read_text() for m in AIOHTTP_INTERNALS)
    members = [m for ms in (*PRIVATE_MEMBERS.values(), *INSTANCE_MEMBERS.values()) for m in ms]
    assert [m for m in members if m not in text] == []
    assert inspect.isclass(aiohttp.web_protocol.RequestHandler)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle() -> None:
    graph = {m: package_imports(m) for m in MODULES}
    for module, targets in graph.items():
        # Importing a submodule runs its package's __init__ first: not a cycle by itself.
        targets.difference_update({t for t in targets if module.startswith(t + ".")})
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
