"""The distribution as pip sees it: its license, metadata and the requirements it declares."""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
import subprocess
import sysconfig
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import proxy

ROOT = Path(__file__).resolve().parents[2]
# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt, the text the SPDX id names.
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def _project() -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    return project


def test_license_file_is_the_full_apache_2_0_text_that_pyproject_declares() -> None:
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_0_SHA256
    project = _project()
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    # PEP 639: a license expression and License :: classifiers together are an error.
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_aiohttp_is_held_below_4_and_admits_the_installed_release() -> None:
    """The server leans on aiohttp's internals, which no major release promises to keep; the
    members it uses are checked one by one on the installed release (``test_layers.py``)."""
    (aiohttp,) = [r for r in map(Requirement, _project()["dependencies"]) if r.name == "aiohttp"]
    assert not aiohttp.specifier.contains("4.0.0")
    assert aiohttp.specifier.contains(importlib.metadata.version("aiohttp"))


def test_classifiers_name_every_python_the_package_allows() -> None:
    project = _project()
    classifiers = project["classifiers"]
    assert classifiers == sorted(classifiers)
    allowed = SpecifierSet(project["requires-python"])
    versions = [c.rsplit(" :: ", 1)[1] for c in classifiers if re.search(r":: 3\.\d+$", c)]
    assert versions == ["3.11", "3.12", "3.13"]
    assert all(allowed.contains(f"{v}.0") for v in versions)
    assert "Programming Language :: Python :: 3 :: Only" in classifiers


def test_project_urls_are_absolute_https_urls() -> None:
    urls = _project()["urls"]
    assert {"Homepage", "Repository", "Issues"} <= set(urls)
    for url in urls.values():
        parts = urlsplit(url)
        assert parts.scheme == "https"
        assert parts.hostname


def test_the_import_name_proxy_is_this_distributions_alone_and_its_scripts_run() -> None:
    """The package keeps the import name ``proxy``, which another distribution (``proxy.py``)
    also takes: in this environment only n-proxy provides it, the ``proxy`` imported is this
    checkout's, and each console script resolves into it and runs."""
    providers = importlib.metadata.packages_distributions()
    assert set(providers["proxy"]) == {"n-proxy"}
    assert Path(proxy.__file__).resolve().parent == ROOT / "proxy"
    scripts = {
        ep.name: ep
        for ep in importlib.metadata.distribution("n-proxy").entry_points
        if ep.group == "console_scripts"
    }
    assert set(scripts) == set(_project()["scripts"]) == {"n-proxy", "n-proxy-devserver"}
    for name, entry in scripts.items():
        assert entry.module.split(".")[0] == "proxy"
        assert callable(entry.load())
        done = subprocess.run(
            [str(Path(sysconfig.get_path("scripts")) / name), "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("usage: "), done.stdout
