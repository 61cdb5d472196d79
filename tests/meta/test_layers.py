"""The package's layer contract (``proxy/__init__.py`` draws it).

- Each layer imports only the layers below it, whatever form the import takes: at the top or
  inside a function, absolute or relative (``from ..request import handler`` is a reach-up too),
  under ``TYPE_CHECKING`` or not.
- A layer has a face: the names its ``__init__`` lists in ``__all__``. A module imports another
  layer's modules only through that face (``from proxy.upstream import Upstreams``), never one of
  its modules by name, so that everything else in a layer is free to change.
- The pure core imports no I/O library, the upstream HTTP client no aiohttp.
- aiohttp's private members are used in the modules ``AIOHTTP_INTERNALS`` lists only, each
  member still there on the installed aiohttp. A module is such a user when it imports a private
  aiohttp module, subclasses an aiohttp class, or reaches one of the members below, by attribute
  or by ``getattr``. ``AIOHTTP_INTERNALS`` is the one list: pyproject.toml's pin and
  docs/architecture.md name the same modules (tests/meta/test_docs.py holds them to it).
- The import graph has no cycle inside a layer either.

Every check is a function of module sources, so each is also run on literal input below.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
from collections.abc import Iterable, Mapping
from pathlib import Path

import aiohttp.base_protocol
import aiohttp.http_writer
import aiohttp.streams
import aiohttp.web_protocol
import aiohttp.web_runner
import aiohttp.web_server
import pytest
from aiohttp import web
from aiohttp.http_parser import HttpRequestParser
from aiohttp.http_writer import StreamWriter
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_urldispatcher import UrlMappingMatchInfo
from multidict import CIMultiDict

from proxy.request import parsed
from proxy.request.responses import Relayed, WholeAnswer
from proxy.server import connection

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
AIOHTTP_INTERNALS = frozenset({
    "proxy.server.connection", "proxy.request.responses", "proxy.request.sink",
    "proxy.request.parsed",
})  # fmt: skip

# Each private member of aiohttp the server uses, by the class it belongs to.
PRIVATE_MEMBERS: dict[type, tuple[str, ...]] = {
    aiohttp.web_protocol.RequestHandler: (
        "_messages", "_request_in_progress", "_force_close", "_loop", "_current_request",
        "_request_handler",
        # ClientConnection.start: aiohttp's loop over a connection's requests, without a task
        # for each.
        "_manager", "_request_factory", "_waiter", "_parser", "_buffer_paused",
        "_msg_queue_resume_size", "_resume_reading_if_drained", "_make_error_handler",
        "_handle_request", "_keepalive", "_close", "_keepalive_timeout",
        "_next_keepalive_close_time", "_keepalive_handle", "_process_keepalive",
        "_task_handler", "_lingering_time", "_logging_enabled",
        # ClientConnection._handle_request: aiohttp's step for one request, a whole answer's end
        # in it.
        "_upgraded", "_handler_waiter",
    ),
    aiohttp.web_runner.BaseSite: ("_runner", "_backlog", "_server"),
    web.StreamResponse: ("_write_headers", "_cookies"),
    web.Request: ("_prepare_hook", "_finish"),
    web.Application: ("_make_request",),  # proxy.server.connection.made_request
    web.PlainResource: ("_match",),
    # The concrete writer behind ``request.writer`` (an AbstractStreamWriter has neither) and
    # the handler's flow control, read by the client sink.
    aiohttp.http_writer.StreamWriter: ("chunked", "send_headers"),
    aiohttp.base_protocol.BaseProtocol: ("writing_paused", "_reading_paused"),
    # proxy.request.parsed.body_as_it_lies: a body that came with its head, read as it lies.
    aiohttp.streams.StreamReader: (
        "_buffer", "_eof", "_exception", "_waiter", "_buffer_offset", "_http_chunk_splits",
        "_low_water", "_size", "_cursor",
    ),
}  # fmt: skip
INSTANCE_MEMBERS = {
    web.StreamResponse: (
        "_req", "_keep_alive", "_eof_sent", "_body_length",
        # WholeAnswer.prepare, proxy.request.parsed's status_of and ClientConnection.start: what
        # the answer's properties return, each a Python call.
        "_status", "_reason", "_headers", "_compression", "_payload_writer",
        # WholeAnswer.relayed: what web.StreamResponse.__init__ sets.
        "_state",
    ),
    # WholeAnswer.relayed: a web.Response made without its __init__.
    web.Response: ("_body", "_compressed_body", "_zlib_executor_size", "_zlib_executor"),
    aiohttp.web_server.Server: ("_kwargs",),
    # proxy.server.connection.made_request: the app's, which its request factory reads.
    web.Application: ("_loop", "_client_max_size", "_client_max_fields"),
    web.Request: ("_match_info", "_task"),
    # proxy.request.parsed: what the request's cached properties return, set by its __init__;
    # WholeAnswer.prepare: what its transport and writer properties return.
    web.BaseRequest: (
        "_method", "_headers", "_rel_url", "_version", "_payload", "_message", "_protocol",
        "_payload_writer",
        # ClientConnection._handle_request: a form read, whose files _finish closes.
        "_post",
    ),
    # _prepare_hooks: the apps a request's on_response_prepare runs in.
    UrlMappingMatchInfo: ("_apps",),
}  # fmt: skip
MEMBERS = frozenset(m for ms in (*PRIVATE_MEMBERS.values(), *INSTANCE_MEMBERS.values()) for m in ms)

Sources = Mapping[str, str]  # module name -> its source


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
SOURCES = {name: path.read_text(encoding="utf-8") for name, path in MODULES.items()}


def _is_package(module: str, sources: Sources) -> bool:
    return any(name.startswith(module + ".") for name in sources)


def layer_of(module: str) -> int:
    """The module's layer index; ``len(LAYERS)`` for the top (the CLI and the package root)."""
    if module in TOP:
        return len(LAYERS)
    parts = module.split(".")
    assert len(parts) >= 2, f"{module} is in no layer"
    assert parts[1] in LAYERS, f"{module} is in no layer"
    return LAYERS.index(parts[1])


def _absolute(module: str, node: ast.ImportFrom, sources: Sources) -> str:
    """The module an ``ImportFrom`` names, a relative one resolved against ``module``."""
    if node.level == 0:
        return node.module or ""
    package = module if _is_package(module, sources) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def import_statements(module: str, sources: Sources) -> list[tuple[str, tuple[str, ...]]]:
    """Every import of ``module`` (at the top, under TYPE_CHECKING or inside a function), as the
    absolute module it names and the names it takes from it (none for ``import x``)."""
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(sources[module])):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((_absolute(module, node, sources), tuple(a.name for a in node.names)))
    return found


def imports(module: str, sources: Sources = SOURCES) -> set[str]:
    """Every module ``module`` imports, package modules as the module they name
    (``from proxy.core import plan`` imports ``proxy.core.plan``)."""
    found: set[str] = set()
    for target, names in import_statements(module, sources):
        found.add(target)
        found.update(f"{target}.{n}" for n in names if f"{target}.{n}" in sources)
    return found


def package_imports(module: str, sources: Sources = SOURCES) -> set[str]:
    return {name for name in imports(module, sources) if name in sources and name != module}


def outside_imports(module: str, *, typing_too: bool = True) -> set[str]:
    """The top-level names of what ``module`` imports from outside the package; without
    ``typing_too``, imports made only for type checking (``if TYPE_CHECKING:``) are left out."""
    names = imports(module) if typing_too else imports(module) - _typing_only(module)
    return {n.split(".")[0] for n in names if not n.startswith("proxy")}


def _typing_only(module: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(SOURCES[module])):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    found.update(alias.name for alias in inner.names)
                elif isinstance(inner, ast.ImportFrom) and inner.module:
                    found.add(inner.module)
    return found


def reach_ups(sources: Sources) -> list[str]:
    """``module -> target`` for each import of a layer above the module's own."""
    return sorted(
        f"{module} -> {target}"
        for module in sources
        for target in package_imports(module, sources)
        if layer_of(target) > layer_of(module)
    )


def _face(module: str) -> str | None:
    """The face a module of a layer is reached through (``proxy.upstream``); None at the top."""
    parts = module.split(".")
    return ".".join(parts[:2]) if module not in TOP and len(parts) >= 2 else None


def past_faces(sources: Sources, faces: Mapping[str, Iterable[str]]) -> list[str]:
    """``module -> what it took`` for each import of another layer that is not through that
    layer's face, or takes a name the face does not list (``faces``: face -> its ``__all__``)."""
    found = []
    for module in sources:
        own = _face(module)
        for target, names in import_statements(module, sources):
            face = _face(target) if target.startswith("proxy.") else None
            if face is None or face == own or (face == "proxy.devserver" and own is None):
                continue  # outside the package, inside the layer, or the CLI's demo backend
            if target != face:
                found.append(f"{module} -> {target} (not through {face})")
                continue
            listed = set(faces.get(face, ()))
            found += [
                f"{module} -> {face}.{n} (not in its __all__)" for n in names if n not in listed
            ]
    return sorted(found)


def aiohttp_internal_user(module: str, sources: Sources = SOURCES) -> bool:
    """Imports an aiohttp module past its public ``aiohttp`` / ``aiohttp.web`` faces, subclasses
    one of aiohttp's classes, or reaches a listed private member (by attribute or ``getattr``)."""
    tree = ast.parse(sources[module])
    private_modules = {
        n
        for n in imports(module, sources)
        if n.startswith("aiohttp.") and n not in ("aiohttp.web", "aiohttp.http_exceptions")
    }
    if private_modules:
        return True
    if "aiohttp" not in {n.split(".")[0] for n in imports(module, sources)}:
        return False  # another library's objects: their members are theirs
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Attribute) and ast.unparse(b).startswith("web.") for b in node.bases
        ):
            return True
        if isinstance(node, ast.Attribute) and node.attr in MEMBERS:
            return True
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in MEMBERS
        ):
            return True
    return False


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)
    assert {m.split(".")[1] for m in MODULES if m not in TOP} == set(LAYERS)


def test_each_layer_imports_only_the_layers_below_it() -> None:
    found = reach_ups(SOURCES)
    assert not found, "imports that reach up a layer: " + ", ".join(found)


def _faces() -> dict[str, list[str]]:
    return {
        f"proxy.{layer}": list(getattr(importlib.import_module(f"proxy.{layer}"), "__all__", []))
        for layer in LAYERS
    }


def test_a_layer_is_reached_only_through_its_face() -> None:
    found = past_faces(SOURCES, _faces())
    assert not found, "imports past a layer's face: " + ", ".join(found)


@pytest.mark.parametrize("layer", [layer for layer in LAYERS if layer != "devserver"])
def test_each_face_lists_what_it_holds(layer: str) -> None:
    """A face's ``__all__`` names are there, and each is used above its layer (a face is curated:
    what nothing above uses is not on it), but for its exceptions: a layer's failures are part of
    its face, as httpcore's are, whether or not a caller above catches each one today."""
    face = importlib.import_module(f"proxy.{layer}")
    listed = list(face.__all__)
    assert [n for n in listed if not hasattr(face, n)] == []
    used = {
        name
        for module in SOURCES
        if _face(module) != f"proxy.{layer}"
        for target, names in import_statements(module, SOURCES)
        if target == f"proxy.{layer}"
        for name in names
    }
    failures = {n for n in listed if _is_exception(getattr(face, n))}
    assert sorted(set(listed) - used - failures) == []


def _is_exception(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, BaseException)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("proxy.core")))
def test_the_pure_core_imports_no_io_library(module: str) -> None:
    """Type annotations may name asyncio's types; nothing runs it."""
    outside = outside_imports(module, typing_too=False)
    assert outside <= PURE_ALLOWED, f"{module} imports {sorted(outside - PURE_ALLOWED)}"


def test_the_upstream_http_client_imports_no_aiohttp() -> None:
    """Not even under TYPE_CHECKING: its failures are its own (``proxy.http.errors``)."""
    using = {m for m in MODULES if m.startswith("proxy.http") and "aiohttp" in outside_imports(m)}
    assert not using, f"aiohttp imported in {sorted(using)}"


def test_aiohttp_internals_are_used_in_the_listed_modules_only() -> None:
    users = {m for m in MODULES if not m.startswith("proxy.devserver") and aiohttp_internal_user(m)}
    assert users == AIOHTTP_INTERNALS


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

    route = web.Application().router.add_get("/", nothing)
    made = {
        web.StreamResponse: web.StreamResponse(),
        web.Response: web.Response(),
        aiohttp.web_server.Server: web.Server(nothing),
        web.Application: web.Application(),
        web.Request: make_mocked_request("GET", "/"),
        web.BaseRequest: make_mocked_request("POST", "/p?q=1", headers={"A": "b"}),
        UrlMappingMatchInfo: UrlMappingMatchInfo({}, route),
    }
    for owner, members in INSTANCE_MEMBERS.items():
        for member in members:
            assert hasattr(made[owner], member), f"{owner.__qualname__}().{member} is gone"


class _Reading:
    """A protocol as a body's reader sees it: whether, and how, it was asked to resume."""

    def __init__(self) -> None:
        self.resumed: list[bool] = []
        self._reading_paused = False

    def resume_reading(self, resume_parser: bool = True) -> None:
        self.resumed.append(resume_parser)


def _reader(pieces: list[bytes], *, eof: bool = True, chunked: bool = False) -> StreamReader:
    reader = StreamReader(_Reading(), 2**16, loop=asyncio.get_running_loop())  # type: ignore[arg-type]
    for piece in pieces:
        if chunked:
            reader.begin_http_chunk_receiving()
        reader.feed_data(piece)
        if chunked:
            reader.end_http_chunk_receiving()
    if eof:
        reader.feed_eof()
    return reader


def _state(reader: StreamReader) -> tuple[object, ...]:
    return (reader._size, reader._cursor, list(reader._buffer), reader._buffer_offset)


async def test_a_body_taken_as_it_lies_leaves_its_reader_as_read_nowait_does() -> None:
    """``body_as_it_lies`` takes a body that came whole with its head from its reader's buffer:
    the same bytes, the reader left as ``read_nowait`` leaves it; any other body (in pieces, not
    all in, chunked, past the low-water mark, with an error) is left to aiohttp's reads."""
    for pieces in ([b'{"model": "m"}'], [b"x" * 1000]):
        taken, read = _reader(pieces), _reader(pieces)
        request = make_mocked_request("POST", "/", payload=taken)
        assert parsed.body_as_it_lies(request) == read.read_nowait() == pieces[0]
        assert _state(taken) == _state(read)
        assert taken.at_eof()
    left = [
        _reader([b"a", b"b"]),
        _reader([b"ab"], eof=False),
        _reader([b"ab"], chunked=True),
        _reader([b"x" * 2**16]),
    ]
    failed = _reader([b"ab"])
    failed.set_exception(ValueError("broken"))
    for reader in [*left, failed]:
        before = _state(reader)
        assert parsed.body_as_it_lies(make_mocked_request("POST", "/", payload=reader)) is None
        assert _state(reader) == before
    assert parsed.body_as_it_lies(make_mocked_request("GET", "/")) == b""  # no body at all


@pytest.mark.parametrize(("status", "reason"), [(201, "Made"), (404, None), (599, None)])
def test_a_relayed_whole_answer_is_made_as_aiohttp_makes_a_response(
    status: int, reason: str | None
) -> None:
    """``WholeAnswer.relayed`` skips ``web.Response.__init__``: on the installed aiohttp, what
    it sets must be all that ``__init__`` sets, to the same values (a missing reason the same
    phrase, or none), its headers taken as given (``StreamResponse``'s ``_real_headers``); a
    reason with a line break is refused as aiohttp refuses it."""
    headers = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": "r"})
    made = WholeAnswer(status=status, reason=reason, headers=headers, body=b"{}")
    relayed = WholeAnswer.relayed(status, reason, headers, b"{}")
    for broken in ("A\r\nB: c", "A\nB"):
        with pytest.raises(ValueError, match="Reason cannot contain"):
            WholeAnswer.relayed(status, broken, headers, b"{}")
        with pytest.raises(ValueError, match="Reason cannot contain"):
            WholeAnswer(status=status, reason=broken, headers=headers, body=b"{}")
    assert relayed.headers is headers
    assert vars(relayed).keys() == vars(made).keys()
    for name, value in vars(made).items():
        if name != "_headers":
            assert vars(relayed)[name] == value, name
    assert relayed.headers == made.headers


@pytest.mark.parametrize("answer", [WholeAnswer, Relayed])
def test_the_proxys_answers_tell_aiohttp_they_are_no_http_exception_without_a_lookup_failing(
    answer: type[web.StreamResponse],
) -> None:
    """aiohttp asks every answer for ``__http_exception__`` with a ``getattr`` and a default:
    the classes the proxy answers with hold it, so that lookup never makes an AttributeError."""
    assert 'getattr(resp, "__http_exception__", False)' in inspect.getsource(
        RequestHandler._handle_request
    )
    assert "__http_exception__" in vars(answer)
    assert answer.__http_exception__ is False  # type: ignore[attr-defined]


def test_the_connections_loop_is_a_copy_of_the_installed_aiohttps() -> None:
    """``ClientConnection.start`` copies aiohttp's loop over a connection's requests, less the
    task it makes for each; over any other aiohttp, aiohttp's own loop serves. An upgrade that
    changes that loop fails here: port the change to the copy, then its digest."""
    assert connection.COPIES_START, "aiohttp's RequestHandler.start changed"
    assert connection.ClientConnection.start is not RequestHandler.start


async def test_a_request_made_without_its_init_is_as_the_apps_factory_makes_it() -> None:
    """``made_request`` sets what ``BaseRequest.__init__`` and ``StreamWriter.__init__`` set, to
    the same values, for the request factory of a plain app; a target that is a whole URL, and
    any other factory, are the factory's to make."""
    loop = asyncio.get_running_loop()
    app = web.Application(client_max_size=5000)
    app._loop = loop  # as the runner sets it

    async def nothing(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response()

    protocol = RequestHandler(web.Server(nothing), loop=loop)
    parser = HttpRequestParser(protocol, loop, 2**16)
    head = b"Host: h\r\nContent-Length: 2\r\n\r\n{}"
    task = asyncio.current_task()
    assert task is not None
    for target in (b"/p?q=1", b"http://other/p"):
        (message, payload), *_ = parser.feed_data(b"POST " + target + b" HTTP/1.1\r\n" + head)[0]
        made = connection.made_request(app._make_request, message, payload, protocol, task)
        writer = StreamWriter(protocol, loop)
        want = app._make_request(message, payload, protocol, writer, task)
        assert type(made) is type(want) is web.Request
        assert vars(made).keys() == vars(want).keys()
        for name, value in vars(want).items():
            if name != "_payload_writer":
                assert vars(made)[name] == value, name
        assert vars(made._payload_writer) == vars(writer)
        assert made.url == want.url
    calls = []

    def factory(*args: object) -> web.BaseRequest:
        calls.append(args)
        return want

    assert connection.made_request(factory, message, payload, protocol, task) is want
    assert len(calls) == 1


def test_another_aiohttps_loop_is_left_to_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    source = inspect.getsource(RequestHandler.start)
    monkeypatch.setattr(inspect, "getsource", lambda _: source.replace("while", "while  "))
    assert not connection._copies_start()

    def none(_: object) -> str:
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", none)
    assert not connection._copies_start()


def test_the_listed_modules_still_use_what_this_file_checks() -> None:
    """The list above stays the list of what the listed modules use: each member appears there."""
    text = "".join(SOURCES[m] for m in AIOHTTP_INTERNALS)
    assert [m for m in sorted(MEMBERS) if m not in text] == []


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
        # Importing a submodule runs its package's __init__ first: not a cycle by itself, nor is
        # a face importing the modules it presents.
        targets.difference_update({t for t in targets if module.startswith(t + ".")})
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


# The checks' own rules, on literal input.

_LITERAL = {
    "proxy": "",
    "proxy.core": "from proxy.core.url import check_url\n__all__ = ['check_url']\n",
    "proxy.core.url": "def check_url(url: str) -> str:\n    return url\n",
    "proxy.request": "from proxy.request.handler import Handler\n__all__ = ['Handler']\n",
    "proxy.request.handler": "class Handler: ...\n",
}


def test_a_relative_reach_up_inside_a_function_fails_the_contract_by_name() -> None:
    sources = dict(_LITERAL)
    sources["proxy.core.url"] += (
        "\ndef hook() -> None:\n    from ..request import handler\n    handler.Handler()\n"
    )
    assert reach_ups(sources) == [
        "proxy.core.url -> proxy.request",
        "proxy.core.url -> proxy.request.handler",
    ]
    sources["proxy.core.url"] = "from ..request.handler import Handler\n"
    assert reach_ups(sources) == ["proxy.core.url -> proxy.request.handler"]
    assert reach_ups(_LITERAL) == []


def test_an_import_past_a_face_or_of_a_name_it_does_not_list_fails_by_name() -> None:
    faces = {"proxy.core": ["check_url"], "proxy.request": ["Handler"]}
    sources = dict(_LITERAL)
    sources["proxy.request.handler"] = "from proxy.core.url import check_url\n"
    assert past_faces(sources, faces) == [
        "proxy.request.handler -> proxy.core.url (not through proxy.core)"
    ]
    sources["proxy.request.handler"] = "from proxy.core import check_url, Hidden\n"
    assert past_faces(sources, faces) == [
        "proxy.request.handler -> proxy.core.Hidden (not in its __all__)"
    ]
    sources["proxy.request.handler"] = "from ...core import check_url\n"
    assert past_faces({**sources, "proxy.request.handler": "from ..core import url\n"}, faces) == [
        "proxy.request.handler -> proxy.core.url (not in its __all__)"
    ]
    # Inside its own layer a module imports its siblings by name.
    assert past_faces({**_LITERAL, "proxy.core": "from .url import check_url\n"}, faces) == []


def test_an_aiohttp_member_reached_by_getattr_makes_a_module_an_internals_user() -> None:
    base = "from aiohttp import web\n\ndef f(request: web.Request) -> object:\n    return "
    sources = {
        "proxy.request.by_getattr": base + "getattr(request.writer, 'chunked', False)\n",
        "proxy.request.by_attribute": base + "request.protocol.writing_paused\n",
        "proxy.request.public": base + "request.transport\n",
        "proxy.request.not_aiohttps": "def f(x: object) -> object:\n    return x.chunked\n",
    }
    users = {m for m in sources if aiohttp_internal_user(m, sources)}
    assert users == {"proxy.request.by_getattr", "proxy.request.by_attribute"}


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_bench_imports_nothing_from_the_tests() -> None:
    """The bench stands on its own (the servers both run are in bench/backends/): a test may
    import the bench, never the other way round."""
    found = []
    bench = PACKAGE.parent / "bench"
    for path in sorted(bench.rglob("*.py")):
        if any(part.startswith(".") for part in path.relative_to(bench).parts):
            continue  # the bench's own venvs and work (bench/.work): not the project's code
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            found += [f"{path.name}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert found == []
