"""XLA:CPU programs compiled in a child process and loaded here, as the compilation cache loads its entries.

With `allocator.keep_freed_memory` every thread of the process allocates from one malloc arena. XLA's
compiler leaves many small freed blocks in it, and every later step's allocations search through them: a
step compiled in the training process runs measurably slower than the same step loaded from the compilation
cache (a config's first run against its second). Compiled in a child, the compiler's garbage stays there.
JAX offers no public hook for where it compiles, so `use` wraps the two private functions that compile (with
and without the cache), where their signatures are the ones this was written against.

The child ends with the command, however it ends (Linux's parent-death signal, and a Ctrl-C that lands while
the command waits for it ends it at once), and a child that someone stopped (SIGSTOP) is given up after
STOPPED_S: the program is compiled in the command instead, with one warning line.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minigpt.runtime import allocator, watchdog

_HEAD = struct.Struct("<Q")
STOPPED_S = 5.0
"""How long the command waits on a child that is stopped (SIGSTOP; it never answers) before ending it."""
_TICK_S = 0.5  # how often a command waiting on its child looks at the child's state
_started: list[_Child] = []  # the one child of this process, once `use` started it
_PRIVATE = {  # jax._src.compiler's functions `use` wraps or calls, and their parameters
    "backend_compile_and_load": ["backend", "module", "executable_devices", "options", "host_callbacks"],
    "_compile_and_write_cache": [
        "backend", "computation", "executable_devices", "compile_options", "host_callbacks", "module_name",
        "cache_key",
    ],
    "_cache_write": ["cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"],
}  # fmt: skip


def _always() -> bool:
    return True


def _send(fd: int, *parts: bytes, waiting: Callable[[], bool] = _always) -> bool:
    """Write a message of `parts`; False if `waiting()`, asked while the reader takes none of it, says stop.
    (On a non-blocking `fd` a write never waits longer than the reader does.)"""
    data = memoryview(b"".join(_HEAD.pack(len(p)) + p for p in parts))
    while data:
        written = 0
        if select.select([], [fd], [], _TICK_S)[1]:
            with contextlib.suppress(BlockingIOError):
                written = os.write(fd, data[: 1 << 16])
        if not written and not waiting():
            return False
        data = data[written:]
    return True


def _read(fd: int, size: int, waiting: Callable[[], bool]) -> bytes | None:
    """`size` bytes; None at the end of the stream, or once `waiting()` (asked while none come) says stop."""
    data = bytearray()
    while len(data) < size:
        if not select.select([fd], [], [], _TICK_S)[0]:
            if not waiting():
                return None
            continue
        if not (chunk := os.read(fd, min(size - len(data), 1 << 20))):
            return None
        data += chunk
    return bytes(data)


def _receive(fd: int, n: int, waiting: Callable[[], bool] = _always) -> list[bytes] | None:
    """The next message of `n` parts; None at the end of the stream (or as `_read`)."""
    parts = []
    for _ in range(n):
        if (head := _read(fd, _HEAD.size, waiting)) is None:
            return None
        if (part := _read(fd, _HEAD.unpack(head)[0], waiting)) is None:
            return None
        parts.append(part)
    return parts


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, or a debugger's), as Linux's /proc says; False elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] in ("T", "t")


class _Child:
    """A process that compiles MLIR modules for this process's CPU devices and answers with the executables,
    serialized: one request at a time, in the order sent. It starts at the first request, so a command whose
    programs all come from the compilation cache starts none."""

    def __init__(self, cpu: Any, cpu_devices: int) -> None:
        self.cpu, self.cpu_devices = cpu, cpu_devices
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.compiled = 0
        self.stopped = False
        self._stopped_since: float | None = None

    def there(
        self, backend: Any, module: Any, devices: Any, options: Any, host_callbacks: Any
    ) -> bytes | None:
        """The program compiled in the child, serialized; None where it is for another backend, calls back
        into Python, or the child could not compile it (the caller compiles it, and meets the error there)."""
        from jax._src.interpreters import mlir

        if backend is not self.cpu or host_callbacks:
            return None
        ids = struct.pack(f"<{len(devices)}q", *(d.id for d in devices))
        with self.lock:
            reply = self._ask(mlir.module_to_bytecode(module), options.SerializeAsString(), ids)
            if reply is None or reply[0] != b"1":
                return None
            self.compiled += 1
            return reply[1]

    def _ask(self, *request: bytes) -> list[bytes] | None:
        """The child's reply; None, once and for all with one warning, if it has stopped (or was stopped)."""
        if self.stopped:
            return None
        if self.process is None:
            self._start()
        assert self.process is not None and self.process.stdin and self.process.stdout
        try:
            self._stopped_since = None
            if self.process.poll() is None:
                with contextlib.suppress(OSError):
                    if _send(self.process.stdin.fileno(), *request, waiting=self._waiting):
                        reply = _receive(self.process.stdout.fileno(), 2, self._waiting)
                        if reply is not None:
                            return reply
        except BaseException:  # Ctrl-C while it compiles: nothing will read its answer
            self.close()
            self.process = None  # a later compile (in a program that goes on) starts another
            raise
        why = "was stopped" if self._stopped_since is not None else "stopped"
        print(f"minigpt: warning: the compiler process {why}; compiling in this one", file=sys.stderr)
        self.stopped = True
        self.close()
        return None

    def _start(self) -> None:
        parent = str(os.getpid()) if threading.current_thread() is threading.main_thread() else "0"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "minigpt.runtime.compile_process", str(self.cpu_devices), parent],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": _import_path()},
            start_new_session=True,  # a terminal's Ctrl-C goes to the command, which ends the child
        )
        assert self.process.stdin is not None
        os.set_blocking(self.process.stdin.fileno(), False)  # a write waits for a stopped child no longer
        atexit.register(self.close)

    def _waiting(self) -> bool:
        """Whether to go on waiting for the child: not once it has exited, or has been stopped for STOPPED_S."""
        assert self.process is not None
        if self.process.poll() is not None:
            return False
        if not _stopped(self.process.pid):
            self._stopped_since = None
            return True
        self._stopped_since = self._stopped_since or time.monotonic()
        return time.monotonic() - self._stopped_since < STOPPED_S

    def close(self) -> None:
        """End the child: it holds nothing worth waiting for."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _import_path() -> str:
    """PYTHONPATH for the child: this minigpt's folder first, wherever this process imported it from."""
    here = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)


class _Serialized:
    """What JAX's cache writer asks of an executable: its bytes, here the child's own. An executable that was
    deserialized serializes again without its compiled kernels, which a later command would miss."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def serialize(self) -> bytes:
        return self.data


def use() -> _Child | None:
    """From now on compile this process's CPU programs in a child (one per process, started when a program is
    first compiled); call it after the CPU is split into its devices. Only where the one arena is in force
    (the `minigpt` program), in a process that runs alone on the CPU, with the JAX this was written for; None
    elsewhere."""
    import jax
    from jax._src import compiler

    if _started:
        return _started[0]
    if not allocator.one_arena() or jax.process_count() > 1 or jax.default_backend() != "cpu":
        return None
    if not all(_parameters(getattr(compiler, name, None)) == names for name, names in _PRIVATE.items()):
        return None
    _started.append(_Child(jax.devices("cpu")[0].client, jax.local_device_count("cpu")))
    _wrap(compiler, _started[0])
    return _started[0]


def _parameters(function: Any) -> list[str] | None:
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None


def _wrap(compiler: Any, child: _Child) -> None:
    """Route JAX's compiles through `child`, writing the child's own bytes to the compilation cache."""
    here = compiler.backend_compile_and_load

    def compiled(
        backend: Any, module: Any, devices: Any, options: Any, host_callbacks: Any
    ) -> tuple[Any, Any]:
        """The executable, and what the cache is to store of it."""
        serialized = child.there(backend, module, devices, options, host_callbacks)
        if serialized is None:
            executable = here(backend, module, devices, options, host_callbacks)
            return executable, executable
        return backend.deserialize_executable(serialized, devices, options), _Serialized(serialized)

    def compile_and_load(backend: Any, module: Any, devices: Any, options: Any, host_callbacks: Any) -> Any:
        return compiled(backend, module, devices, options, host_callbacks)[0]

    def compile_and_write_cache(
        backend: Any, module: Any, devices: Any, options: Any, host_callbacks: Any, name: str, key: str
    ) -> Any:
        start = time.monotonic()
        executable, entry = compiled(backend, module, devices, options, host_callbacks)
        compiler._cache_write(key, time.monotonic() - start, name, backend, entry, host_callbacks)
        return executable

    compiler.backend_compile_and_load = compile_and_load
    compiler._compile_and_write_cache = compile_and_write_cache


def _serve(cpu_devices: int, parent: int) -> None:
    """The child: compile each module it is sent until its input ends, or the command `parent` (its pid, where
    it was started from the command's main thread, whose end is the command's) ends."""
    if parent:
        watchdog.die_with_parent()
        if os.getppid() != parent:  # it ended before that took hold
            return
    requests, replies = sys.stdin.fileno(), os.dup(1)
    os.dup2(2, 1)  # anything else printed goes to stderr, not into the replies
    import jax

    jax.config.update("jax_num_cpu_devices", cpu_devices)
    backend = jax.devices("cpu")[0].client
    by_id = {d.id: d for d in backend.devices()}
    while (request := _receive(requests, 3)) is not None:
        try:
            reply = [b"1", _compile(backend, by_id, *request)]
        except Exception as e:  # answered, and met again where the caller compiles it itself
            reply = [b"0", str(e).encode()]
        try:
            _send(replies, *reply)
        except BrokenPipeError:  # the command has ended (an abort skips its exit handlers): leave quietly
            os._exit(0)


def _compile(backend: Any, by_id: dict[int, Any], module: bytes, options: bytes, ids: bytes) -> bytes:
    from jax._src.lib import xla_client

    devices = xla_client.DeviceList(tuple(by_id[i] for i in struct.unpack(f"<{len(ids) // 8}q", ids)))
    options = xla_client.CompileOptions.ParseFromString(options)
    return backend.serialize_executable(backend.compile_and_load(module, devices, options))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
