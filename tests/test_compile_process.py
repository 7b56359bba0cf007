"""compile_process: the `minigpt` program compiles its CPU programs in a child process and runs them here."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import jax
import pytest
from conftest import TINY_FLAGS, run_on_devices_logged, start_cli

from minigpt.runtime import compile_process

TRAIN_STEPS = """
import json, sys
{before}
import jax
jax.config.update("jax_enable_compilation_cache", False)  # every program compiled, none read back
from minigpt.runtime import compile_process
from minigpt.config import DataConfig, MeshConfig, ModelConfig, TrainConfig
from minigpt.optim.optimizer import ConstantSchedule
from minigpt.tools.bench import compile_step, time_steps

child = compile_process.use()
model = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=1, d_ff=64, max_seq_len=16)
cfg = TrainConfig(model=model, data=DataConfig(seq_len=16), batch_size=4, mesh=MeshConfig(data=1, fsdp=-1),
                  schedule=ConstantSchedule(warmup_steps=0, peak_lr=3e-3))
losses = [float(time_steps(compile_step(cfg), 0, 1)[1]["loss"]) for _ in range(2)]
out = {{"losses": losses, "child": child is not None, "compiled": child.compiled if child else 0}}
if child:
    child.process.kill()
    child.process.wait()
    out["after_stop"] = float(time_steps(compile_step(cfg), 0, 1)[1]["loss"])
    out["compiled_after_stop"] = child.compiled
print(json.dumps(out))
"""


def test_the_program_compiles_in_a_child_to_the_same_steps_and_compiles_here_once_it_stops() -> None:
    """With the program's one malloc arena, the train step (two devices, FSDP, state donated) and its state's
    initialisation compile in the child, and run here to the very losses a step compiled here reaches. If the
    child stops, compiling carries on in this process, with one warning."""
    there, err = run_on_devices_logged(
        TRAIN_STEPS.format(before="from minigpt.runtime import allocator; allocator.keep_freed_memory()"),
        devices=2,
    )
    here, _ = run_on_devices_logged(TRAIN_STEPS.format(before=""), devices=2)
    assert there["child"] and not here["child"]
    assert there["compiled"] >= 4  # each compile_step: the initialisation and the train step, at least
    assert there["losses"] == here["losses"]
    assert there["after_stop"] == here["losses"][0]
    assert there["compiled_after_stop"] == there["compiled"]
    assert err.count("the compiler process stopped; compiling in this one") == 1, err[-2000:]


def test_without_the_one_arena_programs_compile_in_this_process() -> None:
    """Code that imports minigpt (this test process) keeps its own malloc settings and compiler: no child."""
    from jax._src import compiler

    before = compiler.backend_compile_and_load
    assert compile_process.use() is None
    assert compiler.backend_compile_and_load is before
    assert jax.jit(lambda x: x * 2)(3) == 6


def _children(pid: int) -> dict[int, str]:
    """Process `pid`'s children and their command lines (Linux's /proc)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                found[int(child)] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return found


def _run_watching(*args: str, env: dict) -> list[int]:
    """Run `minigpt ARGS` to its end; the compiler processes it had while it ran."""
    proc, compilers = start_cli(*args, env=env), []
    while proc.poll() is None:
        with contextlib.suppress(OSError):
            compilers += [
                p for p, cmd in _children(proc.pid).items() if "minigpt.runtime.compile_process" in cmd
            ]
        time.sleep(0.05)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return sorted(set(compilers))


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from Linux's /proc")
def test_minigpt_train_compiles_in_its_child_for_the_cache_and_leaves_no_process(
    small_corpus: Path, tmp_path: Path
) -> None:
    """A first run starts the child at its first compile (after it has split the CPU) and ends it; the cache
    entries it wrote (every program, from an empty cache) run in the next command, which has nothing to
    compile and starts no child."""
    env = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    train = ["train", "--data", str(small_corpus), "--data.cache-dir", str(tmp_path / "cache"), "--run-dir",
             str(tmp_path / "run"), "--steps", "6", "--eval-every", "3", "--sample-tokens", "4", *TINY_FLAGS,
             "--model.dtype", "float32", "--peak-tflops", "1"]  # no machine probe: its programs are never cached  # fmt: skip
    first = _run_watching(*train, env=env)
    assert len(first) == 1, first
    deadline = time.monotonic() + 30
    while Path(f"/proc/{first[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{first[0]}").exists(), "the compiler process outlived minigpt train"
    assert _run_watching(*train, "--overwrite", env=env) == []


STOPPED_CHILD = """
import json, os, signal, time
from minigpt.runtime import allocator; allocator.keep_freed_memory()
import jax, jax.numpy as jnp
jax.config.update("jax_enable_compilation_cache", False)
from minigpt.runtime import compile_process

child = compile_process.use()
first = float(jax.jit(lambda x: x * 2 + 1)(jnp.float32(1)))  # compiled in the child
pid, before = child.process.pid, child.compiled
os.kill(pid, signal.SIGSTOP)
start = time.monotonic()
second = float(jax.jit(lambda x: x * 3 - 1)(jnp.float32(1)))  # the child never answers it
print(json.dumps({"values": [first, second], "waited": time.monotonic() - start, "ended": not os.path.exists(f"/proc/{pid}"),
                  "compiled": [before, child.compiled]}))
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from Linux's /proc")
def test_a_stopped_child_is_ended_and_the_program_compiled_here() -> None:
    """A compiler process someone stopped (SIGSTOP) never answers: the command waits STOPPED_S for it, not
    forever, then ends it and compiles the program itself, with one warning."""
    out, err = run_on_devices_logged(STOPPED_CHILD, devices=1)
    assert out["values"] == [3.0, 2.0] and out["ended"]
    assert out["compiled"][0] >= 1 and out["compiled"][1] == out["compiled"][0]  # the second compiled here
    assert out["waited"] >= compile_process.STOPPED_S
    assert err.count("minigpt: warning: the compiler process was stopped; compiling in this one") == 1, err


def _ended(pid: int) -> bool:
    """Whether process `pid` is gone (or dead, not yet reaped: a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] == "Z"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from Linux's /proc")
def test_ctrl_c_while_the_child_compiles_ends_the_command_and_the_child(
    small_corpus: Path, tmp_path: Path
) -> None:
    """Ctrl-C while `minigpt train` waits for its compiler process (stopped here, so that its compile never
    ends by itself) ends the command at once, with one line and status 130, and the child with it."""
    env = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    train = ["train", "--data", str(small_corpus), "--data.cache-dir", str(tmp_path / "cache"), "--run-dir",
             str(tmp_path / "run"), "--steps", "6", *TINY_FLAGS, "--model.dtype", "float32", "--peak-tflops", "1"]  # fmt: skip
    proc, compilers = start_cli(*train, env=env), []
    while not compilers and proc.poll() is None:
        with contextlib.suppress(OSError):
            compilers = [
                p for p, cmd in _children(proc.pid).items() if "minigpt.runtime.compile_process" in cmd
            ]
        time.sleep(0.02)
    assert compilers, proc.communicate()[1][-3000:]
    os.kill(proc.pid, signal.SIGSTOP)  # held where it waits for its first program, while the child is stopped
    os.kill(compilers[0], signal.SIGSTOP)
    os.kill(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGCONT)
    try:
        _, err = proc.communicate(timeout=300)
        deadline = time.monotonic() + 30  # what ends it is immediate; this bounds a slow machine's scheduling
        while not _ended(compilers[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        ended = _ended(compilers[0])
    finally:  # a test that fails leaves nothing behind
        proc.kill()
        with contextlib.suppress(OSError):
            os.kill(compilers[0], signal.SIGKILL)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "minigpt: interrupted", err[-3000:]
    assert "Traceback" not in err
    assert ended, "the compiler process outlived the interrupted command"
