"""Writing files so that no crash, full disk or kill leaves one half-written.

Every file minigpt writes whole (configs, tokenizer files, metadata, exports) goes to a temporary name in the
same folder, is flushed to disk, and is then renamed over the target: readers see the old file or the new
one, never a torn one. Append-only logs (metrics.jsonl) are the exception: a torn last line is skipped when
read. Whatever is written gets the mode a plain `open()` would give it (0666 less the umask), so a run
directory made under umask 022 is readable by the other users of a shared machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from minigpt.runtime.errors import ConfigError


class RunDirBusy(ConfigError):
    """Another process trains in this run directory."""


def _umask_at_import() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: done once, before any thread of ours runs
    os.umask(mask)
    return mask


_UMASK_AT_IMPORT = _umask_at_import()


def umask() -> int:
    """The process's umask, read without changing it (Linux reports it in /proc/self/status), so no other
    thread ever creates a file under a passing value; the umask at import where /proc does not say."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return _UMASK_AT_IMPORT


def open_mode(directory: bool = False) -> int:
    """The mode a plain open() (or mkdir) would give a new file (folder) under the current umask."""
    return (0o777 if directory else 0o666) & ~umask()


def _prefix(name: str, suffix: str) -> str:
    """`.NAME.` for a temporary name that says whose it is, or just `.` where that would pass the 255-byte
    limit on a file name (a legal 254-character target must still be writable)."""
    prefix = f".{name}."
    return prefix if len(os.fsencode(prefix + suffix)) + 8 <= 255 else "."


def temporary_file(folder: str | Path, name: str, suffix: str = ".tmp") -> Path:
    """A new empty file in `folder` for the target `name`: a unique name short enough for any target, and the
    mode a plain open() would give (mkstemp's 0600 would make every file private whatever the umask)."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=_prefix(name, suffix), suffix=suffix)
    os.close(fd)
    try:
        os.chmod(tmp, open_mode())
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def temporary_folder(folder: str | Path, name: str, suffix: str = ".tmp") -> Path:
    """`temporary_file`'s folder counterpart (mkdtemp's 0700 likewise widened to what the umask allows)."""
    tmp = tempfile.mkdtemp(dir=folder, prefix=_prefix(name, suffix), suffix=suffix)
    try:
        os.chmod(tmp, open_mode(directory=True))
    except BaseException:
        os.rmdir(tmp)
        raise
    return Path(tmp)


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """A new folder to fill that is put at `path` only once the block finishes without an error (an old
    `path` is removed once the new one is in place), and removed on any error: a full disk or Ctrl-C leaves
    no half folder. Its temporary name is short and new (mkdtemp): a long `path` fits, and no folder of the
    user's is taken for it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_folder(path.parent, path.name)
    try:
        yield tmp
        if path.exists():
            old = temporary_folder(path.parent, path.name, ".old")
            path.rename(old)  # onto the empty folder just made: a name no other command holds
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """A file object for `path` that replaces it only once the block finishes without an error."""
    path = Path(path)
    tmp = temporary_file(path.parent, path.name)
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2))


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """An exclusive `flock` on `path` (made if absent), waited for and held for the block: processes, on one
    host or sharing a folder, take turns (not POSIX: no locking)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class RunDirLock:
    """One training process per run directory. An exclusive `flock` on RUN/.lock, held while the run trains:
    the kernel releases it when the process exits, however it exits, so a lock left by a killed process is
    never in the way. The file names the holder (pid, host, start time) for the refusal message; it is removed
    on release (and the run directory too, if this command made it and left it empty)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self._file: IO[str] | None = None
        self._made_dir = False

    def acquire(self) -> None:
        import socket
        import time

        self._made_dir = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = self._lock()
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        f.flush()
        self._file = f

    def _lock(self) -> IO[str]:
        """The lock file, flocked: retried when the holder removed the file between our open and our lock
        (we would hold a lock on a file no one else opens)."""
        import fcntl

        while True:
            f = open(self.path, "a+")  # noqa: SIM115 (held until release)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                f.close()
                raise RunDirBusy(
                    f"{self.path.parent} is in use by another training run ({holder}); wait for it to finish, "
                    "stop it, or choose another --run-dir"
                ) from None
            try:
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    return f
            except FileNotFoundError:
                pass
            f.close()

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()  # while still locked: whoever opens it next makes a new one
            self._file.close()  # closing the descriptor releases the flock
            self._file = None
            if self._made_dir:
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()  # only if empty: a failed first command leaves nothing

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def user_cache_dir() -> Path:
    """The folder minigpt keeps per-machine files in: $MINIGPT_CACHE_DIR, else $XDG_CACHE_HOME/minigpt
    (default ~/.cache/minigpt); the tests point MINIGPT_CACHE_DIR at a folder of their own session."""
    if folder := os.environ.get("MINIGPT_CACHE_DIR"):
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minigpt"
