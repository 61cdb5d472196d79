"""bench.profile's hot spots from py-spy's raw output: self and total shares per function, and
self shares per source file, the proxy's own named from the package wherever the checkout is."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from bench.profile import hot_spots, lines, perf_lines, perf_shares

ROOT = "<module> (/x/proxy/__main__.py:3);run (asyncio/runners.py:190)"
RAW = "\n".join([
    f"{ROOT};send (/co/proxy/http/connection.py:161) 6",
    f"{ROOT};stale (/co/proxy/http/connection.py:195) 2",
    f"{ROOT};feed (/v/site-packages/aiohttp/web_protocol.py:446) 1",
    f"{ROOT} 1",
    "not a stack line",
])  # fmt: skip


def test_hot_spots_rank_functions_and_files_by_their_samples(tmp_path: Path) -> None:
    raw = tmp_path / "profile.txt"
    raw.write_text(RAW)
    spots = hot_spots(raw)
    assert spots["samples"] == 10
    assert spots["self"][0] == ("send (/co/proxy/http/connection.py)", 0.6, 0.6)
    assert dict(spots["files"]) == pytest.approx(
        {"proxy/http/connection.py": 0.8, "aiohttp/web_protocol.py": 0.1, "asyncio/runners.py": 0.1}
    )
    assert dict(spots["total"])["run (asyncio/runners.py)"] == 1.0
    report = "\n".join(lines(spots))
    assert "| 80.0% | `proxy/http/connection.py` |" in report


def test_a_run_reports_its_own_profile_only(tmp_path: Path) -> None:
    """The raw folder a scenario runs in is kept between runs: a profile an earlier run recorded
    there (with ``--profile`` or ``--perf``) is not reported as a later run's."""
    from bench.__main__ import parser, run
    from bench.scenario import Scenario

    work = tmp_path / "wire"
    work.mkdir()
    (work / "profile.txt").write_text(RAW)
    (work / "perf.data").write_bytes(b"an earlier run's samples")
    scenario = Scenario("wire", "a scenario that measures nothing", lambda ctx: {}, lambda row: [])
    args = parser().parse_args(["wire"])
    results: dict[str, Any] = {"skipped": {}, "errors": {}}
    run(scenario, args, cast(Any, None), work, results)
    assert results["errors"] == {}
    assert "profile" not in results["wire"]
    assert "perf" not in results["wire"]
    assert not (work / "perf.data").exists()


PERF_REPORT = """\
# To display the perf.data header info, please use --header/--header-only options.
#
# Samples: 39K of event 'cpu-clock'
#
# Overhead  Shared Object                                  Symbol
# ........  .............................................  ......
#
    12.67%  [kernel.kallsyms]                              [k] _raw_spin_unlock_irqrestore
     6.21%  libpython3.11.so.1.0                           [.] _PyEval_EvalFrameDefault
     0.30%  compiled__mypyc.cpython-311-x86_64-linux-gnu.so  [.] CPyDef_proxy___x


"""


def test_perf_shares_are_its_reports_rows() -> None:
    """Each row of ``perf report --stdio``, its columns joined by one space; headers skipped."""
    rows = perf_shares(PERF_REPORT)
    assert [name for name, _ in rows] == [
        "[kernel.kallsyms] [k] _raw_spin_unlock_irqrestore",
        "libpython3.11.so.1.0 [.] _PyEval_EvalFrameDefault",
        "compiled__mypyc.cpython-311-x86_64-linux-gnu.so [.] CPyDef_proxy___x",
    ]
    assert [share for _, share in rows] == pytest.approx([0.1267, 0.0621, 0.003])
    report = "\n".join(perf_lines({"objects": [("[kernel.kallsyms]", 0.29)], "symbols": []}))
    assert "| 29.0% | `[kernel.kallsyms]` |" in report
