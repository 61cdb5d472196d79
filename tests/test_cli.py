"""The ``n-proxy`` command as a new user runs it: a real process on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.cli import main


def test_demo_mode_serves_n3_and_drains_on_sigterm() -> None:
    command = [sys.executable, "-m", "proxy", "--port", "0", "--admin-port", "0"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            assert process.stderr is not None
            banner = [process.stdout.readline(), process.stdout.readline()]
            assert "demo backend" in banner[0]
            found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", banner[1])
            assert found, banner
            body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "n": 3}
            request = urllib.request.Request(
                found.group(1) + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                answer = json.load(response)
            assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
            for _ in range(5):  # n=1: passed through, for the log's durations below
                single = urllib.request.Request(
                    found.group(1) + "/v1/chat/completions",
                    data=json.dumps({**body, "n": 1}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(single, timeout=10) as response:
                    assert len(json.load(response)["choices"]) == 1
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
            lines = process.stderr.read().splitlines()
        finally:
            if process.poll() is None:
                process.kill()
    log = [json.loads(line) for line in lines if line.startswith("{")]
    requests = [entry for entry in log if entry["msg"] == "request"]
    assert [(r["n"], r["children"], r["status"]) for r in requests] == [(3, 3, 200)] + [
        (1, 0, 200)
    ] * 5
    # Timed finer than uvloop's loop.time(), which moves in whole milliseconds.
    assert any(r["duration_ms"] != round(r["duration_ms"]) for r in requests)


def test_check_config_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("upstreams: [{name: a, url: 'http://127.0.0.1:8000'}]\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstreams: [{name: a, url: 'http://127.0.0.1:8000'}, {name: b, url: nope}]\n")
    assert main(["check-config", str(good)]) == 0
    assert main(["check-config", str(bad)]) == 1
    assert "upstreams[1].url: not a URL" in capsys.readouterr().err


def test_bad_flag_value_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--upstream", "http://127.0.0.1:1", "--max-n", "500"]) == 2
    assert "--max-n" in capsys.readouterr().err


@pytest.mark.parametrize(
    "example", sorted((Path(__file__).parent.parent / "config").glob("*.yaml"))
)
def test_shipped_config_examples_pass_check_config(
    example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAT_API_KEY", "example-key")
    assert main(["check-config", str(example)]) == 0


async def test_workers_share_one_port_and_metrics_add_up(make_backend: Any) -> None:
    backend = await make_backend()
    port, admin = free_port(), free_port()
    command = [
        sys.executable, "-m", "proxy", "--upstream", backend.url, "--workers", "2",
        "--port", str(port), "--admin-port", str(admin),
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        banners = [(await process.stdout.readline()).decode() for _ in range(2)]
        assert len({re.findall(r"pid \d+", banner)[0] for banner in banners}) == 2
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}
        async with aiohttp.ClientSession() as http:
            for _ in range(20):
                # a fresh connection each time, so the kernel spreads them over the workers
                async with http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json=body,
                    headers={"Connection": "close"},
                ) as response:
                    assert response.status == 200
            async with http.get(f"http://127.0.0.1:{admin}/metrics") as response:
                text = await response.text()
        total = sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "n_proxy_requests_total"
        )
        assert total == 20
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 15) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 2),
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
    ids=["v2-unlimited", "v2-1.5", "v2-0.5", "v1-1", "v1-unlimited", "none"],
)
def test_workers_auto_is_the_cgroup_cpu_quota_within_the_affinity(
    tmp_path: Path, files: dict[str, str], expected: int | None
) -> None:
    from proxy.workers import available_cpus

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path) == (affinity if expected is None else min(expected, affinity))


def test_workers_flag_takes_auto_or_a_positive_count() -> None:
    from proxy.cli import _parser
    from proxy.workers import available_cpus

    assert _parser().parse_args(["--workers", "auto"]).workers == available_cpus()
    assert _parser().parse_args(["--workers", "3"]).workers == 3
    with pytest.raises(SystemExit):
        _parser().parse_args(["--workers", "0"])
