"""XLA:CPU programs compiled in a child process and loaded here, as the compilation cache loads its entries.

With `allocator.keep_freed_memory` every thread of the process allocates from one malloc arena. XLA's
compiler leaves many small freed blocks in it, and every later step's allocations search through them: a
step compiled in the training process runs measurably slower than the same step loaded from the compilation
cache (a config's first run against its second). Compiled in a child, the compiler's garbage stays there.
JAX offers no public hook for where it compiles, so `use` wraps the two private functions that compile (with
and without the cache), where their signatures are the ones this was written against.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from minigpt.runtime import allocator

_HEAD = struct.Struct("<Q")
_started: list[_Child] = []  # the one child of this process, once `use` started it
_PRIVATE = {  # jax._src.compiler's functions `use` wraps or calls, and their parameters
    "backend_compile_and_load": ["backend", "module", "executable_devices", "options", "host_callbacks"],
    "_compile_and_write_cache": [
        "backend", "computation", "executable_devices", "compile_options", "host_callbacks", "module_name",
        "cache_key",
    ],
    "_cache_write": ["cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"],
}  # fmt: skip


def _send(stream: BinaryIO, *parts: bytes) -> None:
    stream.write(b"".join(_HEAD.pack(len(p)) + p for p in parts))
    stream.flush()


def _receive(stream: BinaryIO, n: int) -> list[bytes] | None:
    """The next message of `n` parts; None at the end of the stream."""
    parts = []
    for _ in range(n):
        head = stream.read(_HEAD.size)
        if len(head) < _HEAD.size:
            return None
        size = _HEAD.unpack(head)[0]
        if len(part := stream.read(size)) < size:
            return None
        parts.append(part)
    return parts


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
        """The child's reply; None, once and for all with one warning, if it has stopped."""
        if self.stopped:
            return None
        if self.process is None:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "minigpt.runtime.compile_process", str(self.cpu_devices)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": _import_path()},
                start_new_session=True,  # Ctrl-C goes to the command, whose exit ends the child
            )
            atexit.register(self.close)
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                _send(self.process.stdin, *request)
                if (reply := _receive(self.process.stdout, 2)) is not None:
                    return reply
        print("minigpt: warning: the compiler process stopped; compiling in this one", file=sys.stderr)
        self.stopped = True
        self.close()
        return None

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


def _serve(cpu_devices: int) -> None:
    """The child: compile each module it is sent until its input ends."""
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
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
    _serve(int(sys.argv[1]))
