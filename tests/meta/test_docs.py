"""The docs stay true to the repository: every relative link in README.md, CHANGELOG.md and docs/
resolves (its file, and its anchor to a heading), every path they name exists, every
``tests/...::test_name`` they cite is a test in that file, and every ``docs/...md#anchor`` the
code's comments and docstrings cite resolves too, while they cite no document the repository
does not have."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

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
