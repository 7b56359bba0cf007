"""What `minigpt` writes to stderr (console.py): tyro's error box, OSErrors and our warnings as one line each,
and Orbax's shutdown tracebacks kept off the terminal while every other line passes through."""

from __future__ import annotations

import errno
import io
import os
import warnings
from types import SimpleNamespace

import pytest

from minigpt.runtime import console
from minigpt.runtime.errors import DataWarning

UNICODE_BOX = """╭─ Parsing error ──────────────────────────────╮
│ Argument --steps: invalid literal for int()  │
│ with base 10: 'abc'                          │
│ ──────────────────────────────────────────── │
│ Argument helptext:                           │
╰──────────────────────────────────────────────╯"""


def test_tyros_error_box_becomes_its_first_section_in_one_line() -> None:
    expected = "Argument --steps: invalid literal for int() with base 10: 'abc' (see --help)"
    assert console.first_message(UNICODE_BOX) == expected
    ascii_box = UNICODE_BOX.translate(str.maketrans("╭╮╰╯│─", "++++|-"))
    assert console.first_message(ascii_box) == expected
    assert console.first_message("usage: x\nerror: bad\n") == "usage: x error: bad (see --help)"
    assert console.first_message("") == "could not parse the flags (see --help)"


def test_an_os_error_is_one_line_naming_its_files() -> None:
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "runs/a/metrics.jsonl")
    assert console.os_error(full) == "No space left on device: runs/a/metrics.jsonl"
    moved = OSError(errno.EROFS, os.strerror(errno.EROFS), b"runs/a/.tmp", None, "runs/a/config.json")
    assert console.os_error(moved) == "Read-only file system: runs/a/.tmp -> runs/a/config.json"
    assert console.os_error(OSError("two\nlines")) == "two lines"


def test_a_tpu_another_program_holds_is_one_line_saying_so(
    capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    """JAX's error when a second program opens a TPU (seen on a v5e: a RuntimeError naming libtpu's lockfile)
    ends the command with one line that says what holds it and what to do; other errors are not taken for it."""
    from minigpt.cli import COMMANDS, main

    held = RuntimeError("Unable to initialize backend 'tpu': INTERNAL: Internal error when accessing libtpu "
                        "multi-process lockfile. Run \"$ sudo lsof -w /dev/accel*\" to figure out which process")  # fmt: skip
    assert console.device_busy(held).startswith("the TPU is held by another program")
    assert console.device_busy(RuntimeError("INTERNAL: something else")) is None

    def busy(args: list[str]) -> None:
        raise held

    monkeypatch.setitem(COMMANDS, "train", SimpleNamespace(parse=lambda args: args, load=lambda: busy))
    with pytest.raises(SystemExit) as exc:
        main(["train"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 1 and len(err) == 1 and err[0].startswith("minigpt: error: the TPU is held"), err


def test_our_warnings_are_one_line_and_others_are_left_to_python(capsys: pytest.CaptureFixture) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = console.show_warning
        warnings.warn("3 bytes replaced in a.txt", DataWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert capsys.readouterr().err == "minigpt: warning: 3 bytes replaced in a.txt\n"


def test_orbax_event_loop_tracebacks_are_kept_off_the_terminal_and_others_are_not() -> None:
    """After a failed save Orbax's threads print 'Event loop is closed' tracebacks, interleaved; they are
    dropped, while any other traceback (a real bug) and ordinary lines pass through unchanged."""
    out = io.StringIO()
    stderr = console.NoiseFilter(out)
    noise = "Traceback (most recent call last):\n  File 'base_events.py'\n    self._check_closed()\n"
    stderr.write("warning: x\n" + noise + noise + "RuntimeError: Event loop is closed\n    more\n")
    stderr.write("RuntimeError: Event loop is closed\nTraceback (most recent call last):\n  File 'a.py'\n")
    stderr.write("ValueError: a real bug\nminigpt: error: saving the checkpoint")
    stderr.flush()
    assert out.getvalue() == (
        "warning: x\nTraceback (most recent call last):\n  File 'a.py'\nValueError: a real bug\n"
        "minigpt: error: saving the checkpoint"
    )
