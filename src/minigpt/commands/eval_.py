"""`minigpt eval`: validation loss and bits per byte of a run, any text's bits per byte, lm-eval tasks."""

from __future__ import annotations

from collections.abc import Callable

import tyro

from minigpt.commands.flags import read_flags
from minigpt.config import EvalConfig


def parse(args: list[str]) -> EvalConfig:
    return read_flags(lambda: tyro.cli(EvalConfig, args=args, prog="minigpt eval"))


def load() -> Callable[[EvalConfig], None]:
    from minigpt.inference.evaluate import run_eval

    return run_eval
