"""What the `minigpt` command writes to stderr: every mistake and warning of ours as one line, and the noise of
the libraries underneath (Orbax's shutdown tracebacks, absl and asyncio logs) kept off the terminal."""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import warnings
from typing import Any

from minigpt.runtime import compile_cache
from minigpt.runtime.errors import DataWarning


def quiet_stderr() -> None:
    """Route this process's warnings and library logs through the one-line filters below (the CLI's start)."""
    warnings.showwarning = show_warning
    logging.getLogger("absl").setLevel(logging.CRITICAL)  # Orbax's internal warnings and errors: ours say it
    # A save that fails (a full disk) fails in several of Orbax's write tasks at once, one per device's shard;
    # asyncio logs each one left unawaited with its traceback. The one-line CheckpointSaveError says it.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    # huggingface_hub logs through a handler of its own; absl's root handler would print each line again.
    logging.getLogger("huggingface_hub").propagate = False
    if not sys.stderr.isatty():  # a log file: a download says what it fetches in a line, not a bar's redraws
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    sys.stderr = NoiseFilter(sys.stderr)


def show_warning(
    message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """Our own warnings (bad bytes replaced, suspiciously long documents) read like our errors: one line; so does
    JAX's about a compilation-cache entry it could not decode."""
    if issubclass(category, DataWarning):
        print(f"minigpt: warning: {message}", file=sys.stderr)
    elif compile_cache.jax_could_not_read(str(message)):
        return  # said as the cache's one line
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def first_message(box: str) -> str:
    """The first section of tyro's error box (between its title and its first rule), as one line. The box is
    drawn in Unicode or, on terminals that lack it, in ASCII."""
    lines = [line.strip().strip("│|+╭╮╰╯").strip() for line in box.splitlines()]
    lines = [line for line in lines if line]
    is_rule = [not line.strip("─-═= ") for line in lines]
    if not any(is_rule):
        return f"{' '.join(lines) or 'could not parse the flags'} (see --help)"
    sections: list[list[str]] = [[]]
    for line, rule in zip(lines[1:], is_rule[1:], strict=True):
        if rule and sections[-1]:
            sections.append([])
        elif not rule:
            sections[-1].append(line)
    nearest = [s for s in sections if s and s[0].startswith("Perhaps you meant")]
    flags = [line.split()[0] for line in nearest[0][1:] if line.startswith("--")] if nearest else []
    guess = f"; did you mean {' or '.join(dict.fromkeys(flags))}?" if flags else ""
    return f"{' '.join(sections[0])}{guess} (see --help)"


def os_error(e: OSError) -> str:
    """An OSError as one line: 'No space left on device: runs/a/metrics.jsonl'."""
    message = e.strerror or str(e) or type(e).__name__
    names = [n for n in (e.filename, e.filename2) if n is not None]
    if names:
        message += ": " + " -> ".join(os.fsdecode(n) if isinstance(n, bytes) else str(n) for n in names)
    return message.replace("\n", " ")


_DEVICE_BUSY = (
    "libtpu multi-process lockfile",
    "TPU is already in use",
    "Unable to initialize backend 'tpu'",
)


def device_busy(e: BaseException) -> str | None:
    """One line for an accelerator that another program holds (a TPU is opened by one process at a time);
    None for any other error."""
    text = str(e)
    if not any(mark in text for mark in _DEVICE_BUSY):
        return None
    return (
        "the TPU is held by another program (one process at a time may open it): wait for that one to end, or "
        "run this command on the CPU with JAX_PLATFORMS=cpu"
    )


class NoiseFilter(io.TextIOBase):
    """stderr, less the tracebacks Orbax's writer threads print when their event loop has gone after a failed
    save ('RuntimeError: Event loop is closed'): the one-line error already says what happened. Traceback
    lines are held until the exception line that ends them shows what they are; several threads' tracebacks
    may interleave, so every held line is judged by the next exception line."""

    NOISE = re.compile(r"^RuntimeError: Event loop is closed")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.pending = ""
        self.held: list[str] = []

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self._line(line + "\n")
        return len(text)

    def _line(self, line: str) -> None:
        if line.startswith("Traceback (most recent call last):") or line[:1] in (" ", "\t"):
            self.held.append(line)
            return
        held, self.held = self.held, []
        if not (held and self.NOISE.match(line)):
            self.stream.write("".join([*held, line]))

    def flush(self) -> None:
        self.stream.write(self.pending)
        self.pending = ""
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()
