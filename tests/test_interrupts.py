"""Ctrl-C and the worker processes a command starts (interrupts.py)."""

from __future__ import annotations

import subprocess
import sys

from conftest import subprocess_env

CHILDREN = """
import concurrent.futures, multiprocessing, signal, subprocess, sys
from minigpt.runtime import interrupts

blocked = lambda: signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
with interrupts.sparing_children():
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    worker = pool.submit(signal.pthread_sigmask, signal.SIG_BLOCK, [])
    inside = blocked()
    child = subprocess.run([sys.executable, "-c", "import signal; print(int(signal.SIGINT in "
                            "signal.pthread_sigmask(signal.SIG_BLOCK, [])))"], capture_output=True, text=True)
print(int(signal.SIGINT in worker.result()), int(child.stdout.strip()), int(inside), int(blocked()))
"""


def test_worker_processes_start_with_ctrl_c_held_off() -> None:
    """A pool worker spawned under `sparing_children` (a pool made there too: its queue starts multiprocessing's
    resource tracker, which unblocks SIGINT on its way) and a plain subprocess begin with
    SIGINT blocked, so a Ctrl-C to the process group while they still import prints no traceback there (CI
    saw one from `minigpt prepare --data.tokenize-workers 2`); the parent's own mask is restored after."""
    out = subprocess.run([sys.executable, "-c", CHILDREN], capture_output=True, text=True, env=subprocess_env(),
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["1", "1", "1", "0"], out.stdout
