"""The ``n-proxy`` command as a new user runs it: a real process on loopback."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

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
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
            lines = process.stderr.read().splitlines()
        finally:
            if process.poll() is None:
                process.kill()
    log = [json.loads(line) for line in lines if line.startswith("{")]
    (line,) = [entry for entry in log if entry["msg"] == "request"]
    assert (line["n"], line["children"], line["status"]) == (3, 3, 200)


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
