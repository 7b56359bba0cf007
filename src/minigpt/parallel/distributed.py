"""Several processes as one run: joining through `jax.distributed`, and what each process does.

Process 0 is the main process: it alone prints, writes the run's own files and tokenizes a corpus; every
process computes, reads its own share of each batch and writes its shards of each checkpoint. Decisions that
change control flow (stop now?) are agreed by all processes, so none waits at a collective the others
skipped.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from minigpt.config import ConfigError, DistributedConfig, TrainConfig, config_differences, from_dict, to_dict

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
    num_processes = _num_processes(cfg)
    process_id = cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID")
    if not coordinator and not cfg.auto:
        return False
    if coordinator and (num_processes is None or process_id is None):
        raise ConfigError(
            "--dist.coordinator needs --dist.num-processes and --dist.process-id (or $JAX_* variables)"
        )
    if coordinator and process_id == 0:
        _check_port_free(coordinator)
    elif coordinator:
        _wait_for_coordinator(coordinator, cfg.timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A process that stops sending heartbeats counts as lost after the timeout the user gave, not JAX's 100 s.
    kwargs = {"initialization_timeout": cfg.timeout_s, "heartbeat_timeout_seconds": cfg.timeout_s}
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


def check_process_counts(cfg: DistributedConfig) -> None:
    """Refuse a run whose processes were started with different --dist.num-processes, on every process at
    once: each learns the others' counts in one collective (once the CPU is split into its devices), so
    none is left waiting, for gloo's 30 s, on a process that refused."""
    given = _num_processes(cfg) or 0  # 0: the cluster's own count
    counts = multihost_utils.process_allgather(np.array([given])).reshape(-1).tolist()
    me, n = jax.process_index(), jax.process_count()
    for i in (me, *range(n)):  # this process's own count first
        if counts[i] not in (0, n):
            who = "this process was" if i == me else f"process {i} of the run was"
            raise ConfigError(
                f"{who} started with --dist.num-processes {counts[i]}, but the run's coordinator counts {n}; "
                "start every process with the same --dist.num-processes"
            )


def check_same_config(cfg: TrainConfig) -> None:
    """Refuse, on every process at once, a run whose processes were started with different configs (a batch
    size, a seed): they would train silently on different programs until one waits at a collective the
    other never reaches. Each process's resolved config, less how it joined the run (its process id, and the
    coordinator and count, which may come from the environment and were agreed on joining), is compared
    by digest with the others'; where one differs, every process learns the configs and names the first
    difference."""
    text = json.dumps(to_dict(_comparable(cfg)), sort_keys=True)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    digests = multihost_utils.process_allgather(digest).reshape(jax.process_count(), -1)
    differ = [i for i in range(jax.process_count()) if (digests[i] != digests[0]).any()]
    if not differ:
        return
    configs = _gather_texts(text)
    me = jax.process_index()
    p = me if me in differ else differ[0]
    found = config_differences(*(from_dict(json.loads(configs[i])) for i in (0, p)))
    (name, first, other), more = found[0], f", and {len(found) - 1} more" if len(found) > 1 else ""
    who, where = (
        ("this process was", "here") if p == me else (f"process {p} of the run was", f"on process {p}")
    )
    raise ConfigError(
        f"{who} started with another config than process 0 ({name}: {other!r} {where}, {first!r} on process 0"
        f"{more}); start every process with the same flags (only --dist.process-id differs)"
    )


def _comparable(cfg: TrainConfig) -> TrainConfig:
    """`cfg` less how this process joined the run."""
    joined = dataclasses.replace(cfg.dist, coordinator=None, num_processes=None, process_id=None)
    return dataclasses.replace(cfg, dist=joined)


def _gather_texts(text: str) -> list[str]:
    """Every process's `text` (a collective): lengths first, then the bytes padded to the longest."""
    data = np.frombuffer(text.encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.array([len(data)])).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(data)] = data
    gathered = multihost_utils.process_allgather(padded).reshape(len(lengths), -1)
    return [bytes(row[:n]).decode() for row, n in zip(gathered, lengths, strict=True)]


def _num_processes(cfg: DistributedConfig) -> int | None:
    """The process count this process was started with: the flag, else $JAX_NUM_PROCESSES."""
    return cfg.num_processes or _env_int("JAX_NUM_PROCESSES")


_LOST = ("Gloo", "Connection closed by peer", "Connection reset by peer", "CoordinationService")


def lost_process(e: BaseException) -> str | None:
    """One line for an error that says another process of the run is gone (a collective whose peer closed
    its connection, the coordination service giving up); None for any other error."""
    text = str(e).strip()
    if jax.process_count() == 1 or not any(mark in text for mark in _LOST):
        return None
    why = text.splitlines()[0].split(". ")[0][:160]
    return (
        f"process {jax.process_index()} of {jax.process_count()}: another process of the run stopped or was lost "
        f"({why}); start every process again with the same command: the run resumes from its last checkpoint"
    )


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--dist.coordinator must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _check_port_free(address: str) -> None:
    """Process 0 serves the coordinator on every interface at the address's port (JAX's default bind
    address, or $JAX_COORDINATOR_BIND_ADDRESS): a port another service holds makes gRPC crash the process."""
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", f"[::]:{_host_port(address)[1]}")
    host, port = _host_port(bind)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
            s.bind((host, port))
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return  # no IPv6 here, say: JAX's own bind decides
        raise ConfigError(
            f"port {port} of coordinator {address} is already in use by another program: pick a free port "
            "with --dist.coordinator (the same on every process)"
        ) from None


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Wait for the coordinator's port to open, then check that a gRPC server answers there: JAX's client
    aborts the whole process (no exception, a C++ stack) if it cannot connect or something else answers."""
    host, port = _host_port(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2) as conn:
                _check_speaks_grpc(conn, address, min(_REPLY_S, max(1.0, deadline - time.monotonic())))
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"coordinator {address} unreachable within {timeout_s}s ({e.strerror or e}); start process 0 "
                    "first and check --dist.coordinator"
                ) from None
            time.sleep(0.5)


_REPLY_S = 10.0
"""How long a coordinator may take to send its first frame; a gRPC server sends it as soon as it accepts."""
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + empty SETTINGS


def _check_speaks_grpc(conn: socket.socket, address: str, timeout_s: float) -> None:
    """A gRPC (HTTP/2) server answers a client's preface with a SETTINGS frame (type 4, the 4th byte of the
    frame header); anything else means another program holds the port."""
    conn.settimeout(timeout_s)
    reply = b""
    try:
        conn.sendall(_HTTP2_PREFACE)
        while len(reply) < 80 and not (len(reply) >= 9 and (reply[3] == 4 or b"\n" in reply)):
            chunk = conn.recv(80 - len(reply))
            if not chunk:
                break
            reply += chunk
    except OSError:  # a timeout, or reset by the peer: whatever answered is not a gRPC server
        pass
    if len(reply) >= 9 and reply[3] == 4:
        return
    if reply:
        line = reply.split(b"\n")[0].decode("ascii", "replace").strip()
        http = reply.startswith(b"HTTP/") or b"<html" in reply.lower()
        what = f"{'an HTTP/1 server' if http else 'another service'} answers there ({line!r})"
    else:
        what = "a program accepts connections there but does not answer as a gRPC server"
    raise ConfigError(
        f"coordinator {address}: {what}, not JAX's coordinator; pick a free port with --dist.coordinator "
        "(the same on every process)"
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name} must be an integer, got {value!r}") from None
