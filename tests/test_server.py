"""`minigpt serve` as a user runs it: a process that says where it listens, answers curl (with the API key
from MINIGPT_API_KEY), gives greedy text equal to `minigpt generate --temperature 0`, leaves the run directory untouched, warns when it listens beyond
loopback without a key, and on SIGTERM finishes what is in flight and exits 0."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="the serve extra (pip install -e '.[serve]')")

from conftest import run_cli, start_cli

from minigpt.serve.server import bind, url


def _snapshot(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))}


KEY = "test-key"
"""The server's API key, from MINIGPT_API_KEY."""


@pytest.fixture(scope="module")
def served(chat_run: Path):
    """`minigpt serve --port 0` on the chat run, and the URL it printed; stopped by the last test."""
    before = _snapshot(chat_run)
    flags = ["--port", "0", "--engine.slots", "4", "--grace", "30", "--no-warmup"]
    proc = start_cli("serve", "--run", str(chat_run), *flags, env={"MINIGPT_API_KEY": KEY})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "ready on" in line:
            break
    found = re.search(r"http://127\.0\.0\.1:\d+", "".join(lines))
    assert found, "".join(lines) + proc.stderr.read()
    yield proc, found.group(0), before
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _curl(*args: str) -> str:
    auth = ["-H", f"Authorization: Bearer {KEY}"]
    out = subprocess.run(["curl", "-sS", "--max-time", "300", *auth, *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_gets_what_minigpt_generate_gives_greedily(served, chat_run: Path) -> None:
    _, base, _ = served
    body = json.dumps({"prompt": "Tom saw a", "max_tokens": 10, "temperature": 0})
    answer = json.loads(_curl(base + "/v1/completions", "-H", "Content-Type: application/json", "-d", body))
    out = run_cli("generate", "--run", str(chat_run), "--prompt", "Tom saw a", "--max-new-tokens", "10",
                  "--temperature", "0", "--no-stream")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Tom saw a" + answer["choices"][0]["text"] + "\n"
    assert answer["usage"]["completion_tokens"] <= 10
    events = _curl("-N", base + "/v1/chat/completions", "-H", "Content-Type: application/json", "-d",
                   json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}))  # fmt: skip
    data = [line[len("data: ") :] for line in events.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    assert json.loads(_curl(base + "/v1/models"))["data"][0]["id"] == chat_run.name
    keyless = subprocess.run(["curl", "-sS", base + "/v1/models"], capture_output=True, text=True).stdout
    assert json.loads(keyless)["error"]["code"] == "invalid_api_key"


def test_sigterm_lets_the_request_in_flight_finish_and_exits_0(served, chat_run: Path) -> None:
    proc, base, before = served
    body = json.dumps({"prompt": "Tom", "max_tokens": 100, "temperature": 0, "stream": True})
    stream = subprocess.Popen(
        ["curl", "-sS", "-N", base + "/v1/completions", "-H", f"Authorization: Bearer {KEY}",
         "-H", "Content-Type: application/json", "-d", body], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert stream.stdout.readline().startswith("data: ")  # the request is in flight
    proc.send_signal(signal.SIGTERM)
    events, _ = stream.communicate(timeout=120)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopping;" in err and "Traceback" not in err
    assert events.rstrip().endswith("data: [DONE]") and '"finish_reason": "' in events
    assert _snapshot(chat_run) == before  # served read-only
    with pytest.raises(subprocess.CalledProcessError):  # no longer listening
        subprocess.run(["curl", "-sS", "--max-time", "5", base + "/health"], capture_output=True, check=True)


def test_listening_beyond_loopback_without_a_key_warns_and_a_taken_port_is_one_line(tmp_path: Path) -> None:
    taken = bind("127.0.0.1", 0)
    try:
        port = url(taken).rsplit(":", 1)[1]
        out = run_cli("serve", "--run", str(tmp_path / "absent"), "--host", "0.0.0.0", "--port", port)
        assert "warning: serving on 0.0.0.0 without --api-key" in out.stderr
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith("minigpt: error: cannot listen on 0.0.0.0")
    finally:
        taken.close()
