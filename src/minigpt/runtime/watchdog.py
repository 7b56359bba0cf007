"""A process of a multi-process run, watched from a small parent: JAX's coordination client ends the process
with a C++ check failure (a stack of addresses, exit 134) when another process never arrives or is lost. The
parent runs the command as its child, passes its output through, and turns such an end into one line saying
what happened and what to do. It imports nothing heavy, so it costs a Python start and no more.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

WATCHED = "MINIGPT_WATCHED"
"""Set in the child's environment: it runs the command itself."""

FATAL = "Terminating process because the JAX distributed service detected fatal errors"
_STACK = re.compile(r"^(\s+@\s+0x[0-9a-f]+|\*\*\* Check failure stack trace|\s*$)")
_COORDINATION_LOG = re.compile(r"^[IWE]\d{4} .*coordination_service")
"""The coordination agent's own log lines about the same fault ("Polled an error ..."): said in our line."""


def wanted(argv: list[str]) -> bool:
    """Whether `minigpt ARGV` is a process of a multi-process run that is not watched yet."""
    joins = any(a.startswith(("--dist.coordinator", "--dist.auto")) for a in argv)
    joins = joins or bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
    return bool(argv) and argv[0] == "train" and joins and not os.environ.get(WATCHED)


def _flag(argv: list[str], name: str, env: str) -> str:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return os.environ.get(env, "?")


def explain(argv: list[str], fatal: list[str]) -> str:
    """The one line for a child that JAX's client aborted, from the fatal message and the lines after it."""
    me, of = (
        _flag(argv, "--dist.process-id", "JAX_PROCESS_ID"),
        _flag(argv, "--dist.num-processes", "JAX_NUM_PROCESSES"),
    )
    text = " ".join(fatal)
    status = text.split("absl::Status: ", 1)[-1].split(" RPC:")[0] if "absl::Status: " in text else "lost"
    status = status.split(". ")[0].strip()[:120]
    if "RegisterTask" in text or "Barrier" in text:
        return (
            f"minigpt: error: process {me} of {of}: not every process reached the coordinator within "
            f"--dist.timeout-s ({status}); start all {of} processes, each with the same --dist.num-processes"
        )
    return (
        f"minigpt: error: process {me} of {of}: another process of the run stopped or was lost ({status}); "
        "start every process again with the same command: the run resumes from its last checkpoint"
    )


def die_with_parent() -> None:
    """In a child process (as its preexec_fn, or first in its own code): killed when its parent is (kill -9 of
    the process a user started must end the work it started; Linux's parent-death signal, elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_watched(argv: list[str]) -> int:
    """Run `minigpt ARGV` as a child and return the exit status to end with (1 for a distributed fault)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "minigpt.cli", *argv],
        stderr=subprocess.PIPE,
        env={**os.environ, WATCHED: "1"},
        text=True,
        errors="replace",
        preexec_fn=die_with_parent if sys.platform == "linux" else None,
    )
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # a terminal's Ctrl-C reaches the child too: it stops the run
    signal.signal(signal.SIGTERM, lambda sig, _: child.send_signal(sig))
    fatal: list[str] = []
    said = (
        False  # the child said what happened itself (a collective that lost its peer) before JAX aborted it
    )
    assert child.stderr is not None
    for line in child.stderr:
        if FATAL in line or (fatal and not _STACK.match(line) and len(fatal) < 3):
            fatal.append(line.strip())
        elif not (fatal and _STACK.match(line)) and not _COORDINATION_LOG.match(line):
            said = said or line.startswith("minigpt: error: ")
            sys.stderr.write(line)
            sys.stderr.flush()
    code = child.wait()
    if fatal:
        if not said:
            print(explain(argv, fatal), file=sys.stderr, flush=True)
        return 1
    return code if code >= 0 else 128 - code
