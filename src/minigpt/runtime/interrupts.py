"""Ctrl-C in the `minigpt` program: the command stops, with one line and exit status 130, wherever it lands.

Python raises KeyboardInterrupt wherever the main thread is, and some places swallow it: in a gc callback
(JAX registers one) or a `__del__` it is printed, ignored, and the command runs on to exit 0; in an import
it can surface as an ImportError; before `cli.main` is running, as a traceback. The handler here records the
request and raises KeyboardInterrupt only where it propagates to `cli.main`; elsewhere it asks again a moment
later. Only the program takes SIGINT over: code that imports minigpt (tests, lm-eval) keeps Python's own.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NoReturn

RETRY_S = 0.05
"""How soon a Ctrl-C that landed where it would be swallowed is raised again."""

_state: dict = {"installed": False, "armed": False, "requested": False, "retrying": False, "wakeup": None}
_SHIELDED: set = set()
"""Code of callbacks a foreign caller runs (XLA's host callbacks), where a raised KeyboardInterrupt would come
back as that caller's own error: they look at `requested` instead."""


def install() -> None:
    """Take SIGINT over for the rest of the process (the program's first statement: its imports take
    seconds)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _handle)
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)  # written at once, while Python waits in C
        _state.update(installed=True, wakeup=read)


def arm() -> None:
    """From here on KeyboardInterrupt reaches the command's caller: raise it now for a Ctrl-C that came before."""
    _state["armed"] = True
    check()


def check() -> None:
    """Raise KeyboardInterrupt for a Ctrl-C deferred until now (the command ended before it was raised)."""
    if _state["requested"]:
        raise KeyboardInterrupt


def disarm() -> None:
    """The command is over: a Ctrl-C during the interpreter's exit handlers has nothing left to stop."""
    _state["armed"] = False
    if _state["installed"]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def requested() -> bool:
    """Whether Ctrl-C was pressed in the program, from any thread: a loop that XLA runs while the main thread
    waits in C (where Python's handler cannot run yet) reads it from the signal's wakeup pipe."""
    # Only while Ctrl-C is ours: training's own handler makes the first one a graceful stop.
    if (
        not _state["requested"]
        and _state["wakeup"] is not None
        and signal.getsignal(signal.SIGINT) is _handle
    ):
        with contextlib.suppress(BlockingIOError):
            _state["requested"] = signal.SIGINT in os.read(_state["wakeup"], 512)
    return _state["requested"]


def never_raise_in(fn: Callable) -> None:
    """Defer a Ctrl-C that lands in `fn` (or what it calls), as in a gc callback."""
    _SHIELDED.add(fn.__code__)


@contextlib.contextmanager
def sparing_children() -> Iterator[None]:
    """Start worker processes in here: they begin with SIGINT blocked (a thread's signal mask survives fork and
    exec), so a Ctrl-C to the process group that lands while one still imports, before it can ignore SIGINT,
    prints no traceback there; the parent stops them. In this thread the signal waits for the block's end."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # its first start would unblock SIGINT in this thread
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def exit_interrupted() -> NoReturn:
    """Leave with status 130 once the command has unwound (every `finally` has run). The program skips the
    interpreter's exit handlers: JAX's crash (SIGSEGV) when a compile or a callback was cut short."""
    with contextlib.suppress(OSError):
        sys.stdout.flush()
        sys.stderr.flush()
    if _state["installed"]:
        os._exit(130)
    sys.exit(130)


def _handle(signum: int, frame: FrameType | None) -> None:
    _state["requested"] = True
    if not _state["armed"]:
        return  # `arm` raises it
    if not _swallowed(frame):
        raise KeyboardInterrupt
    if not _state["retrying"]:
        _state["retrying"] = True
        threading.Timer(RETRY_S, _again).start()


def _again() -> None:
    _state["retrying"] = False
    os.kill(os.getpid(), signal.SIGINT)


def _swallowed(frame: FrameType | None) -> bool:
    """Whether an exception raised in `frame` would be printed and dropped (a gc callback or `__del__` on the
    stack) or turned into another error (an import)."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks} | _SHIELDED
    while frame is not None:
        code = frame.f_code
        if code in callbacks or code.co_name == "__del__" or code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False
