"""`minigpt eval`: validation loss and bits per byte of a run, any text's bits per byte, lm-eval tasks."""

from __future__ import annotations

import tyro

from minigpt.commands.flags import parse


def main(args: list[str]) -> None:
    from minigpt.inference.evaluate import EvalConfig, run_eval

    run_eval(parse(lambda: tyro.cli(EvalConfig, args=args, prog="minigpt eval")))
