"""The benchmark's smoke run, so the harness cannot rot unnoticed. It asserts that every
scenario ran and produced its numbers; it asserts no timing (that is bench/'s job).

bench/run can install nginx and wrk with apt-get (--install-tools or BENCH_APT=1): a test run
must never, even as root. Every bench command here runs with BENCH_APT=0 and an apt-get first on
its PATH that records the call and fails, and each test asserts that none came.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = {"passthrough", "fanout", "stitching", "ttft", "memory"}
# Contenders each run only where installed (nginx from Debian, the gateways by bench/run
# --install-tools into bench/.work): a smoke run has them or leaves them out.
INSTALLED = {"nginx", "sglang-router", "smg"}
# The harness is the same whichever build the proxy it runs is: .ci/run runs these once.
pytestmark = pytest.mark.one_build


@dataclass
class BenchEnv:
    env: dict[str, str]
    calls: Path  # one line per package-manager call

    def apt_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    def smoke(self, out: Path, scenario: str, *options: str) -> dict[str, Any]:
        """``python -m bench SCENARIO --smoke OPTIONS``, which must succeed: its JSON report."""
        completed = subprocess.run(
            [sys.executable, "-m", "bench", scenario, "--smoke", *options, "--out", str(out)],
            cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
        return json.loads((out / f"{scenario}.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture
def bench_env(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> BenchEnv:
    """The environment of every bench command (the in-process ones' children included)."""
    fake_bin = tmp_path_factory.mktemp("fake-bin")
    calls = fake_bin / "calls"
    for name in ("apt-get", "apt", "dpkg"):
        tool = fake_bin / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexit 1\n')
        tool.chmod(0o755)
    path = f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    monkeypatch.setenv("BENCH_APT", "0")
    monkeypatch.setenv("PATH", path)
    env = {**os.environ, "BENCH_APT": "0", "PATH": path, "PYTHONPATH": str(ROOT)}
    return BenchEnv(env, calls)


def test_bench_smoke_runs_every_scenario(tmp_path: Path, bench_env: BenchEnv) -> None:
    completed = subprocess.run(
        ["bash", str(ROOT / "bench" / "run"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=bench_env.env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    data = json.loads((tmp_path / "latest.json").read_text())
    for name in SCENARIOS:
        assert data[name], f"{name} produced no measurements"
    assert data["targets"], "no target rows"
    assert bench_env.apt_calls() == []


def test_many_stream_scenario_measures_every_contender(tmp_path: Path, bench_env: BenchEnv) -> None:
    report = bench_env.smoke(tmp_path, "manystream", "--streams", "8", "--steps-ms", "50")
    data = report["manystream"]
    contenders = {row["contender"]: row for row in data["runs"]}
    expected = {"direct", "aiohttp forwarder", "n-proxy n=1", "n-proxy n=4"}
    assert expected <= set(contenders) <= expected | INSTALLED
    for name, row in contenders.items():
        assert row["chunks"] > 0, name
        assert row["not_started"] == 0, name
    assert bench_env.apt_calls() == []


def test_many_stream_scenario_runs_the_python_pacer_and_client(
    tmp_path: Path, bench_env: BenchEnv
) -> None:
    """The Python pacer (``bench.pacer --step``) and client (``bench.streams``): every chunk
    they count comes through, with their own CPU and the contender's counts per chunk."""
    data = bench_env.smoke(
        tmp_path, "manystream", "--streams", "8", "--steps-ms", "50", "--clients", "python",
        "--pacers", "python", "--skip", "nginx,forwarder,sglang-router,smg",
    )["manystream"]  # fmt: skip
    rows = {row["contender"]: row for row in data["runs"]}
    assert set(rows) == {"direct", "n-proxy n=1", "n-proxy n=4"}
    for name, row in rows.items():
        assert (row["pacer"], row["client"]) == ("python", "python")
        assert row["chunks"] > 0, name
        assert row["not_started"] == 0, name
        assert 0.5 < row["delivered"] < 1.5, name  # a step every 50 ms, no more, no fewer
        assert row["client_cores"] >= 0, name
        assert row["writes_per_chunk"] > 0, name  # the pacer and n-proxy write with write(2)
    assert rows["n-proxy n=1"]["reads_per_chunk"] > 0  # and n-proxy reads each with read(2)
    assert {r["client"] for r in data["summary"]} == {"python"}


def test_wire_scenario_measures_every_contender(tmp_path: Path, bench_env: BenchEnv) -> None:
    """The wire scenario, tiny: nginx and wrk when installed, else the canned server and Python."""
    results = bench_env.smoke(tmp_path, "wire")
    data = results["wire"]
    served = {row["target"]: row for row in data["runs"]}
    expected = {
        "direct",
        "aiohttp forwarder",
        "lean forwarder",
        "httptools floor",
        "n-proxy",
        "n-proxy n=4",
        "n-proxy quiet",
    }
    assert expected <= set(served) <= expected | INSTALLED
    for name, row in served.items():
        assert row["requests"] > 0, name
        assert row["errors"] == 0, name
        assert row["wakeups_per_req"] >= 0, name
    # Its one loop sleeps while a request waits on the upstream: woken again, counted.
    assert served["n-proxy"]["wakeups_per_req"] > 0
    assert data["checked"]["n-proxy n=4"] == 4
    assert data["checked"]["n-proxy"] == 1
    assert [t["verdict"] for t in results["targets"]] != ["n/a"] * 3
    assert bench_env.apt_calls() == []


def test_reload_scenario_reloads_under_open_streams_and_reads_the_upstreams_peak(
    tmp_path: Path, bench_env: BenchEnv
) -> None:
    """The reload scenario, tiny: three SIGHUPs to a real n-proxy while streams are open, every
    stream whole, and the backend's peak read (no timing is asserted)."""
    (run,) = bench_env.smoke(tmp_path, "reload")["reload"]["runs"]
    assert (run["reloads"], run["streams"], run["whole"]) == (3, 4, 4)
    assert 1 <= run["peak"] <= run["bound"]


def test_fairness_scenario_times_the_victim_through_both_admissions(
    tmp_path: Path, bench_env: BenchEnv
) -> None:
    results = bench_env.smoke(tmp_path, "fairness")
    summary = results["fairness"]["summary"]
    assert {(r["flood"], r["admission"]) for r in summary} == {
        (flood, admission)
        for flood in ("8", "7-9", "4")
        for admission in ("fifo", "fair", "fair-no-grace")
    }
    for row in summary:
        assert row["victim_requests"] > 0, row
        assert row["tokens_per_s"] > 0, row
        assert row["errors"] == 0, row
    assert "n/a" not in [t["verdict"] for t in results["targets"]]
    assert bench_env.apt_calls() == []


def test_canned_fallback_server_answers_like_nginx(tmp_path: Path, bench_env: BenchEnv) -> None:
    """The Python canned upstream (used without nginx): keep-alive, pipelined, the same body."""
    from bench.pacer import BODY
    from bench.procs import Fleet, wait_ready
    from bench.stack import start_canned

    with Fleet(tmp_path / "logs") as fleet:
        server = start_canned(fleet, tmp_path, nginx=None)
        wait_ready(server, timeout=20)
        answers = _two_posts_then_health(server.port, _post(b"{}"))
        listed = _get(server.port, "/v1/models")
    for answer in answers[:2]:
        head, body = answer.split(b"\r\n\r\n", 1)
        assert b"Content-Type: application/json" in head
        assert body == BODY
    parsed = json.loads(BODY)
    assert parsed["choices"][0]["index"] == 0
    assert parsed["usage"]["total_tokens"] > 0
    assert json.loads(listed)["data"][0]["id"] == parsed["model"]
    assert bench_env.apt_calls() == []


@pytest.mark.parametrize("kind", ["native", "python"])
def test_pacer_streams_the_chunks_bench_pacer_defines(tmp_path: Path, kind: str) -> None:
    """The paced upstream, in C or in Python, writes ``bench.pacer.chunk`` for each step, ends
    each stream with the finishing chunk and the last one, answers the next request on the same
    connection, and lists the bench's model (a gateway routing by model reads it first)."""
    from bench.pacer import _FINISH, MODELS, chunk
    from bench.procs import Fleet, wait_ready
    from bench.stack import start_pacer

    with Fleet(tmp_path / "logs") as fleet:
        server = start_pacer(fleet, 0.01, "pacer", kind)
        wait_ready(server, timeout=20)
        answers = _two_posts_then_health(server.port, _post(b'{"max_tokens": 3, "stream": true}'))
        assert _get(server.port, "/v1/models") == MODELS
    for answer in answers[:2]:
        head, body = answer.split(b"\r\n\r\n", 1)
        assert b"Transfer-Encoding: chunked" in head
        chunks = []
        while body:
            size, _, rest = body.partition(b"\r\n")
            chunks.append(rest[: int(size, 16)])
            body = rest[int(size, 16) + 2 :]
        assert chunks[-1] == b""
        assert chunks[-2] == _FINISH
        stamps = [float(c[c.rindex(b'"ts":') + 5 : -3]) for c in chunks[:-2]]
        assert chunks[:-2] == [chunk(at) for at in stamps]
        assert len(stamps) == 3
        assert stamps == sorted(stamps)


@pytest.mark.parametrize("kind", ["native", "python"])
def test_pacer_closes_a_connection_that_sends_past_its_bound(tmp_path: Path, kind: str) -> None:
    """Request bytes held unanswered are bounded (1 MiB) while a stream is open, too."""
    from bench.procs import Fleet, wait_ready
    from bench.stack import start_pacer

    with Fleet(tmp_path / "logs") as fleet:
        server = start_pacer(fleet, 0.05, "pacer", kind)
        wait_ready(server, timeout=20)
        post = _post(b'{"max_tokens": 100000}')  # 83 minutes of chunks, unless it is cut
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(post)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")
            with contextlib.suppress(ConnectionError):
                sock.sendall(b"x" * (1 << 16) * 17)  # past 1 MiB, behind the open stream
            received = 0
            while data := _recv_or_reset(sock):  # chunks until the pacer closes it
                received += len(data)
                assert received < 1 << 16, "the stream went on"  # about 250 chunks, 12 s


def _recv_or_reset(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def _get(port: int, path: str) -> bytes:
    """The body of a GET's 200 answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        received = b""
        while data := sock.recv(65536):
            received += data
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return body


def _post(body: bytes) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


def _two_posts_then_health(port: int, post: bytes) -> list[bytes]:
    """``post`` twice and a health check, pipelined on one connection: the three answers, each
    200, in order."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(post * 2 + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while received.count(b"HTTP/1.1 ") < 3 or not received.endswith(b"ok\n"):
            data = sock.recv(65536)
            assert data, received
            received += data
    answers = received.split(b"HTTP/1.1 ")[1:]
    assert [a[:3] for a in answers] == [b"200"] * 3
    return answers
