"""Keep the memory of one training step for the next: glibc's malloc, told not to hand large blocks back.

XLA:CPU allocates a step's temporary buffers (hundreds of MB for the presets) when the step starts and frees
them when it ends. glibc serves blocks that large with mmap and returns them with munmap, so every step
touches fresh pages and the kernel zero-fills each one on its first write: a minor fault per 4 KiB page,
half a second of kernel time per step of the tutorial preset. One arena, no mmap and no trimming keep those
pages mapped and reused instead (the process keeps its peak memory, which the next step needs anyway).

The price of one arena: native code that allocates from many threads at once takes turns on its lock (the
tokenizers library's BPE trainer runs 3x slower), so such work runs in a fresh process (`one_arena`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters (malloc.h)
_applied = False


def one_arena() -> bool:
    """Whether `keep_freed_memory` applied in this process: every thread's malloc shares one lock."""
    return _applied


def keep_freed_memory() -> bool:
    """Set glibc's malloc to reuse freed blocks rather than return them to the kernel; True if it applied.

    Call it before JAX starts: threads created before it keep the arenas they have, whose large blocks would
    still be mmapped. A no-op (False) outside Linux's glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    global _applied
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))
    _applied = all(mallopt(param, value) == 1 for param, value in settings)
    return _applied
