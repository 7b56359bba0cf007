"""Joining a multi-process run (distributed.py): a coordinator address where another program listens is one
line before JAX's client or server can abort the process with a C++ stack, and processes started with
different configs are refused at once. Loopback only; the two-process training run itself is tested in
test_sharding.py."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TINY_FLAGS, run_cli, start_cli

from minigpt.config import ConfigError, DistributedConfig
from minigpt.parallel import distributed


@pytest.fixture
def http_port() -> Iterator[int]:
    """A plain HTTP/1 server on a free loopback port, in a thread of the test."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _join(port: int, process_id: int, tmp_path) -> list[str]:
    out = run_cli("train", "--dist.coordinator", f"127.0.0.1:{port}", "--dist.num-processes", "2",
                  "--dist.process-id", str(process_id), "--dist.timeout-s", "5", "--data.cache-dir", str(tmp_path))  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Check failure" not in out.stderr and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigpt: error: "), out.stderr[-3000:]
    return lines


def test_a_coordinator_port_answered_by_an_http_server_is_one_line(http_port: int, tmp_path) -> None:
    """Process 1 finds an HTTP server where the coordinator should be; process 0 finds its port taken."""
    (line,) = _join(http_port, 1, tmp_path)
    assert "an HTTP/1 server answers there" in line and "--dist.coordinator" in line
    (line,) = _join(http_port, 0, tmp_path)
    assert f"port {http_port} of coordinator 127.0.0.1:{http_port} is already in use" in line
    assert "--dist.coordinator" in line


def test_a_silent_or_hanging_up_listener_is_not_taken_for_a_coordinator() -> None:
    """A program that accepts the connection, then says nothing or hangs up at once."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        cfg = DistributedConfig(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=1, timeout_s=1)
        with pytest.raises(ConfigError, match="does not answer as a gRPC server"):
            distributed.initialize(cfg)  # silent: accepted by the backlog, never read
        threading.Thread(target=lambda: listener.accept()[0].close(), daemon=True).start()
        with pytest.raises(ConfigError, match="does not answer as a gRPC server"):
            distributed.initialize(cfg)


@pytest.mark.slow
@pytest.mark.parametrize(("flag", "values"), [("--batch-size", ("4", "8")), ("--seed", ("0", "1"))])
def test_processes_started_with_different_configs_are_refused_at_once(
    small_corpus: Path, tmp_path: Path, flag: str, values: tuple[str, str]
) -> None:
    """Two processes that disagree on a flag once trained on without a word (and hung at the first
    evaluation): each now says which flag differs, and stops before the run directory is made."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = ["train", "--data", str(small_corpus), "--data.cache-dir", str(tmp_path / "cache"), *TINY_FLAGS,
           "--run-dir", str(tmp_path / "run"), "--dist.coordinator", f"127.0.0.1:{port}", "--dist.num-processes",
           "2", "--dist.timeout-s", "60", "--mesh.cpu-devices", "1", "--steps", "4"]  # fmt: skip
    procs = [start_cli(*run, "--dist.process-id", str(me), flag, value) for me, value in enumerate(values)]
    outs = [proc.communicate(timeout=300) for proc in procs]
    name = flag.removeprefix("--").replace("-", "_")
    differs = f"{name}: {int(values[1])!r}"
    same = f"{int(values[0])!r} on process 0); start every process with the same flags (only --dist.process-id differs)"
    assert [p.returncode for p in procs] == [2, 2], outs
    assert outs[0][1].strip().splitlines() == [
        f"minigpt: error: process 1 of the run was started with another config than process 0 ({differs} on "
        f"process 1, {same}"
    ], outs[0][1][-3000:]
    assert outs[1][1].strip().splitlines() == [
        f"minigpt: error: this process was started with another config than process 0 ({differs} here, {same}"
    ], outs[1][1][-3000:]
    assert not (tmp_path / "run").exists()
