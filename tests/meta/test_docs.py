"""The docs stay true to the repository: every relative link in README.md, CHANGELOG.md and docs/
resolves (its file, and its anchor to a heading), every path they name exists, every
``tests/...::test_name`` they cite is a test in that file, and every ``docs/...md#anchor`` the
code's comments and docstrings cite resolves too, while they cite no document the repository
does not have. Every shell command they show (bench/README.md's and deploy/README.md's too) that
runs one of the project's own commands names real flags, subcommands, scenarios, markers, tests,
extras and files; and a bench report the docs cite is the one from the commit they cite."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import re
import shlex
import tokenize
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml

from bench.__main__ import parser as bench_parser
from bench.__main__ import report_stem
from bench.scenarios import NAMES as SCENARIOS
from proxy import cli
from proxy.devserver.cli import parser as devserver_parser
from tests.meta.test_layers import AIOHTTP_INTERNALS

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
# The code whose comments and docstrings are read: Python modules, and the bench's shell scripts.
# Hidden folders (the bench's venvs), caches and the bench's results are not the project's code.
CODE = sorted(
    p
    for top in ("proxy", "tests", "bench")
    for p in (ROOT / top).rglob("*")
    if p.is_file()
    and p.suffix in (".py", "")
    and not p.name.startswith(".")
    and not any(
        part.startswith((".", "__")) or part == "results" for part in p.relative_to(ROOT).parts[:-1]
    )
)

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# A path in the repository: from a top-level folder (or a root file), not inside a longer path
# or a URL; an optional ``::test_name`` (``*`` ends a prefix).
_TOPS = r"(?:proxy|tests|bench|deploy|config|docs|\.ci)/"
_PATH = re.compile(
    rf"(?<![\w./~-])((?:{_TOPS})[\w./*-]*[\w*/]|README\.md|CHANGELOG\.md|LICENSE|pyproject\.toml)"
    r"(?:::(\w+\*?))?"
)
_DOC_CITATION = re.compile(r"(?<![\w/])(docs/[\w-]+\.md)(?:#([\w-]+))?")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path.read_text("utf-8")):
        match = _HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


@cache
def defined_tests(path: Path) -> frozenset[str]:
    source = path.read_text("utf-8")
    return frozenset(re.findall(r"^\s*(?:async\s+)?def\s+(test_\w+)", source, re.MULTILINE))


def links(path: Path) -> list[str]:
    return [m.group(1) for line in prose(path.read_text("utf-8")) for m in _LINK.finditer(line)]


def cited_paths(path: Path) -> list[tuple[str, str | None]]:
    """Every repository path the file names, in prose and in its shell examples alike."""
    return [(m.group(1), m.group(2)) for m in _PATH.finditer(path.read_text("utf-8"))]


def broken_link(source: Path, target: str, root: Path = ROOT) -> str | None:
    if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto: ...: not the repository's
        return None
    where, _, anchor = target.partition("#")
    resolved = (source.parent / where).resolve() if where else source
    if not resolved.exists():
        return f"{target}: no such file"
    if not resolved.is_relative_to(root):
        return f"{target}: outside the repository"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{target}: no heading #{anchor} in {resolved.relative_to(root)}"
    return None


def missing_path(cited: str, test: str | None) -> str | None:
    matches = sorted(ROOT.glob(cited.rstrip("/"))) if "*" in cited else [ROOT / cited]
    matches = [m for m in matches if m.exists()]
    if not matches:
        return f"{cited}: no such file or folder"
    if test is None:
        return None
    names = {name for m in matches if m.is_file() for name in defined_tests(m)}
    if test.endswith("*"):
        found = any(name.startswith(test[:-1]) for name in names)
    else:
        found = test in names
    return None if found else f"{cited}::{test}: no such test"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_heading(doc: Path) -> None:
    broken = [b for target in links(doc) if (b := broken_link(doc, target)) is not None]
    assert not broken, broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_path_and_test_exists(doc: Path) -> None:
    missing = [m for cited, test in cited_paths(doc) if (m := missing_path(cited, test))]
    assert not missing, missing


def notes(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of a module (a shell script's comments), with their lines."""
    source = path.read_text("utf-8")
    if path.suffix != ".py":
        return [(n, line) for n, line in enumerate(source.splitlines(), 1) if "#" in line]
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                found.append((node.body[0].lineno, docstring))
    return found


def test_every_docs_citation_in_the_code_resolves() -> None:
    broken = []
    for path in CODE:
        for number, text in notes(path):
            for match in _DOC_CITATION.finditer(text):
                doc, anchor = ROOT / match.group(1), match.group(2)
                where = f"{path.relative_to(ROOT)}:{number}: {match.group(0)}"
                if not doc.exists():
                    broken.append(f"{where}: no such page")
                elif anchor is not None and anchor not in anchors(doc):
                    broken.append(f"{where}: no such heading")
    assert not broken, broken


# A document the reader cannot open: a spec, a revision of it, a section sign with no page or
# standard before it (RFC 9110 §9.2.2 is fine), or a ticket of a tracker the project does not have.
_UNREADABLE = re.compile(
    r"\bSPEC\b|\b[Rr]ev(?:ision)? \d\b|(?<!RFC \d{4} )(?<!RFC \d{3} )§\s?\d+|\bissues? \d+|\(#\d+\)"
)


def test_the_code_cites_only_documents_the_repository_has() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)}"
        for path in CODE
        for number, text in notes(path)
        for match in _UNREADABLE.finditer(re.sub(r"\s+", " ", text))
    ]
    assert not found, found


# The shell commands the docs show. Each line of a ```sh, ```bash or ```console block (only its
# `$ ` lines when it has any: the rest is output), each `$ ` line outside blocks, and each bench
# figure's "Command: `...`" is read as the shell would split it; every part of a chain that runs
# one of the project's commands is parsed by that command's own parser, without running it.

SHELL_DOCS = sorted({*DOCS, ROOT / "bench" / "README.md", ROOT / "deploy" / "README.md"})
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
EXTRAS = frozenset(PYPROJECT["project"]["optional-dependencies"])
SCRIPTS = frozenset(PYPROJECT["project"]["scripts"])
MARKERS = frozenset(
    re.split(r"[:(]", line, maxsplit=1)[0].strip()
    for line in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]
)

_SHELL_FENCE = re.compile(r"^\s*```(?:sh|bash|console)\s*$")
_PROMPT = re.compile(r"^\s*\$ (.*)$")
# A bench figure's stamp: its command, then (before any other command) the commit it measured.
_STAMP = re.compile(r"Command: `([^`]+)`((?:(?!Command:).)*?)Commit:\s*([0-9a-f]{7,40})", re.S)
_CHAIN = frozenset({"&&", "||", ";", "|", "&", "(", ")"})
_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
_ANGLED = re.compile(r"<[^\s<>][^<>]*>")  # a placeholder: <commit>, <that digest>


def _joined(lines: list[str]) -> list[str]:
    """Lines continued with a trailing backslash, joined."""
    joined, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            joined.append(pending + line)
            pending = ""
    return joined


def shell_commands(text: str) -> list[str]:
    """The command lines of a page's shell examples and bench stamps."""
    commands: list[str] = []
    block: list[str] = []
    shell = fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            if shell:
                prompted = [m.group(1) for b in block if (m := _PROMPT.match(b))]
                commands += _joined(prompted or block)
            fenced, block = not fenced, []
            shell = fenced and _SHELL_FENCE.match(line) is not None
        elif fenced:
            block.append(line)
        elif match := _PROMPT.match(line):
            commands.append(match.group(1))
    return commands + [m.group(1) for m in _STAMP.finditer(text)]


def _uncommented(line: str) -> str:
    """The line up to its comment: a ``#`` that starts a word, outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def simple_commands(line: str) -> list[list[str]]:
    """The words of each command a line chains (``&&``, ``|``, ``;``, a subshell's parentheses),
    then those of each command substituted in a word (``"$(pgrep -x n-proxy)"``). Placeholders
    are left out: ``<commit>``, and a word with ``...`` in it (a variable set to one stays set)."""
    lexer = shlex.shlex(_ANGLED.sub("", _uncommented(line)), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    substituted: list[list[str]] = []
    redirected = False
    for word in lexer:
        substituted += [
            c for inner in re.findall(r"\$\(([^()]*)\)", word) for c in simple_commands(inner)
        ]
        if word in _CHAIN:
            commands.append([])
        elif set(word) <= set("<>&") and set(word) & set("<>"):
            redirected = True  # ``> file``: neither the redirection nor its file is an argument
        elif redirected:
            redirected = False
        elif "..." not in word or _ASSIGNMENT.match(word):
            commands[-1].append(word)
    return [c for c in commands if c] + substituted


def _arguments(words: list[str]) -> list[str]:
    """The arguments, optional ones unbracketed (``[--skip nginx]``)."""
    words = [word.removeprefix("[") for word in words]
    return [word[:-1] if word.endswith("]") and "[" not in word else word for word in words]


def _parsed(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace | str | None:
    """``args`` parsed by ``parser``: its namespace, argparse's complaint when it refuses them,
    or None when they only ask for help or the version."""
    said = io.StringIO()
    with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parser.parse_args(args)
        except SystemExit as exit:
            return said.getvalue().strip().splitlines()[-1] if exit.code else None


def _proxy_parser(args: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    if args[:1] == ["check-config"]:
        return cli._check_config_parser(), args[1:]
    if args[:1] == ["config-schema"]:
        return cli._schema_parser(), args[1:]
    return cli._parser(), args


def _pytest_errors(args: list[str], parser: pytest.Parser) -> list[str]:
    try:
        options, unknown = parser.parse_known_and_unknown_args(args)
    except pytest.UsageError as exc:
        return [str(exc)]
    errors: list[str | None] = [f"no option {word}" for word in unknown]
    for target in options.file_or_dir:
        path, _, test = str(target).partition("::")
        errors.append(missing_path(path, test.partition("[")[0] or None))
    used = set(re.findall(r"\w+", options.markexpr or "")) - {"and", "or", "not"}
    errors += [f"-m {name}: no such marker in pyproject.toml" for name in sorted(used - MARKERS)]
    return [e for e in errors if e]


def _program(words: list[str]) -> tuple[str, list[str], set[str]]:
    """The program a command runs, without a venv's ``bin/`` (``pytest``), or the module a Python
    runs (``-m bench``); its arguments; the variables set for it (``N_PROXY_VLLM_PYTHON=...``)."""
    given = set()
    while len(words) > 1 and _ASSIGNMENT.match(words[0]):
        given.add(words[0].partition("=")[0])
        words = words[1:]
    program, args = re.sub(r"^.*/bin/", "", words[0]), _arguments(words[1:])
    if re.fullmatch(r"python[\d.]*", program) and args[:1] == ["-m"] and len(args) > 1:
        return f"-m {args[1]}", args[2:], given
    return program, args, given


def _bench(program: str, args: list[str]) -> argparse.Namespace | str | None:
    """A bench command's arguments, parsed (``bench/run`` takes ``--install-tools`` itself)."""
    if program == "bench/run":
        args = [a for a in args if a != "--install-tools"]
    return _parsed(bench_parser(), args)


def _needed(config: Path) -> set[str]:
    """The variables a config's ``${NAME}`` placeholders need: it does not load without them."""
    values = json.dumps(yaml.safe_load(config.read_text("utf-8")))
    return set(re.findall(r"\$\{(\w+)\}", values))


def command_errors(line: str, pytest_parser: pytest.Parser) -> list[str]:
    """What is wrong with the project's commands in one command line."""
    errors: list[str | None] = []
    moved = False  # after a ``cd`` in the line, relative paths are not the repository's
    for words in simple_commands(line):
        program, args, given = _program(words)
        moved = moved or program == "cd"
        parsed: argparse.Namespace | str | None = None
        if program in ("n-proxy", "-m proxy"):
            parsed = _parsed(*_proxy_parser(args))
            configs = [ROOT / a for a in args if a.endswith(".yaml") and (ROOT / a).is_file()]
            unset = {name for config in configs for name in _needed(config)} - given
            errors += [f"{name} not set, and the config needs it" for name in sorted(unset)]
        elif program in ("n-proxy-devserver", "-m proxy.devserver"):
            parsed = _parsed(devserver_parser(), args)
        elif program in ("bench/run", "-m bench"):
            parsed = _bench(program, args)
            if isinstance(parsed, argparse.Namespace):
                errors += [f"no scenario {s}" for s in parsed.scenarios if s not in SCENARIOS]
        elif program in ("pytest", "-m pytest"):
            errors += _pytest_errors(args, pytest_parser)
        elif program in ("pip", "pip3", "-m pip") and args[:1] == ["install"]:
            extras = [
                e for a in args if (m := re.fullmatch(r"\.\[(.*)\]", a)) for e in m[1].split(",")
            ]
            errors += [f"no extra {e} in pyproject.toml" for e in extras if e not in EXTRAS]
        elif program == "pidof" and "-x" not in args:  # it matches the interpreter, not these
            errors += [f"pidof finds no {a}: pgrep -x {a} does" for a in args if a in SCRIPTS]
        elif program not in ("bash", "sh"):
            continue
        errors.append(parsed if isinstance(parsed, str) else None)
        if not moved:
            paths = [a.partition("=")[2] if a.startswith("-") else a for a in args]
            errors += [missing_path(p, None) for p in paths if _PATH.fullmatch(p) and "::" not in p]
    return [f"{line.strip()}: {e}" for e in errors if e]


@pytest.mark.parametrize("doc", SHELL_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shell_command_names_real_flags_files_and_tests(
    doc: Path, pytestconfig: pytest.Config
) -> None:
    commands = shell_commands(doc.read_text("utf-8"))
    broken = [e for line in commands for e in command_errors(line, pytestconfig._parser)]
    assert not broken, broken


def stamped_commit(report: Path) -> str | None:
    """The commit a bench report's stamp says the proxy ran at."""
    match = re.search(r"proxy at (?:commit )?([0-9a-f]{7,40})", report.read_text("utf-8"), re.I)
    return None if match is None else match.group(1)


def stamp_mismatches(text: str, results: Path) -> list[str]:
    """Each bench figure's stamped commit against the report its command writes, where that
    report is committed."""
    found = []
    for match in _STAMP.finditer(text):
        command, commit = match.group(1), match.group(3)
        for words in simple_commands(command):
            program, args, _ = _program(words)
            parsed = _bench(program, args) if program in ("bench/run", "-m bench") else None
            if not isinstance(parsed, argparse.Namespace) or parsed.out is not None:
                continue
            report = results / f"{report_stem(parsed)}.md"
            ran = stamped_commit(report) if report.exists() else None
            if ran is not None and not (ran.startswith(commit) or commit.startswith(ran)):
                found.append(f"`{command}` at {commit}, but {report.name} is from {ran}")
    return found


@pytest.mark.parametrize("doc", SHELL_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_cited_bench_figure_is_from_the_commit_of_its_committed_report(doc: Path) -> None:
    mismatches = stamp_mismatches(doc.read_text("utf-8"), ROOT / "bench" / "results")
    assert not mismatches, mismatches


def test_the_modules_named_for_aiohttp_internals_are_those_the_layer_test_holds() -> None:
    """pyproject.toml's reason for ``aiohttp<4`` and architecture.md's house rule name the
    modules that use aiohttp's internals: those ``AIOHTTP_INTERNALS`` lists."""
    pyproject = (ROOT / "pyproject.toml").read_text("utf-8")
    architecture = (ROOT / "docs" / "architecture.md").read_text("utf-8")
    reason = re.search(r"((?:[ \t]*#.*\n)+)[ \t]*\"aiohttp[<>=]", pyproject)
    rule = re.search(r"\*\*The layer contract\.\*\*(.*?)\n- ", architecture, re.S)
    assert reason is not None
    assert rule is not None
    for text in (reason.group(1), rule.group(1)):
        named = {
            p.removesuffix(".py").replace("/", ".") for p in re.findall(r"proxy/[\w/]+\.py", text)
        }
        assert named == AIOHTTP_INTERNALS, text


# The checker's own rules, on literal input.


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Stream start", "stream-start"),
        ("Best of", "best-of"),
        ("Replicas and failover", "replicas-and-failover"),
        ("`--workers` and limits", "--workers-and-limits"),
        ("Workers, limits (and more)", "workers-limits-and-more"),
        ("log_level", "log_level"),
    ],
)
def test_slug_is_githubs_anchor(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_headings_in_code_blocks_are_not_anchors(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```sh\n# a comment\n```\n\n## Title\n", "utf-8")
    assert anchors(page) == {"title", "title-1"}


def test_a_missing_file_heading_path_or_test_is_reported(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    page = root / "docs" / "page.md"
    page.write_text("# Here\n\n## Over there\n", "utf-8")
    (root / "README.md").write_text("# Front\n", "utf-8")
    (tmp_path / "outside.md").write_text("# Out\n", "utf-8")
    assert broken_link(page, "#here", root) is None
    assert broken_link(page, "page.md#over-there", root) is None
    assert broken_link(page, "../README.md#front", root) is None
    assert broken_link(page, "#there", root) == "#there: no heading #there in docs/page.md"
    assert broken_link(page, "nowhere.md", root) == "nowhere.md: no such file"
    assert broken_link(page, "../../outside.md", root) == "../../outside.md: outside the repository"
    assert broken_link(page, "https://example.invalid/x", root) is None
    assert missing_path("tests/meta/test_docs.py", "test_slug_is_githubs_anchor") is None
    assert missing_path("tests/meta/test_docs.py", "test_slug_*") is None
    assert missing_path("tests/meta/test_docs.py", "test_nothing_like_this") is not None
    assert missing_path("tests/meta/no_such_file.py", None) is not None
    assert missing_path("tests/*/test_docs.py", None) is None


def test_paths_are_found_in_prose_and_commands_but_not_inside_urls(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See `tests/core/test_sse.py::test_x*` and bench/run.\n"
        "```sh\ncd deploy/kubernetes/overlays/vllm\n```\n"
        "[a](https://example.invalid/proxy/x) and ../proxy/y and /tmp/tests/z\n",
        "utf-8",
    )
    assert cited_paths(page) == [
        ("tests/core/test_sse.py", "test_x*"),
        ("bench/run", None),
        ("deploy/kubernetes/overlays/vllm", None),
    ]


def test_commands_are_read_from_shell_blocks_prompts_and_bench_stamps() -> None:
    page = (
        "```sh\nn-proxy --upstream http://127.0.0.1:8000 \\\n  --port 9000   # a comment\n```\n"
        "```console\n$ n-proxy check-config my.yaml\nmy.yaml: ok (1 upstreams, 0 routes)\n```\n"
        '```json\n{"n": 2}\n```\n'
        "$ bash .ci/run\n"
        "Command: `python -m bench wire --rounds 3` (DIR a checkout).\nCommit: 0ef9823.\n"
    )
    assert shell_commands(page) == [
        "n-proxy --upstream http://127.0.0.1:8000    --port 9000   # a comment",
        "n-proxy check-config my.yaml",
        "bash .ci/run",
        "python -m bench wire --rounds 3",
    ]
    assert simple_commands(
        "(cd /tmp/np && A=1 B='x y' .venv/bin/pytest -q | tee out) > log  # it's a note"
    ) == [["cd", "/tmp/np"], ["A=1", "B=x y", ".venv/bin/pytest", "-q"], ["tee", "out"]]
    assert simple_commands('kill -HUP "$(pgrep -x n-proxy)"') == [
        ["kill", "-HUP", "$(pgrep -x n-proxy)"],
        ["pgrep", "-x", "n-proxy"],
    ]


@pytest.mark.parametrize(
    "line",
    [
        "n-proxy --upstream http://127.0.0.1:8000 --port 9000 --log-level warning  # it's fine",
        "CHAT_API_KEY=... n-proxy --config config/full.yaml && n-proxy config-schema > s.json",
        "python -m proxy --version; n-proxy check-config /etc/n-proxy/config.yaml",
        "n-proxy-devserver --port 8000 --token-delay 0.01",
        "bench/run --install-tools wire && python -m bench wire [--skip nginx] --baseline DIR",
        "git worktree add /tmp/np-before <commit>",
        "(cd /tmp/np-before && .venv/bin/pip install -q -e '.[fast]') && pip install '.[otel]'",
        "N_PROXY_VLLM_PYTHON=/x .venv/bin/pytest -m 'vllm and not core' tests/backends",
        "pytest tests/core/test_usage.py::test_prompt_counted_once_and_completions_summed",
        'kill -HUP "$(pgrep -x n-proxy)"',
    ],
)
def test_a_good_command_passes(line: str, pytestconfig: pytest.Config) -> None:
    assert command_errors(line, pytestconfig._parser) == []


@pytest.mark.parametrize(
    ("line", "wrong"),
    [
        ("n-proxy --upstream http://127.0.0.1:8000 --max_n 16", "unrecognized arguments: --max_n"),
        ("n-proxy check-config my.yaml --strict", "unrecognized arguments: --strict"),
        ("n-proxy --config config/nothing.yaml", "config/nothing.yaml: no such file"),
        ("n-proxy check-config config/full.yaml", "CHAT_API_KEY not set, and the config needs it"),
        ("n-proxy-devserver --token-delay 0.01 --tokens 3", "unrecognized arguments: --tokens"),
        ("bench/run --install-tools wier", "no scenario wier"),
        ("python -m bench wire --rounds three", "argument --rounds: invalid"),
        ("A=1 .venv/bin/pytest -m vlm tests/backends/test_vllm.py", "-m vlm: no such marker"),
        (".venv/bin/pytest tests/core/test_usage.py::test_nope", "::test_nope: no such test"),
        (".venv/bin/pytest --no-such-option", "no option --no-such-option"),
        (".venv/bin/pip install -e '.[tests]'", "no extra tests in pyproject.toml"),
        ("bash .ci/nothing", ".ci/nothing: no such file"),
        ('kill -HUP "$(pidof -s n-proxy)"', "pidof finds no n-proxy"),
    ],
)
def test_a_bad_flag_file_scenario_marker_test_or_extra_is_reported(
    line: str, wrong: str, pytestconfig: pytest.Config
) -> None:
    [error] = command_errors(line, pytestconfig._parser)
    assert wrong in error


def test_a_cited_figure_from_another_commit_than_its_report_is_reported(tmp_path: Path) -> None:
    (tmp_path / "latest.md").write_text("Command: `bench/run`\nproxy at commit 97f3463\n", "utf-8")
    (tmp_path / "wire.md").write_text("n-proxy at commit dbbb885; baseline at 10d161d\n", "utf-8")
    page = (
        "Command: `python -m bench` (what `bench/run` runs). Commit: 0ef9823. Date: today.\n"
        "Command: `python -m bench wire --rounds 3 --baseline DIR`. Commit:\ndbbb885.\n"
        "Command: `python -m bench wire --name obscost-on`. Commit: 0ef9823 (not committed).\n"
    )
    assert stamp_mismatches(page, tmp_path) == [
        "`python -m bench` at 0ef9823, but latest.md is from 97f3463"
    ]
