"""minigpt's per-user cache folder, and the persistent XLA compilation cache every command keeps in it.

Compiling a step takes seconds to minutes; the same program compiled by an earlier command (a resumed run,
`generate` after `train`, the next test) is read back from disk instead. JAX's own file cache writes an
entry in place and keeps the first one written under a key for good, so a command killed mid-write, or a
reader racing a writer, would leave a torn entry that every later command fails to read and never
replaces. The cache here writes each entry to a temporary name and renames it into place (readers see
nothing or a whole entry), checks a digest on reading, and answers a torn or foreign entry with a
recompile that replaces it, and one warning line.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from minigpt.runtime import files
from minigpt.runtime.errors import ConfigError
from minigpt.runtime.files import user_cache_dir

MIN_COMPILE_SECS = 0.0
"""Compiles at least this long are cached. JAX's default (1 s) would leave out most of a small model's
programs, which compile in well under a second each yet add up to seconds per command."""

_MAGIC = b"minigpt-xla-1\n"
_SUFFIX = ".xla"
JAX_READ_ERROR = "Error reading persistent compilation cache entry"
"""How JAX's warning begins when an entry that passed the digest does not decode into a program (one written
in this format by something else): it compiles the program again and replaces the entry, as for a torn one."""


class AtomicCache:
    """A folder of compiled programs, one file per key: a header, the entry's SHA-256 and the entry as JAX
    gave it. Entries appear whole (temporary name, then rename) and one that fails its digest reads as
    absent, so JAX compiles the program again and `put` replaces the bad file."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)  # the name JAX's own caches use; it logs it on reset
        self._path.mkdir(parents=True, exist_ok=True)
        self.warned = False

    def file(self, key: str) -> Path:
        return self._path / f"{key}{_SUFFIX}"

    def get(self, key: str) -> bytes | None:
        try:
            data = self.file(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._warn(
                f"cannot read the compilation cache ({e.strerror}: {e.filename or self.file(key)}); compiling instead"
            )
        n = len(_MAGIC)
        head, digest, value = data[:n], data[n : n + 32], data[n + 32 :]
        if head == _MAGIC and hashlib.sha256(value).digest() == digest:
            return value
        return self.unreadable()

    def unreadable(self) -> None:
        """Say (once) that an entry could not be used: JAX compiles its program again and `put` replaces it."""
        self._warn(
            f"unreadable entries in the compilation cache {self._path} are compiled again and replaced"
        )

    def put(self, key: str, value: bytes) -> None:
        try:
            files.write_bytes(self.file(key), _MAGIC + hashlib.sha256(value).digest() + value)
        except OSError as e:  # a full disk or a read-only folder costs the next command a compile, no more
            self._warn(
                f"cannot write to the compilation cache ({e.strerror}: {e.filename or self.file(key)})"
            )

    def _warn(self, message: str) -> None:
        """One line per process, however many entries fail."""
        if not self.warned:
            self.warned = True
            print(f"minigpt: warning: {message}", file=sys.stderr)


_chosen: list[Path | None] = []  # what `use` settled on in this process
_installed: list[AtomicCache] = []  # the cache `use` gave JAX, if any


def jax_could_not_read(message: str) -> bool:
    """Whether a warning of JAX's says it could not decode one of this cache's entries; if so it is said as
    the cache's own one line (the command's warning filter asks, rather than print JAX's two lines per entry)."""
    if not (message.startswith(JAX_READ_ERROR) and _installed):
        return False
    _installed[0].unreadable()
    return True


def use(setting: str | None = None) -> Path | None:
    """Turn the persistent compilation cache on for this process and return its folder (None: off).

    `setting` is a folder, "off", or None for the default, user_cache_dir()/xla. JAX's own configuration
    wins: with JAX_COMPILATION_CACHE_DIR set, JAX keeps its cache where and as that says; with
    JAX_ENABLE_COMPILATION_CACHE=false there is none. A default asked for after a choice (a library entry
    point after the command line's flag) keeps that choice. A folder that cannot be made is an error when
    named, and a warning (no cache) for the default."""
    import jax  # here, not above: user_cache_dir's readers (the peak FLOP/s cache) need no JAX

    if _chosen and setting is None:
        return _chosen[0]
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or not jax.config.jax_enable_compilation_cache:
        folder = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
        _chosen[:] = [Path(folder) if folder else None]
        return _chosen[0]
    folder = None if setting == "off" else Path(setting).expanduser() if setting else user_cache_dir() / "xla"
    cache = None
    if folder is not None:
        try:
            cache = AtomicCache(folder)
        except OSError as e:
            if setting:
                raise ConfigError(
                    f"--compile-cache {setting}: cannot make the folder ({e.strerror})"
                ) from None
            print(f"minigpt: warning: no compilation cache ({e.strerror}: {folder}); pass --compile-cache "
                  "DIR for another folder", file=sys.stderr)  # fmt: skip
            folder = None
    _install(cache)
    _chosen[:] = [folder]
    return folder


def _install(cache: AtomicCache | None) -> None:
    """Make `cache` JAX's persistent compilation cache (None: none). JAX offers no public way to give it a
    cache other than its own file cache, so this sets the one private attribute it reads the cache from."""
    import jax
    from jax._src import compilation_cache

    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", None if cache is None else str(cache._path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    compilation_cache._cache = cache
    _installed[:] = [cache] if cache is not None else []
