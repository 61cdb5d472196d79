"""The benchmark's smoke run, so the harness cannot rot unnoticed. It asserts that every
scenario ran and produced its numbers; it asserts no timing (that is bench/'s job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = {"passthrough", "fanout", "stitching", "ttft", "memory"}


def test_bench_smoke_runs_every_scenario(tmp_path: Path) -> None:
    completed = subprocess.run(
        ["bash", str(ROOT / "bench" / "run"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = tmp_path / "smoke.json"
    data = json.loads(result.read_text())
    for name in SCENARIOS:
        assert data[name], f"{name} produced no measurements"
    assert data["targets"], "no target rows"


def test_many_stream_scenario_measures_every_contender(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "bench.manystream", "--streams", "8", "--steps-ms", "50",
         "--seconds", "0.5", "--warmup", "0.2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    data = json.loads((tmp_path / "manystream.json").read_text())
    contenders = {row["contender"]: row for row in data["runs"]}
    assert set(contenders) == {"direct", "aiohttp forwarder", "n-proxy n=1", "n-proxy n=4"}
    for name, row in contenders.items():
        assert row["chunks"] > 0, name
        assert row["not_started"] == 0, name
