"""A multi-process run's faults as one line on every process still running (watchdog.py and the lost-process
line of distributed.py): a process that never arrives, one killed with kill -9, a --dist.num-processes that
differs between processes. Where JAX's client aborted with a C++ check failure (exit 134), each surviving
process now says what happened and exits 1 within the timeout it was given. Loopback addresses only."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import TINY_FLAGS, start_cli

from minigpt.runtime import watchdog


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(corpus: Path, tmp_path: Path, port: int, of: int, me: int, *extra: str) -> subprocess.Popen:
    return start_cli(
        "train", "--data", str(corpus), "--data.cache-dir", str(tmp_path / "cache"), *TINY_FLAGS,
        "--run-dir", str(tmp_path / "run"), "--dist.coordinator", f"127.0.0.1:{port}", "--dist.num-processes",
        str(of), "--dist.process-id", str(me), "--dist.timeout-s", "10", "--mesh.cpu-devices", "1", *extra,
    )  # fmt: skip


def _one_line(proc: subprocess.Popen, err: str) -> str:
    assert proc.returncode == 1, err[-3000:]
    assert "Check failure" not in err and "@ 0x" not in err and "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("minigpt: error: ")]
    assert len(errors) == 1, err[-3000:]
    return errors[0]


def test_the_fatal_message_of_jaxs_client_becomes_a_line_saying_what_to_do() -> None:
    argv = ["train", "--dist.process-id", "1", "--dist.num-processes", "3"]
    register = [f"F1204 client.h:80] {watchdog.FATAL}. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded",
                "RPC: /xla.coordination.CoordinationService/RegisterTask"]  # fmt: skip
    assert watchdog.explain(argv, register) == (
        "minigpt: error: process 1 of 3: not every process reached the coordinator within --dist.timeout-s "
        "(DEADLINE_EXCEEDED: Deadline Exceeded); start all 3 processes, each with the same --dist.num-processes"
    )
    lost = [f"F1204 client.h:80] {watchdog.FATAL}. absl::Status: UNAVAILABLE: heartbeat timeout"]
    assert "process 1 of 3: another process of the run stopped or was lost (UNAVAILABLE" in watchdog.explain(
        argv, lost
    )
    assert watchdog.wanted(["train", "--dist.coordinator", "127.0.0.1:1"]) and not watchdog.wanted(["train"])


@pytest.mark.slow
def test_a_process_that_never_arrives_is_one_line_on_each_that_did(
    small_corpus: Path, tmp_path: Path
) -> None:
    port = _free_port()
    procs = [_train(small_corpus, tmp_path, port, 3, me, "--steps", "4") for me in (0, 1)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        line = _one_line(proc, err)
        assert "of 3: not every process reached the coordinator within --dist.timeout-s" in line, line


@pytest.mark.slow
def test_a_process_killed_with_kill_9_is_one_line_on_the_other(small_corpus: Path, tmp_path: Path) -> None:
    """Either process killed while both train; the other says so and exits 1 (it waited up to 76 s, then
    aborted with a C++ stack). Killing the process a user started ends the training it runs too."""
    for victim in (1, 0):
        port, run = _free_port(), tmp_path / str(victim)
        run.mkdir()
        procs = [
            _train(small_corpus, run, port, 2, me, "--steps", "100000", "--log-every", "1") for me in (0, 1)
        ]
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            if line.startswith("step      5/"):
                break
        procs[victim].send_signal(signal.SIGKILL)
        survivor = procs[1 - victim]
        _, err = survivor.communicate(timeout=300)
        line = _one_line(survivor, err)
        assert f"process {1 - victim} of 2: another process of the run stopped or was lost" in line, line
        assert "the run resumes from its last checkpoint" in line
        procs[victim].wait(timeout=60)


@pytest.mark.slow
def test_processes_started_with_different_process_counts_are_refused(
    small_corpus: Path, tmp_path: Path
) -> None:
    """Both say so at once: the process whose count agrees with the coordinator's learns the other's, rather
    than waiting on it until gloo gives up (30 s) with a line about a lost process."""
    port = _free_port()
    procs = [_train(small_corpus, tmp_path, port, of, me, "--steps", "4") for of, me in ((2, 0), (3, 1))]
    outs = [proc.communicate(timeout=300) for proc in procs]
    same = "but the run's coordinator counts 2; start every process with the same --dist.num-processes"
    assert procs[1].returncode == 2 and outs[1][1].strip().splitlines() == [
        f"minigpt: error: this process was started with --dist.num-processes 3, {same}"
    ], outs[1][1][-3000:]
    assert procs[0].returncode == 2 and outs[0][1].strip().splitlines() == [
        f"minigpt: error: process 1 of the run was started with --dist.num-processes 3, {same}"
    ], outs[0][1][-3000:]
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
