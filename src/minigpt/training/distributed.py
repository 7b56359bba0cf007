"""Several processes as one run: joining through `jax.distributed`, and what each process does.

Process 0 is the main process: it alone prints, writes the run's own files and tokenizes a corpus; every
process computes, reads its own share of each batch and writes its shards of each checkpoint. Decisions that
change control flow (stop now?) are agreed by all processes, so none waits at a collective the others
skipped.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from minigpt.config import ConfigError, DistributedConfig

T = TypeVar("T")


def is_main() -> bool:
    """Whether this process prints and writes the run's own files (config, metrics, plots, samples)."""
    return jax.process_index() == 0


def say(*args: object) -> None:
    """Print on the main process only, so a run of several processes logs each line once."""
    if is_main():
        print(*args, flush=True)


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is true on any of them (a collective: all processes must call it)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def smallest(value: int) -> int:
    """The smallest of every process's `value`, on every process (a collective: all processes must call it)."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.array([value]))))


def main_first(fn: Callable[[], T]) -> T:
    """Run `fn` on the main process, then on the others once it is done (e.g. tokenize once into a shared
    cache, then let the others open the result)."""
    if jax.process_count() == 1:
        return fn()
    result = fn() if is_main() else None
    multihost_utils.sync_global_devices("minigpt: main process done")
    return result if is_main() else fn()


def initialize(cfg: DistributedConfig) -> bool:
    """Join a multi-process run through `jax.distributed` (flags, then $JAX_* variables, or auto-detection).

    Returns whether this is a multi-process run. Must run before anything touches the devices. On CPU the
    processes exchange collectives through gloo."""
    coordinator = cfg.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = cfg.num_processes or _env_int("JAX_NUM_PROCESSES")
    process_id = cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID")
    if not coordinator and not cfg.auto:
        return False
    if coordinator and (num_processes is None or process_id is None):
        raise ConfigError(
            "--dist.coordinator needs --dist.num-processes and --dist.process-id (or $JAX_* variables)"
        )
    if coordinator and process_id != 0:
        _wait_for_coordinator(coordinator, cfg.timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {"initialization_timeout": cfg.timeout_s}
    if coordinator:
        kwargs |= {
            "coordinator_address": coordinator,
            "num_processes": num_processes,
            "process_id": process_id,
        }
    try:
        jax.distributed.initialize(**kwargs)
    except Exception as e:
        where = f"coordinator {coordinator}" if coordinator else "the cluster's coordinator"
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"could not join the distributed run via {where} within {cfg.timeout_s}s: {first_line}"
        ) from None
    return jax.process_count() > 1


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Probe the coordinator's port first: JAX's client aborts the whole process (no exception) if it cannot
    connect, which would leave the user a C++ stack trace instead of a reason."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--dist.coordinator must be host:port, got {address!r}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"coordinator {address} unreachable within {timeout_s}s ({e.strerror or e}); start process 0 "
                    "first and check --dist.coordinator"
                ) from None
            time.sleep(0.5)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name} must be an integer, got {value!r}") from None
